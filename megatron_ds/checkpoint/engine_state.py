"""Writing resharded weights and optimizer state into a live engine (``StateSetter``).

Optimizer state is written through DeepSpeed's public ``safe_set_full_fp32_param`` /
``safe_set_full_optimizer_state`` (ZeRO 1-3, bf16), which under ZeRO 1-2 and bf16 need each
parameter's link to its optimizer-state fragments. DeepSpeed makes those links lazily at the first
optimizer step and only once the base optimizer has state for its flat partitions: before the
first step we create that state (zeros, as Adam would) and make the links. ZeRO-3 needs the state
too (its setters index ``optimizer.state[flat partition]``). DeepSpeed's ZeRO-0 fp16 optimizers
have no such setters: their fp32 copies (the layout their ``state_dict()`` saves) and the torch
optimizer's state of them are written directly. The DeepSpeed internals this touches are in
``megatron_ds.ds_compat`` (checked against the version at start-up).
"""
from __future__ import annotations

import deepspeed
import torch

from megatron_ds import ds_compat
from megatron_ds.checkpoint.files import OPTIM_KEYS
from megatron_ds.errors import ConfigError


def _torch_optimizer(engine):
    opt = engine.optimizer
    return getattr(opt, "inner", opt)  # GuardedOptimizer wraps the torch one


