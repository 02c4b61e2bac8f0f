"""The DeepSpeed internals the interleaved pipeline executor relies on, in one place.

The executor drives DeepSpeed's plain engine the way DeepSpeed's own ``PipelineEngine`` drives
itself (``deepspeed/runtime/pipe/engine.py``): per-micro-batch backward passes without gradient
reduction, then the tied-embedding gradient all-reduce (``_exec_reduce_tied_grads``: the bf16
optimizer keeps the accumulated gradient in ``param._hp_grad``, the others in ``param.grad``),
then the data parallel reduction and the optimizer step at a forced accumulation boundary. Public
engine methods do the rest (``forward``, ``backward``, ``set_gradient_accumulation_boundary``,
``allreduce_gradients``, ``step``). What is not public is here, behind a version check, so a
DeepSpeed upgrade breaks in one place with one message.
"""
from __future__ import annotations

import deepspeed
from packaging.version import Version

from megatron_ds.config import ConfigError
from megatron_ds.training.checkpointing import is_bf16_optimizer

# Checked against 0.19 (what requirements.txt resolves to). Older releases scale fp16 losses in
# a different place (FP16_Optimizer.backward) than loss_scale below mirrors, so they are refused
# for this schedule rather than trusted blindly.
SUPPORTED = (Version("0.19"), Version("0.20"))


def check_version() -> None:
    found = Version(deepspeed.__version__.split("+")[0])
    if not SUPPORTED[0] <= found < SUPPORTED[1]:
        raise ConfigError(f"the interleaved pipeline schedule supports DeepSpeed >= {SUPPORTED[0]}, < {SUPPORTED[1]}; "
                          f"found {deepspeed.__version__} (megatron_ds/training/interleaved_ds.py lists what it uses)")


def accumulates_grads_in_fp32(engine) -> bool:
    """Whether the engine's optimizer sums micro-batch gradients in fp32 (bf16 runs)."""
    return is_bf16_optimizer(engine.optimizer)


def loss_scale(engine) -> float:
    """The factor ``engine.backward`` multiplies a loss by: DeepSpeed 0.19 scales only through a
    ZeRO-family optimizer's ``scale_if_loss`` (the bf16 optimizer has no scaler) or torch's
    GradScaler under ZeRO 0 with torch autocast; otherwise the loss goes in unscaled."""
    from deepspeed.runtime.base_optimizer import ZeROOptimizer  # noqa: PLC0415

    opt = engine.optimizer
    if isinstance(opt, ZeROOptimizer):
        if getattr(opt, "custom_loss_scaler", False):
            return float(opt.external_loss_scale)
        scaler = getattr(opt, "loss_scaler", None)
        return float(scaler.loss_scale) if scaler is not None else 1.0
    gradscaler = getattr(engine, "torch_autocast_z0_gradscaler", None)
    return float(gradscaler.get_scale()) if gradscaler is not None else 1.0


def accumulated_grad(engine, param):
    """The step's accumulated gradient of ``param`` before the data parallel reduction, as
    ``PipelineEngine._exec_reduce_tied_grads`` finds it; None if it has none."""
    return getattr(param, "_hp_grad", None) if is_bf16_optimizer(engine.optimizer) else param.grad


def use_layer_file_checkpoints(engine, load_module) -> None:
    """Make ``engine.save_checkpoint`` write no module weights into its ``mp_rank_*`` file (None,
    as ``PipelineEngine.module_state_dict`` returns after writing its per-layer files) and make
    ``engine.load_checkpoint`` read the module through ``load_module(strict)`` instead."""
    engine.module_state_dict = lambda *args, **kwargs: None

    def load_module_state_dict(checkpoint=None, strict=True, *args, **kwargs):
        load_module(strict)

    engine.load_module_state_dict = load_module_state_dict
