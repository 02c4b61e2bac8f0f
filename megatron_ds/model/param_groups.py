"""Which parameters decay: the optimizer's parameter groups of a model (Megatron's split).

Here, below both the optimizer (``megatron_ds.training.optimizer``) and the checkpoint readers
(``megatron_ds.checkpoint.plain_optim`` rebuilds a saved optimizer's groups from it): both must
agree on the groups and their order.
"""
from __future__ import annotations

import torch


def param_groups(model: torch.nn.Module, weight_decay: float, moe_groups: bool = False) -> list[dict]:
    """Megatron's split: no weight decay on biases and normalization weights (all 1-D tensors).

    ``moe_groups`` (--create-moe-param-group): MoE experts' parameters move to groups of their own, one per
    expert group and decay setting, by DeepSpeed's ``split_params_into_different_moe_groups_for_optimizer``
    (as Megatron-DeepSpeed's get_megatron_optimizer): its ZeRO and bf16 optimizers reduce and partition
    those over the expert data parallel ranks."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim == 1 or name.endswith(".bias") else decay).append(p)
    # wd_mult: what a weight-decay increment schedule scales (Megatron's get_param_groups sets the same key)
    groups = [{"params": decay, "weight_decay": weight_decay, "wd_mult": 1.0},
              {"params": no_decay, "weight_decay": 0.0, "wd_mult": 0.0}]
    groups = [g for g in groups if g["params"]]
    if moe_groups:
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer  # noqa: PLC0415

        for g in groups:  # the helper names each expert group after the dense group it came from
            g["name"] = "decay" if g["wd_mult"] else "no_decay"
        groups = [g for g in split_params_into_different_moe_groups_for_optimizer(groups) if g["params"]]
    return groups
