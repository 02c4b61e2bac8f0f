"""Stop signals: SIGTERM / SIGUSR1 / SIGUSR2 (walltime) and SIGINT (Ctrl-C) finish the iteration, save,
and exit -- 0 after a walltime signal, 130 after Ctrl-C (``Interrupted``), as a shell reports a command
that Ctrl-C ended, so ``pretrain ... && next-step`` does not go on.

PBS sends SIGTERM at walltime and on ``qdel`` (``qsig -s SIGUSR1`` on request); Grid Engine sends
SIGUSR1 when a soft limit (``-l s_rt``) passes and, with ``-notify``, SIGUSR2 before the SIGKILL
of ``qdel`` or ``h_rt``; torchrun and mpirun forward what they get. Not necessarily to every rank: mpirun forwards to its children, a scheduler may
signal one node's processes first, torchrun forwards to its own node's workers only. The handler
therefore only records the signal; at the end of every iteration all ranks agree with one small
all-reduce (MAX of [signal seen, time limit passed]) that also carries --exit-duration-in-mins,
so the per-iteration cost is the one collective that already existed for the time limit.

DataLoader worker processes ignore these signals (``ignore_stop_signals``): they reach them too when
sent to a process group (a terminal's Ctrl-C, torchrun's forwarding) or to every process of a job, and
a worker ended by one would end the trainer with an error before its save. The trainer ends them at
exit with a signal of its own (``END_LOADER_WORKER``).

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
import threading
import time

import torch
import torch.distributed as dist

from megatron_ds.errors import Interrupted

HANDLED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT)
REPEAT_WINDOW_S = 3.0
# What ends a loader worker at the trainer's exit: a real-time signal, which no terminal, launcher or
# scheduler sends to a process group (SIGINT, which torch's worker loop ends on, is a stop signal now)
END_LOADER_WORKER = signal.SIGRTMIN


class StopSignals:
    """Installed for the training loop's lifetime (a context manager)."""

    def __init__(self, enabled: bool = True, signals=HANDLED):
        self.enabled = enabled
        self.signals = signals
        self.received: int | None = None
        self.interrupted = False  # the stop the ranks agreed on (agreed_stop) was a Ctrl-C on some rank
        self._first = 0.0
        self._previous = {}

    def _handler(self, signum, frame):  # noqa: ARG002 - signal handler signature
        name = signal.Signals(signum).name
        if self.received is None:
            self.received, self._first = signum, time.monotonic()
            print(f"received {name}: finishing this iteration, then saving and exiting (send it again, "
                  f"{REPEAT_WINDOW_S:g} s or more later, to stop at once without saving)", file=sys.stderr,
                  flush=True)
        elif time.monotonic() - self._first > REPEAT_WINDOW_S:
            exit_now(f"received {name} again: exiting now, without saving", 128 + signum)

    def __enter__(self):
        end_loader_workers_at_exit()
        if self.enabled:
            for sig in self.signals:
                if sig == signal.SIGINT and signal.getsignal(sig) == signal.SIG_IGN:
                    continue  # started with Ctrl-C ignored (``cmd &`` in a script): it stays so, as in Python
                self._previous[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        return False

    def raise_if_interrupted(self) -> None:
        """After the loop: a stop the ranks agreed on because of a Ctrl-C ends the run as Ctrl-C does
        (``Interrupted``, exit status 130), on every rank alike; it saved like any stop signal."""
        if self.interrupted:
            raise Interrupted()

    @property
    def name(self) -> str | None:
        return signal.Signals(self.received).name if self.received else None


def exit_now(line: str, status: int) -> None:
    """End this process at once: ``line`` on stderr, no save, no exit handlers (they may wait on a
    collective or a save), the loader workers told to end rather than left to notice the exit. Written
    to the file descriptor: called from a signal handler, a print could land inside another print of
    the interrupted code and raise instead ("reentrant call")."""
    with contextlib.suppress(RuntimeError, ValueError, OSError):
        sys.stdout.flush()  # the lines printed so far (iteration lines), unless that is what was interrupted
    with contextlib.suppress(OSError):
        os.write(2, f"{line}\n".encode())
    for child in multiprocessing.active_children():
        if child.daemon:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, END_LOADER_WORKER)
    os._exit(status)


def exit_at_next_interrupt() -> None:
    """Once a Ctrl-C is ending the run (``pretrain.main``): another one exits at once, in one line, instead
    of raising KeyboardInterrupt into the process group's tear-down or the exit handlers."""
    with contextlib.suppress(ValueError):  # (signal handlers are set from the main thread only)
        signal.signal(signal.SIGINT, lambda signum, frame: exit_now(
            "received SIGINT again: exiting now", 128 + signal.SIGINT))


@contextlib.contextmanager
def interrupt_deferred():
    """Around the start of DataLoader worker processes (``training/data.py``): a Ctrl-C arriving while the
    process forks is held back and raised again after it (the handler then in place runs it). Python runs
    a signal's handler at the next bytecode, which right after a fork is inside logging's after-fork hook
    (``os.register_at_fork``): a KeyboardInterrupt raised there is printed as "Exception ignored" and
    lost -- the run trains on, with logging's lock held. The forked worker inherits the holding handler
    until ``ignore_stop_signals`` replaces it, so it cannot print that either."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        yield  # (only the main thread may set handlers; an ignored Ctrl-C needs no holding back)
        return
    held = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if held:
            signal.raise_signal(signal.SIGINT)


def ignore_stop_signals(worker_id: int | None = None) -> None:  # noqa: ARG001 - DataLoader's worker_init_fn
    """In a DataLoader worker process: ignore the stop signals. Sent to a whole process group
    (Ctrl-C at a terminal, torchrun's forwarding) or to every process of the job (PBS, Grid Engine),
    they would end the workers first -- SIGINT quietly, SIGTERM with "DataLoader worker (pid N) is
    killed by signal: Terminated" -- and the trainer would fail on its next batch instead of finishing
    the iteration and saving. The trainer ends them itself (``end_loader_workers_at_exit``) with
    END_LOADER_WORKER, which raises KeyboardInterrupt here: torch's worker loop ends on it and the
    worker exits 0, silently."""
    for sig in HANDLED:
        signal.signal(sig, signal.SIG_IGN)
    signal.signal(END_LOADER_WORKER, _end_worker_loop)


def _end_worker_loop(signum, frame):  # noqa: ARG001 - signal handler signature
    raise KeyboardInterrupt


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
    waits for them, which workers ignoring SIGTERM would turn into a hang. END_LOADER_WORKER instead: a
    DataLoader worker's loop ends on the KeyboardInterrupt it raises and exits 0
    (torch/utils/data/_utils/worker.py); SIGKILL for one still there after the wait. torch's SIGCHLD
    watch goes first: the process is exiting, and a worker it sees killed would raise out of this
    function before the others are ended (then multiprocessing's handler would wait for them forever)."""
    with contextlib.suppress(ValueError):  # (signal handlers are set from the main thread only)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    workers = [child for child in multiprocessing.active_children() if child.daemon]
    for child in workers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, END_LOADER_WORKER)
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
    # signal: 2 for a Ctrl-C, 1 for another stop signal; a Ctrl-C on any rank makes every rank exit 130
    received = signals.received if signals is not None else None
    flags = torch.tensor([0 if received is None else 2 if received == signal.SIGINT else 1, 1 if timed_out else 0,
                          1 if killed else 0], device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    if flags[0].item():
        if signals is not None:
            signals.interrupted = flags[0].item() == 2
        return "signal"
    if flags[1].item():
        return "time"
    return "kill switch" if flags[2].item() else None
