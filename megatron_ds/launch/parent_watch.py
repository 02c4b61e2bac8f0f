"""A worker whose launcher is gone stops.

torchrun, the deepspeed launcher and Open MPI's daemon start the workers as their children and are
what signals them, restarts them or tears the job down. Killed with SIGKILL alone (an OOM killer, a
`kill -9` of the wrong pid), a launcher leaves its workers running on -- unsupervised, holding GPUs and
the --save lock, possibly starting a save the rest of the job will never finish. A daemon thread
notices within POLL_S that the process has a new parent (the orphan is re-parented to init or a
subreaper) and ends the worker at once: os._exit, no save, no collective that would hang on the
ranks that are gone (a save it was in is an interrupted one, which the next run moves aside).

A process started by hand (``python pretrain_gpt.py``, launcher "single") is not watched: its parent
is a shell, which may go away on purpose (``nohup``).
"""
from __future__ import annotations

import os
import sys
import threading
import time

POLL_S = 1.0
EXIT_STATUS = 1


def watch_launcher(launcher: str, *, poll_s: float = POLL_S) -> threading.Thread | None:
    """Start the watch for a worker started by ``launcher`` (``DistEnv.launcher``); None when not watched."""
    if launcher == "single":
        return None
    parent = os.getppid()

    def watch():
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                print(f"error: the {launcher} launcher (pid {parent}) is gone: stopping this worker (pid "
                      f"{os.getpid()}) now, without saving", file=sys.stderr, flush=True)
                os._exit(EXIT_STATUS)

    thread = threading.Thread(target=watch, name="launcher-watch", daemon=True)
    thread.start()
    return thread
