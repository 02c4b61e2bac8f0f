"""Which parameters decay: the optimizer's parameter groups of a model (Megatron's split).

Here, below both the optimizer (``megatron_ds.training.optimizer``) and the checkpoint readers
(``megatron_ds.checkpoint.plain_optim`` rebuilds a saved optimizer's groups from it): both must
agree on the groups and their order.
"""
from __future__ import annotations

import torch


EMBEDDING_OR_OUTPUT = "is_embedding_or_output_parameter"
"""The attribute (Megatron-LM's name, megatron/core/models/common/language_module/language_module.py) that
marks the word embedding weight and the untied output layer weight (``model/language_model.py``):
--decoupled-lr's parameters."""

DECAY = "apply_weight_decay"
"""An attribute that overrides the split for one parameter (True: decays though 1-D): --qk-layernorm's
norm weights under --apply-wd-to-qk-layernorm (``model/transformer.py``), which Megatron-LM's
get_param_groups (megatron/core/optimizer/__init__.py) takes out of the no-decay rule by their names."""


def param_groups(model: torch.nn.Module, weight_decay: float, moe_groups: bool = False,
                 decoupled_lr: tuple[float, float] | None = None) -> list[dict]:
    """Megatron's split: no weight decay on biases and normalization weights (all 1-D tensors), unless the
    parameter's ``DECAY`` attribute says otherwise.

    ``decoupled_lr`` (--decoupled-lr, --decoupled-min-lr): the parameters marked ``EMBEDDING_OR_OUTPUT``
    go to groups of their own (after the others, per decay setting) carrying that ``max_lr`` and
    ``min_lr``, which the LR schedule follows for them (Megatron-LM's _get_param_groups overrides
    ``max_lr`` / ``min_lr`` of the groups whose parameters carry the attribute).

    ``moe_groups`` (--create-moe-param-group): MoE experts' parameters move to groups of their own, one per
    expert group and decay setting, by DeepSpeed's ``split_params_into_different_moe_groups_for_optimizer``
    (as Megatron-DeepSpeed's get_megatron_optimizer): its ZeRO and bf16 optimizers reduce and partition
    those over the expert data parallel ranks."""
    decay, no_decay, own_decay, own_no_decay = [], [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        own = decoupled_lr is not None and getattr(p, EMBEDDING_OR_OUTPUT, False)
        skip_decay = not getattr(p, DECAY) if hasattr(p, DECAY) else p.ndim == 1 or name.endswith(".bias")
        ((own_no_decay if own else no_decay) if skip_decay else (own_decay if own else decay)).append(p)
    # wd_mult: what a weight-decay increment schedule scales (Megatron's get_param_groups sets the same key)
    groups = [{"params": decay, "weight_decay": weight_decay, "wd_mult": 1.0},
              {"params": no_decay, "weight_decay": 0.0, "wd_mult": 0.0}]
    if decoupled_lr is not None:
        lrs = {"max_lr": decoupled_lr[0], "min_lr": decoupled_lr[1]}
        groups += [{"params": own_decay, "weight_decay": weight_decay, "wd_mult": 1.0, **lrs},
                   {"params": own_no_decay, "weight_decay": 0.0, "wd_mult": 0.0, **lrs}]
    groups = [g for g in groups if g["params"]]
    if moe_groups:
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer  # noqa: PLC0415

        for g in groups:  # the helper names each expert group after the dense group it came from (unique names:
            # it keys its expert groups by them; --decoupled-lr's groups hold no expert parameter)
            g["name"] = ("decoupled_" if "max_lr" in g else "") + ("decay" if g["wd_mult"] else "no_decay")
        groups = [g for g in split_params_into_different_moe_groups_for_optimizer(groups) if g["params"]]
    return groups