@torch.no_grad()
def set_weight(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """A parameter's (tensor parallel local) weight. A ZeRO-3 parameter holds only its data parallel
    partition: it is gathered (DeepSpeed's public ``GatheredParameters``), written on data parallel
    rank 0 and re-partitioned from there on leaving the context."""
    if not ds_compat.is_zero3_param(param):
        param.data.copy_(value.to(param.dtype))
        return
    with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
        if torch.distributed.get_rank(group=ds_compat.zero3_param_group(param)) == 0:
            param.data.copy_(value.to(device=param.device, dtype=param.dtype).view(param.shape))


def set_optimizer_state(engine, param: torch.nn.Parameter, master: torch.Tensor, moments: dict) -> None:
    """This rank's shard of a parameter's fp32 master and Adam moments, into the engine's optimizer."""
    if ds_compat.is_zero3_param(param):  # ZeRO-3: Adam's state is also made at the first step
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state  # noqa: PLC0415

        ds_compat.create_optimizer_state(engine.optimizer)
        safe_set_full_fp32_param(param, master.to(param.device).reshape(-1))
        for key, value in moments.items():
            safe_set_full_optimizer_state(param, value.to(param.device).reshape(-1), key)
        return
    if ds_compat.has_fragment_mapping(param):
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state  # noqa: PLC0415

        ds_compat.link_hp_optimizer_state(engine.optimizer)
        safe_set_full_fp32_param(param, master.to(param.device))
        for key, value in moments.items():
            safe_set_full_optimizer_state(param, value.to(param.device), key)
        return
    if ds_compat.is_fp16_optimizer(engine.optimizer):
        _set_fp16_optimizer_state(engine.optimizer, param, master, moments)
        return
    if ds_compat.flat_partitions(engine.optimizer) is not None:
        raise ConfigError(f"DeepSpeed's optimizer holds a parameter of shape {tuple(param.shape)} without a "
                          f"fragment mapping; cannot reshard its state")
    opt = _torch_optimizer(engine)
    opt.state[param] = {"step": torch.zeros((), dtype=torch.float32),
                        **{k: v.to(device=param.device, dtype=param.dtype).clone() for k, v in moments.items()}}


def _keeps_master(engine, param: torch.nn.Parameter) -> bool:
    """Whether the optimizer updates an fp32 copy of ``param`` of its own (ZeRO 1-3, DeepSpeed's bf16 and
    fp16 optimizers) rather than ``param`` itself."""
    return (ds_compat.is_zero3_param(param) or ds_compat.has_fragment_mapping(param)
            or ds_compat.is_fp16_optimizer(engine.optimizer))


def _set_fp16_optimizer_state(opt, param: torch.nn.Parameter, master: torch.Tensor, moments: dict) -> None:
    """The fp32 master and Adam moments of ``param`` in DeepSpeed's ZeRO-0 fp16 optimizers: a slice
    of the group's flat master (FP16_Optimizer: the group's parameters concatenated in order) or
    the parameter's own fp32 copy (FP16_UnfusedOptimizer), and the torch optimizer's state of it."""
    for g, group in enumerate(ds_compat.fp16_optimizer_groups(opt)):
        j = next((j for j, p in enumerate(group) if p is param), None)
        if j is None:
            continue
        fp32, offset = ds_compat.fp16_optimizer_master(opt, g, j)
        if offset is not None:
            place = lambda t: t.detach().narrow(0, offset, param.numel())  # noqa: E731
        else:
            place = lambda t: t.detach().view(-1)  # noqa: E731
        state = ds_compat.base_optimizer(opt).state[fp32]
        if not state:
            state.update(step=torch.zeros((), dtype=torch.float32), exp_avg=torch.zeros_like(fp32.detach()),
                         exp_avg_sq=torch.zeros_like(fp32.detach()))
        place(fp32).copy_(master.reshape(-1))
        for key, value in moments.items():
            place(state[key]).copy_(value.reshape(-1))
        return
    raise ConfigError(f"DeepSpeed's fp16 optimizer does not hold a parameter of shape {tuple(param.shape)}")


def set_loss_scale(engine, saved: dict) -> bool:
    """An fp16 ZeRO-0 checkpoint's dynamic loss scaler state into an fp16 ZeRO-0 run's optimizer
    (both keep it in ``loss_scale_config``); False where this run has no such scaler."""
    config = ds_compat.fp16_loss_scale_config(engine.optimizer)
    if config is None:
        return False
    if saved.get("dynamic_loss_scale") != config.dynamic_loss_scale:
        return False  # static vs dynamic: this run's configuration decides
    for key, value in saved.items():
        if key != "dynamic_loss_scale" and hasattr(config, key):
            setattr(config, key, value)
    return True


def set_optimizer_step(engine, step: float) -> None:
    """Adam's step count (bias correction) on every state entry of the engine's base optimizer."""
    opt = engine.optimizer
    wraps = ds_compat.flat_partitions(opt) is not None or ds_compat.is_fp16_optimizer(opt)
    base = ds_compat.base_optimizer(opt) if wraps else _torch_optimizer(engine)
    fused = bool(base.defaults.get("fused") or base.defaults.get("capturable"))
    for param, state in base.state.items():
        if "step" in state:  # fused/capturable torch Adam keeps the step on the parameter's device
            state["step"] = torch.tensor(float(step), dtype=torch.float32, device=param.device if fused else "cpu")


class StateSetter:
    """Writes a parameter's shard into ``engine``'s module and, where the shard has them, its fp32
    master and Adam moments into the engine's optimizer."""

    def __init__(self, engine):
        self.engine = engine

    @torch.no_grad()
    def set(self, param: torch.nn.Parameter, shard: dict[str, torch.Tensor]) -> None:
        master = shard.get("fp32", shard["weight"])
        set_weight(param, master)
        if "exp_avg" in shard:
            set_optimizer_state(self.engine, param, master, {k: shard[k] for k in OPTIM_KEYS})
        elif _keeps_master(self.engine, param):
            # weights only (an imported model, --finetune, --no-load-optim): the optimizer's own fp32
            # copy must hold them too, or its first step writes the initial weights back over them
            # (DeepSpeed's loader refreshes it likewise: _restore_from_bit16_weights); moments start at 0
            set_optimizer_state(self.engine, param, master, {})

    def set_step(self, step: float) -> None:
        set_optimizer_step(self.engine, step)

    def set_loss_scale(self, saved: dict) -> bool:
        return set_loss_scale(self.engine, saved)
