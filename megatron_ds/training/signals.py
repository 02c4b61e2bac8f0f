"""Walltime signals: SIGTERM / SIGUSR1 / SIGUSR2 finish the iteration, save, and exit 0.

PBS sends SIGTERM at walltime and on ``qdel`` (``qsig -s SIGUSR1`` on request); Grid Engine sends
SIGUSR1 when a soft limit (``-l s_rt``) passes and, with ``-notify``, SIGUSR2 before the SIGKILL
of ``qdel`` or ``h_rt``; torchrun and mpirun forward what they get. Not necessarily to every rank: mpirun forwards to its children, a scheduler may
signal one node's processes first, torchrun forwards to its own node's workers only. The handler
therefore only records the signal; at the end of every iteration all ranks agree with one small
all-reduce (MAX of [signal seen, time limit passed]) that also carries --exit-duration-in-mins,
so the per-iteration cost is the one collective that already existed for the time limit.

DataLoader worker processes ignore these signals (``ignore_stop_signals``): they reach them too when
sent to a process group or to every process of a job, and a worker killed by one would end the
trainer with an error before its save.

A second signal ends the process at once (exit status 128 + signal number), without saving --
unless it comes within REPEAT_WINDOW_S of the first: that is the same event arriving twice, e.g.
PBS signalling the whole session while mpirun or torchrun also forwards the signal it got.
(Python runs the handler between bytecodes, so a rank blocked inside a collective sees the second
signal once that collective returns or times out.)
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import multiprocessing
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

HANDLED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
REPEAT_WINDOW_S = 3.0


class StopSignals:
    """Installed for the training loop's lifetime (a context manager)."""

    def __init__(self, enabled: bool = True, signals=HANDLED):
        self.enabled = enabled
        self.signals = signals
        self.received: int | None = None
        self._first = 0.0
        self._previous = {}

    def _handler(self, signum, frame):  # noqa: ARG002 - signal handler signature
        name = signal.Signals(signum).name
        if self.received is None:
            self.received, self._first = signum, time.monotonic()
            print(f"received {name}: finishing this iteration, then saving and exiting (send it again "
                  f"to stop at once, without saving)", file=sys.stderr, flush=True)
        elif time.monotonic() - self._first > REPEAT_WINDOW_S:
            print(f"received {name} again: exiting now, without saving", file=sys.stderr, flush=True)
            os._exit(128 + signum)

    def __enter__(self):
        end_loader_workers_at_exit()
        if self.enabled:
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        return False

    @property
    def name(self) -> str | None:
        return signal.Signals(self.received).name if self.received else None


def ignore_stop_signals(worker_id: int | None = None) -> None:  # noqa: ARG001 - DataLoader's worker_init_fn
    """In a DataLoader worker process: ignore the stop signals. Sent to a whole process group
    (torchrun's forwarding) or to every process of the job (PBS, Grid Engine), they would kill the
    workers first, and the trainer would die on "DataLoader worker (pid N) is killed by signal:
    Terminated" instead of finishing the iteration and saving. The trainer ends them itself
    (``end_loader_workers_at_exit``) with SIGINT, which must therefore raise KeyboardInterrupt here even
    where the worker inherited it ignored: a shell starts background commands (``cmd &`` in a job script,
    ``nohup``) with SIGINT ignored, and such a worker would outlive the trainer's exit."""
    for sig in HANDLED:
        signal.signal(sig, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.default_int_handler)


@functools.lru_cache(maxsize=None)
def end_loader_workers_at_exit() -> None:
    """Once per process, in a process that starts loader workers running ``ignore_stop_signals``
    (``training/data.py build_loader``; the trainer's StopSignals too): without it such a process hangs at
    exit whenever a loader's iterator is still referenced. Registered after multiprocessing's exit handler
    (torch imports it first), so it runs before it."""
    atexit.register(_end_loader_workers)


def _end_loader_workers() -> None:
    """At exit, before multiprocessing's own exit handler: that one ends daemonic children (loader
    workers whose iterator is still referenced, e.g. by DeepSpeed's pipeline engine) with SIGTERM and
    waits for them, which workers ignoring SIGTERM would turn into a hang. SIGINT instead: a
    DataLoader worker's loop ends on KeyboardInterrupt and exits 0 (torch/utils/data/_utils/worker.py);
    SIGKILL for one still there after the wait. torch's SIGCHLD watch goes first: the process is
    exiting, and a worker it sees killed would raise out of this function before the others are ended
    (then multiprocessing's handler would wait for them forever)."""
    with contextlib.suppress(ValueError):  # (signal handlers are set from the main thread only)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    workers = [child for child in multiprocessing.active_children() if child.daemon]
    for child in workers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signal.SIGINT)
    for child in workers:
        child.join(timeout=10)
        if child.is_alive():
            child.kill()
            child.join(timeout=10)


def agreed_stop(signals: StopSignals | None, start: float, minutes: float | None, device,
                kill_switch_file: str | None = None) -> str | None:
    """Collective: why every rank stops now ("signal" / "time" / "kill switch"), or None. Skipped (no
    collective) when neither a handler, a time limit nor a --kill-switch-file is active, as before.
    The kill switch is Megatron-DeepSpeed's found_kill_switch (megatron/utils.py): the file exists. Each
    rank looks for itself (a node may see the file later than another), so they agree here."""
    if (signals is None or not signals.enabled) and minutes is None and kill_switch_file is None:
        return None
    timed_out = minutes is not None and (time.time() - start) / 60.0 > minutes
    killed = kill_switch_file is not None and os.path.exists(kill_switch_file)
    flags = torch.tensor([1 if signals is not None and signals.received else 0, 1 if timed_out else 0,
                          1 if killed else 0], device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    if flags[0].item():
        return "signal"
    if flags[1].item():
        return "time"
    return "kill switch" if flags[2].item() else None
