"""Checks that run at start-up, before any compute: the --save directory (writable, room for the next
checkpoint -- a warning when not for all the run's saves -- and not used by another job), the
rendezvous port, and a start-up barrier that names the ranks that never arrived. Every failure is a
ConfigError with one line saying what to change."""
from __future__ import annotations

import errno
import os
import shutil
import socket
from datetime import timedelta

import torch.distributed as dist

from megatron_ds.checkpoint.format import layout_signature, read_tracker
from megatron_ds.checkpoint.lock import LockHeld, SaveLock
from megatron_ds.checkpoint.room import (checkpoint_room, complete_checkpoints, human_bytes, peak_new_checkpoints,
                                         saves_planned)
from megatron_ds.errors import ConfigError


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


def check_save_dir(settings, layout, *, dry_run_warn=None, log=print) -> None:
    """--save (``settings``: the run's CheckpointConfig) must be writable and have room for the next
    checkpoint (found now, not when the first save fails), measured from a checkpoint of this layout
    in --save or --load where there is one, else estimated (``checkpoint.room``). Room for fewer
    checkpoints than the run writes (and keeps: --keep-last) is a warning, which names the
    --keep-last that fits where there is one. With ``dry_run_warn`` (--dry-run) a --save that does not
    exist yet is not created (its nearest existing parent is probed instead), and too little room is
    a warning: the room may change before the job starts, whose start-up checks it again."""
    save_dir = settings.save
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
    start = 0 if settings.finetune or not settings.load else (read_tracker(settings.load)[0] or 0)
    saves = saves_planned(start, layout.train_iters, settings.save_interval)
    if saves == 0:
        return
    free = shutil.disk_usage(where).free
    size, how = checkpoint_room(layout, layout_signature(layout), (save_dir, settings.load))
    if free < size:
        # pruning (--keep-last) runs after a save completes: it cannot make room for the first one
        problem = (f"--save {save_dir} has {human_bytes(free)} free, but one checkpoint needs about "
                   f"{human_bytes(size)} ({how}); free space or choose another --save")
        if dry_run_warn is None:
            raise ConfigError(problem)
        dry_run_warn(f"WARNING: {problem}")
        return
    warning = _room_for_saves(save_dir, free, size, saves, settings.keep_last)
    if warning:
        (dry_run_warn or log)(warning)


def _room_for_saves(save_dir: str, free: int, size: int, saves: int, keep_last: int | None) -> str | None:
    """A warning when the run's saves (less what --keep-last prunes after each) outgrow ``free``."""
    existing = complete_checkpoints(save_dir)
    fits = free // size
    need = peak_new_checkpoints(saves, existing, keep_last)
    if need <= fits:
        return None
    kept = f" with --keep-last {keep_last}" if keep_last else ""
    line = (f"WARNING: --save {save_dir} has room for {fits} more checkpoint{'s' if fits != 1 else ''} "
            f"({human_bytes(free)} free, about {human_bytes(size)} each), but this run's {saves} saves{kept} "
            f"need room for {need} at once: a later save will fail with the disk full")
    best = fits - 1 + existing  # the largest --keep-last whose saves fit (``peak_new_checkpoints``)
    return line + (f"; pass --keep-last {best}, or free space" if best >= 1 else "; free space or choose another --save")


def _agree(error: str | None) -> None:
    """rank 0 decided; every rank raises the same one-line error (or none)."""
    if dist.get_world_size() > 1:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error:
        raise ConfigError(error)


def prepare_save_dir(settings, layout, timeout_minutes: float, log=print) -> SaveLock | None:
    """Collective: rank 0 checks --save (``settings``: the run's CheckpointConfig) and takes its lock.
    Returns the lock on rank 0. Waiting for a holder that may be gone (``lock``) ends well before the
    other ranks' collective would time out."""
    save_dir = settings.save
    lock, error = None, None
    if dist.get_rank() == 0:
        try:
            check_save_dir(settings, layout, log=log)
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
