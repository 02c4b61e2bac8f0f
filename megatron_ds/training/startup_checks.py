"""Checks that run at start-up, before any compute: the --save directory (writable, room for one
checkpoint, not used by another job), the rendezvous port, and a start-up barrier that names the
ranks that never arrived. Every failure is a ConfigError with one line saying what to change."""
from __future__ import annotations

import errno
import os
import shutil
import socket
from datetime import timedelta

import torch.distributed as dist

from megatron_ds.checkpoint.lock import LockHeld, SaveLock
from megatron_ds.errors import ConfigError


def checkpoint_bytes(layout) -> int:
    """Estimated size of one checkpoint: the module in its precision plus fp32 master weights and
    two Adam moments (12 bytes/parameter) when mixed precision keeps them, 8 (moments) in fp32."""
    weight = {"fp16": 2, "bf16": 2}.get(layout.precision, 4)
    optimizer = 12 if weight == 2 else 8
    return layout.total_params * (weight + optimizer)


def _probe_writable(directory: str) -> None:
    os.makedirs(directory, exist_ok=True)
    probe = os.path.join(directory, f".write_probe.{socket.gethostname()}.{os.getpid()}")
    with open(probe, "wb") as f:
        f.write(b"x")
        f.flush()
        os.fsync(f.fileno())
    os.unlink(probe)


def _nearest_existing(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def check_save_dir(save_dir: str, needed_bytes: int, *, dry_run_warn=None) -> None:
    """--save must be writable and have room for one checkpoint (found now, not at the first save).
    With ``dry_run_warn`` (--dry-run) a --save that does not exist yet is not created (its nearest
    existing parent is probed instead), and too little room is a warning: the room may change
    before the job starts, whose start-up checks it again."""
    where = save_dir if dry_run_warn is None else _nearest_existing(save_dir)
    try:
        if not os.path.isdir(where) and dry_run_warn is not None:
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), where)
        _probe_writable(where)
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ConfigError(f"--save {save_dir} is not writable ({reason}"
                          f"{': ' + exc.filename if exc.filename and exc.filename != save_dir else ''}); "
                          f"choose a directory this job can write to") from None
    free = shutil.disk_usage(where).free
    if free < needed_bytes:
        problem = (f"--save {save_dir} has {free / 1e9:.1f} GB free, but one checkpoint needs about "
                   f"{needed_bytes / 1e9:.1f} GB; free space, use --keep-last, or choose another --save")
        if dry_run_warn is None:
            raise ConfigError(problem)
        dry_run_warn(f"WARNING: {problem}")


def _agree(error: str | None) -> None:
    """rank 0 decided; every rank raises the same one-line error (or none)."""
    if dist.get_world_size() > 1:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error:
        raise ConfigError(error)


def prepare_save_dir(save_dir: str, layout, timeout_minutes: float, log=print) -> SaveLock | None:
    """Collective: rank 0 checks --save and takes its lock. Returns the lock on rank 0. Waiting for a
    holder that may be gone (``lock``) ends well before the other ranks' collective would time out."""
    lock, error = None, None
    if dist.get_rank() == 0:
        try:
            check_save_dir(save_dir, checkpoint_bytes(layout))
            lock = SaveLock(save_dir)
            lock.acquire(log=log, wait_limit_s=0.8 * timeout_minutes * 60)
        except (ConfigError, LockHeld) as exc:
            error = str(exc)
    _agree(error)
    return lock


def explain_init_error(exc: Exception) -> ConfigError | None:
    """A rendezvous port clash (two runs on one host without a launcher) as one line."""
    text = str(exc)
    if "EADDRINUSE" in text or "address already in use" in text.lower() or \
            getattr(exc, "errno", None) == errno.EADDRINUSE:
        port = os.environ.get("MASTER_PORT", "29500")
        return ConfigError(f"MASTER_PORT {port} on {os.environ.get('MASTER_ADDR', 'this host')} is already "
                           f"in use (another run on this host?); set MASTER_PORT to a free port, or start "
                           f"with torchrun --standalone, which picks one")
    return None


def startup_barrier(timeout_minutes: float) -> None:
    """All ranks meet before any compute; on gloo, rank 0 names the ranks that never arrived."""
    if dist.get_world_size() == 1:
        return
    if dist.get_backend() != "gloo":
        dist.barrier()  # NCCL: its watchdog reports a timeout naming the operation
        return
    try:
        dist.monitored_barrier(timeout=timedelta(minutes=timeout_minutes), wait_all_ranks=True)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"start-up barrier: not every rank arrived within --distributed-timeout-minutes "
                          f"{timeout_minutes:g} ({first})") from None
