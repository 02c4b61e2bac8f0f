"""The one place where resharding touches DeepSpeed internals (checked against the version).

Optimizer state is written through DeepSpeed's public ``safe_set_full_fp32_param`` /
``safe_set_full_optimizer_state``, which need each parameter's link to its optimizer-state
fragments. DeepSpeed (0.16-0.19) makes those links lazily at the first optimizer step
(``_lazy_init_hp_params_optimizer_state``) and only once the base optimizer has state for its flat
partitions: before the first step we create that state (zeros, as Adam would) and make the links.
"""
from __future__ import annotations

import deepspeed
import torch
from packaging.version import Version

from megatron_ds.config import ConfigError

_TESTED = (Version("0.16"), Version("0.20"))


def _check_version() -> None:
    v = Version(deepspeed.__version__.split("+")[0])
    if not _TESTED[0] <= v < _TESTED[1]:
        raise ConfigError(f"resharding optimizer state was written for DeepSpeed {_TESTED[0]} to <{_TESTED[1]}, "
                          f"found {deepspeed.__version__}; resume at the saved layout or pass --no-load-optim")


def _flat_partitions(opt) -> list[torch.Tensor] | None:
    for attr in ("single_partition_of_fp32_groups", "fp32_groups_flat_partition"):  # ZeRO 1-2, bf16
        if hasattr(opt, attr):
            return getattr(opt, attr)
    return None


def _link_optimizer_state(opt) -> None:
    if getattr(opt, "_hp_optimizer_states_linked", True):
        return
    for flat in _flat_partitions(opt):
        state = opt.optimizer.state[flat]
        if not state:
            state.update(step=torch.zeros((), dtype=torch.float32), exp_avg=torch.zeros_like(flat),
                         exp_avg_sq=torch.zeros_like(flat))
    opt._lazy_init_hp_params_optimizer_state()


def _torch_optimizer(engine):
    opt = engine.optimizer
    return getattr(opt, "inner", opt)  # GuardedOptimizer wraps the torch one


def set_optimizer_state(engine, param: torch.nn.Parameter, master: torch.Tensor, moments: dict) -> None:
    """This rank's shard of a parameter's fp32 master and Adam moments, into the engine's optimizer."""
    _check_version()
    if hasattr(param, "_hp_mapping"):
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state  # noqa: PLC0415

        _link_optimizer_state(engine.optimizer)
        safe_set_full_fp32_param(param, master.to(param.device))
        for key, value in moments.items():
            safe_set_full_optimizer_state(param, value.to(param.device), key)
        return
    if _flat_partitions(engine.optimizer) is not None:
        raise ConfigError(f"DeepSpeed's optimizer holds a parameter of shape {tuple(param.shape)} without a "
                          f"fragment mapping; cannot reshard its state")
    opt = _torch_optimizer(engine)
    opt.state[param] = {"step": torch.zeros((), dtype=torch.float32),
                        **{k: v.to(device=param.device, dtype=param.dtype).clone() for k, v in moments.items()}}


def set_optimizer_step(engine, step: float) -> None:
    """Adam's step count (bias correction) on every state entry of the engine's base optimizer."""
    opt = engine.optimizer
    base = opt.optimizer if _flat_partitions(opt) is not None else _torch_optimizer(engine)
    fused = bool(base.defaults.get("fused") or base.defaults.get("capturable"))
    for param, state in base.state.items():
        if "step" in state:  # fused/capturable torch Adam keeps the step on the parameter's device
            state["step"] = torch.tensor(float(step), dtype=torch.float32, device=param.device if fused else "cpu")
