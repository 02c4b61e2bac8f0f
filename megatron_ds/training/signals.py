"""Walltime signals: SIGTERM / SIGUSR1 / SIGUSR2 finish the iteration, save, and exit 0.

PBS sends SIGTERM at walltime and on ``qdel`` (``qsig -s SIGUSR1`` on request); Grid Engine sends
SIGUSR1 when a soft limit (``-l s_rt``) passes and, with ``-notify``, SIGUSR2 before the SIGKILL
of ``qdel`` or ``h_rt``; torchrun and mpirun forward what they get. Not necessarily to every rank: mpirun forwards to its children, a scheduler may
signal one node's processes first, torchrun forwards to its own node's workers only. The handler
therefore only records the signal; at the end of every iteration all ranks agree with one small
all-reduce (MAX of [signal seen, time limit passed]) that also carries --exit-duration-in-mins,
so the per-iteration cost is the one collective that already existed for the time limit.

A second signal ends the process at once (exit status 128 + signal number), without saving --
unless it comes within REPEAT_WINDOW_S of the first: that is the same event arriving twice, e.g.
PBS signalling the whole session while mpirun or torchrun also forwards the signal it got.
(Python runs the handler between bytecodes, so a rank blocked inside a collective sees the second
signal once that collective returns or times out.)
"""
from __future__ import annotations

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
