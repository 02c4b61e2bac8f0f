"""Which parameters decay: the optimizer's parameter groups of a model (Megatron's split).

Here, below both the optimizer (``megatron_ds.training.optimizer``) and the checkpoint readers
(``megatron_ds.checkpoint.plain_optim`` rebuilds a saved optimizer's groups from it): both must
agree on the groups and their order.
"""
from __future__ import annotations

import torch


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Megatron's split: no weight decay on biases and normalization weights (all 1-D tensors)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim == 1 or name.endswith(".bias") else decay).append(p)
    # wd_mult: what a weight-decay increment schedule scales (Megatron's get_param_groups sets the same key)
    groups = [{"params": decay, "weight_decay": weight_decay, "wd_mult": 1.0},
              {"params": no_decay, "weight_decay": 0.0, "wd_mult": 0.0}]
    return [g for g in groups if g["params"]]
