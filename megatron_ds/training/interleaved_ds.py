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

# Checked against 0.19 (the CI version); the attributes below exist unchanged since 0.16.
SUPPORTED = (Version("0.16"), Version("0.20"))


def check_version() -> None:
    found = Version(deepspeed.__version__.split("+")[0])
    if not SUPPORTED[0] <= found < SUPPORTED[1]:
        raise ConfigError(f"the interleaved pipeline schedule supports DeepSpeed >= {SUPPORTED[0]}, < {SUPPORTED[1]}; "
                          f"found {deepspeed.__version__} (megatron_ds/training/interleaved_ds.py lists what it uses)")


def _is_bf16_optimizer(optimizer) -> bool:
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer  # noqa: PLC0415

    return isinstance(optimizer, BF16_Optimizer)


def accumulates_grads_in_fp32(engine) -> bool:
    """Whether the engine's optimizer sums micro-batch gradients in fp32 (bf16 runs)."""
    return _is_bf16_optimizer(engine.optimizer)


def loss_scale(engine) -> float:
    """The factor the engine's ``backward`` multiplies a loss by (1 without fp16 loss scaling)."""
    if not engine.fp16_enabled():
        return 1.0
    opt = engine.optimizer
    scaler = getattr(opt, "loss_scaler", None)
    if scaler is not None:  # ZeRO optimizers
        return float(scaler.loss_scale)
    config = getattr(opt, "loss_scale_config", None)  # FP16_Optimizer (0.19)
    return float(config.cur_scale if config is not None else opt.cur_scale)


def accumulated_grad(engine, param):
    """The step's accumulated gradient of ``param`` before the data parallel reduction, as
    ``PipelineEngine._exec_reduce_tied_grads`` finds it; None if it has none."""
    return getattr(param, "_hp_grad", None) if _is_bf16_optimizer(engine.optimizer) else param.grad


def use_layer_file_checkpoints(engine, load_module) -> None:
    """Make ``engine.save_checkpoint`` write no module weights into its ``mp_rank_*`` file (None,
    as ``PipelineEngine.module_state_dict`` returns after writing its per-layer files) and make
    ``engine.load_checkpoint`` read the module through ``load_module(strict)`` instead."""
    engine.module_state_dict = lambda *args, **kwargs: None

    def load_module_state_dict(checkpoint=None, strict=True, *args, **kwargs):
        load_module(strict)

    engine.load_module_state_dict = load_module_state_dict
