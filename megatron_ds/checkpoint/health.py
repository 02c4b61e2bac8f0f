"""Whether a live engine's training state is finite, and what a checkpoint records of it.

A diverged run (a learning rate far too high, a bad batch) first reports a NaN/inf loss; its weights
may stay finite but useless (huge values whose forward overflows: DeepSpeed's optimizers and our
``GuardedOptimizer`` skip every step whose gradient is non-finite, so nothing brings them back) or
turn NaN themselves. Such a state must never be written over or instead of a finite checkpoint:
``save_checkpoint`` refuses to save when the loss of the iteration being saved is non-finite or
when any weight or optimizer-state value is (``state_finite``: one flag over this rank's shards,
all-reduced). fp16 loss scaling skips steps with inf gradients as a matter of course: those steps
leave the weights and the loss finite, so they never count as divergence here.

Each checkpoint records the loss of its iteration (``HEALTH`` in its meta) after the check passed.
Loading refuses a checkpoint whose record says otherwise (``check_record``, before reading a
tensor), and checks the loaded state itself for one without a record (``check_state``: saved before
the record existed, or converted by another tool).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megatron_ds import ds_compat
from megatron_ds.errors import ConfigError, TrainingStopped

HEALTH = "health"  # the meta key: {"loss": <the saved iteration's loss>, "finite": true}
_CHUNK = 1 << 26  # elements checked at once: bounds the temporary boolean tensor (64 MB)


class NonFiniteState(TrainingStopped):
    """The state to save is not finite; the message says which part (the loss, the weights)."""


def _torch_optimizer(opt):
    """The torch optimizer holding the fp32 masters and Adam's moments: the one our
    ``GuardedOptimizer`` or DeepSpeed's ZeRO / bf16 / fp16 optimizers wrap, else ``opt`` itself."""
    if hasattr(opt, "inner"):
        return opt.inner
    if ds_compat.flat_partitions(opt) is not None or ds_compat.is_fp16_optimizer(opt):
        return ds_compat.base_optimizer(opt)
    return opt


def _local_tensors(engine):
    """This rank's weights (its tensor/pipeline shard; ZeRO-3: an empty placeholder whose values are
    the optimizer's fp32 partition) and optimizer state (masters, moments)."""
    yield from engine.module.parameters()
    opt = _torch_optimizer(engine.optimizer) if engine.optimizer is not None else None
    if opt is None:
        return
    for group in opt.param_groups:
        yield from group["params"]
    for state in opt.state.values():
        yield from (v for v in state.values() if torch.is_tensor(v))


def local_state_finite(engine) -> bool:
    """Not collective: every floating-point value of this rank's weights and optimizer state is finite."""
    flags: dict[torch.device, list[torch.Tensor]] = {}
    for tensor in _local_tensors(engine):
        if not tensor.is_floating_point() or tensor.numel() == 0:
            continue
        flat = tensor.detach().reshape(-1)
        flags.setdefault(flat.device, []).extend(torch.isfinite(c).all() for c in flat.split(_CHUNK))
    # one host sync per device, not one per tensor
    return all(bool(torch.stack(f).all()) for f in flags.values())


def state_finite(engine) -> bool:
    """Collective: every rank's weights and optimizer state are finite."""
    flag = torch.tensor(1.0 if local_state_finite(engine) else 0.0, device=engine.device)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item() == 1.0)


def check_before_save(engine, iteration: int, loss: float | None) -> dict:
    """Collective. The record to save with the checkpoint of ``iteration``; raises NonFiniteState
    when its loss or any weight or optimizer-state value is NaN/inf (every rank has the same loss:
    the loop's loss is reduced over the ranks, so they all raise together)."""
    if loss is not None and not math.isfinite(loss):
        raise NonFiniteState(f"the loss of iteration {iteration} is {loss}")
    if not state_finite(engine):
        raise NonFiniteState(f"the weights or optimizer state hold NaN/inf after iteration {iteration}")
    return {"loss": loss, "finite": True}


_REMEDY = "load an older checkpoint (--ckpt-step N) or another --load, and lower --lr before going on from it"


def check_record(path: str, meta: dict | None) -> bool:
    """Not collective, before loading ``path`` (``meta``: its saved meta, None if it has none): refuse a
    checkpoint whose record says its state is not finite. Returns whether it has a record; without
    one, ``check_state`` must look at the state once it is loaded."""
    record = (meta or {}).get(HEALTH)
    if not isinstance(record, dict):
        return False
    loss = record.get("loss")
    if record.get("finite") is not True or (loss is not None and not math.isfinite(float(loss))):
        raise ConfigError(f"refusing to resume from {path}: its recorded loss is {loss} (the run that saved it "
                          f"had diverged); {_REMEDY}")
    return True


def check_state(engine, path: str) -> None:
    """Collective, after loading ``path`` into ``engine``: refuse to resume from NaN/inf weights or
    optimizer state (a checkpoint without a record: saved before records existed, or converted)."""
    if not state_finite(engine):
        raise ConfigError(f"refusing to resume from {path}: its weights or optimizer state hold NaN/inf (the run "
                          f"that saved it had diverged); {_REMEDY}")
