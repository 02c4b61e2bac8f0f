"""One writer per --save directory: a lock file held by the running job.

``DIR/.megatron_ds.lock`` is created with O_CREAT|O_EXCL, which is atomic on local file systems
and on the shared ones clusters use (Lustre, GPFS, NFSv3+), and holds the holder's host, pid and
scheduler job id. While the job runs, a daemon thread refreshes the file's mtime (the heartbeat).
A lock is stale -- and is taken over -- when its holder is on this host and its pid is gone, or
when its heartbeat is older than STALE_AFTER_S (a holder on another node that crashed). A second
job finding a live lock stops at start-up with one line naming the holder.

Taking over a stale lock renames it to a unique name first: of two jobs racing for the same stale
lock, only one rename succeeds, and the O_EXCL create after it decides the rest.
"""
from __future__ import annotations

import errno
import json
import os
import socket
import threading
import time

LOCK_NAME = ".megatron_ds.lock"
HEARTBEAT_S = 30.0
STALE_AFTER_S = 300.0  # ten missed heartbeats: far beyond any file-system hiccup


class LockHeld(RuntimeError):
    """Another live job holds the lock; the message names it."""


def _job_id() -> str | None:
    for var in ("PBS_JOBID", "JOB_ID", "SLURM_JOB_ID", "LSB_JOBID"):
        if os.environ.get(var):
            return os.environ[var]
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _describe(info: dict) -> str:
    job = f", job {info['job_id']}" if info.get("job_id") else ""
    return f"host {info.get('host')}, pid {info.get('pid')}{job}, since {info.get('started')}"


class SaveLock:
    def __init__(self, directory: str):
        self.path = os.path.join(directory, LOCK_NAME)
        self.info = {"host": socket.gethostname(), "pid": os.getpid(), "job_id": _job_id(),
                     "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
        self._stop = threading.Event()
        self._thread = None

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump(self.info, f)
            f.flush()
            os.fsync(f.fileno())
        return True

    def _holder(self) -> tuple[dict, float] | None:
        """(holder info, seconds since its heartbeat), or None when the lock vanished meanwhile."""
        try:
            with open(self.path, "rb") as f:
                raw = f.read()
            age = time.time() - os.stat(self.path).st_mtime
        except FileNotFoundError:
            return None
        try:
            info = json.loads(raw.decode("utf-8"))
        except ValueError:  # half-written by a holder that died while creating it
            info = {"host": "?", "pid": "?"}
        return info, age

    def _stale(self, info: dict, age: float) -> str | None:
        if info.get("host") == self.info["host"] and isinstance(info.get("pid"), int) \
                and not _pid_alive(info["pid"]):
            return f"pid {info['pid']} on this host is gone"
        if age > STALE_AFTER_S:
            return f"no heartbeat for {age:.0f} s"
        return None

    def acquire(self, log=print) -> None:
        """Take the lock or raise LockHeld. Starts the heartbeat thread."""
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        for _ in range(5):
            if self._create():
                self._start_heartbeat()
                return
            holder = self._holder()
            if holder is None:
                continue
            info, age = holder
            why = self._stale(info, age)
            if why is None:
                raise LockHeld(f"--save {os.path.dirname(self.path)} is in use by another job "
                               f"({_describe(info)}; heartbeat {age:.0f} s ago): wait for it to end or use "
                               f"another --save (if that job is gone, delete {self.path})")
            aside = f"{self.path}.stale.{self.info['host']}.{os.getpid()}"
            try:
                os.rename(self.path, aside)
            except OSError as exc:
                if exc.errno != errno.ENOENT:
                    raise
                continue  # another job took it over first; try again
            os.unlink(aside)
            log(f"WARNING: took over the stale lock {self.path} ({_describe(info)}: {why})")
        raise LockHeld(f"could not take the lock {self.path}: other jobs keep taking it")

    def _start_heartbeat(self) -> None:
        def beat():
            while not self._stop.wait(HEARTBEAT_S):
                try:
                    os.utime(self.path)
                except OSError:
                    pass  # a file-system hiccup; the next beat retries

        self._thread = threading.Thread(target=beat, name="save-lock-heartbeat", daemon=True)
        self._thread.start()

    def release(self) -> None:
        self._stop.set()
        holder = self._holder()
        if holder and holder[0].get("pid") == self.info["pid"] and holder[0].get("host") == self.info["host"]:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
