"""A worker whose launcher is gone stops.

torchrun, the deepspeed launcher and Open MPI's daemon start the workers as their children and are
what signals them, restarts them or tears the job down. Killed with SIGKILL alone (an OOM killer, a
`kill -9` of the wrong pid), a launcher leaves its workers running on -- unsupervised, holding GPUs and
the --save lock, possibly starting a save the rest of the job will never finish. A daemon thread waits
for the launcher's exit and ends the worker at once: os._exit, no save, no collective that would hang
on the ranks that are gone (a save it was in is an interrupted one, which the next run moves aside).

The wait is on a pidfd of the launcher (Linux 5.3+), which wakes the thread the moment the launcher
exits; elsewhere it polls every POLL_S whether the process has a new parent (an orphan is re-parented
to init or a subreaper). At once matters: torchrun hosts the c10d store, and every call to the dead
store -- NCCL's heartbeat monitor makes one a second -- prints a warning with a 20-frame C++ stack, so
the worker also silences torch's C++ warnings before its one line.

A process started by hand (``python pretrain_gpt.py``, launcher "single") is not watched: its parent
is a shell, which may go away on purpose (``nohup``).
"""
from __future__ import annotations

import os
import select
import sys
import threading
import time

from megatron_ds.ds_compat import quiet_cpp_warnings

POLL_S = 0.2
EXIT_STATUS = 1


def watch_launcher(launcher: str, *, poll_s: float = POLL_S) -> threading.Thread | None:
    """Start the watch for a worker started by ``launcher`` (``DistEnv.launcher``); None when not watched."""
    if launcher == "single":
        return None
    parent = os.getppid()
    wait = _launcher_exit(parent, poll_s)

    def watch():
        wait()
        quiet_cpp_warnings()
        print(f"error: the {launcher} launcher (pid {parent}) is gone: stopping this worker (pid "
              f"{os.getpid()}) now, without saving", file=sys.stderr, flush=True)
        os._exit(EXIT_STATUS)

    thread = threading.Thread(target=watch, name="launcher-watch", daemon=True)
    thread.start()
    return thread


def _launcher_exit(parent: int, poll_s: float):
    """A function that returns once ``parent`` has exited: a wait on its pidfd, else a poll of getppid."""
    try:
        pidfd = os.pidfd_open(parent)
    except (AttributeError, OSError):  # no pidfd here, or the launcher already gone (then the poll returns at once)
        pidfd = None
    # A pidfd opened after the launcher died could name another process that took its pid; the launcher
    # still being the parent now proves it was alive when the pidfd was opened.
    if pidfd is not None and os.getppid() != parent:
        os.close(pidfd)
        pidfd = None

    def poll():
        while os.getppid() == parent:
            time.sleep(poll_s)

    def wait_on_pidfd():
        select.select([pidfd], [], [])  # readable once the process has exited

    return poll if pidfd is None else wait_on_pidfd
