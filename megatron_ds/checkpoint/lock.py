"""One writer per --save directory: a lock file held by the running job.

``DIR/.megatron_ds.lock`` is created with O_CREAT|O_EXCL, which is atomic on local file systems
and on the shared ones clusters use (Lustre, GPFS, NFSv3+), and holds the holder's host, pid and
scheduler job id. While the job runs, a daemon thread refreshes the file's mtime (the heartbeat).

A lock found at start-up is taken over when its holder is certainly gone:
  * it is on this host and its pid is gone;
  * it is an earlier run of this same job (a requeue keeps the job id) on another host;
  * the scheduler says its job has ended (``megatron_ds.launch.scheduler``): a job killed with
    SIGKILL -- walltime after the grace period, a node failure -- leaves a fresh heartbeat behind,
    and a follow-on job (``qsub -W depend=afterany:...``, ``-hold_jid``) often starts within minutes;
  * its heartbeat is older than STALE_AFTER_S and the scheduler does not say it still runs.
A holder on this host whose pid lives is refused at once. Otherwise the job waits, printing a
countdown, until one of the above becomes true (then takes over), the holder's heartbeat moves or
the wait runs out (then stops with one line naming the holder).

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

from megatron_ds.launch import scheduler

LOCK_NAME = ".megatron_ds.lock"
HEARTBEAT_S = 30.0
STALE_AFTER_S = 300.0  # ten missed heartbeats: far beyond any file-system hiccup
POLL_S = 5.0  # while waiting for a holder: how often the lock and the scheduler are looked at
COUNTDOWN_S = 30.0  # and how often the wait is reported


class LockHeld(RuntimeError):
    """Another live job holds the lock; the message names it."""


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
        kind, job_id = scheduler.current_job()
        self.info = {"host": socket.gethostname(), "pid": os.getpid(), "job_id": job_id, "scheduler": kind,
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
        """(holder info, mtime of its last heartbeat), or None when the lock vanished meanwhile."""
        try:
            with open(self.path, "rb") as f:
                raw = f.read()
            beat = os.stat(self.path).st_mtime
        except FileNotFoundError:
            return None
        try:
            info = json.loads(raw.decode("utf-8"))
        except ValueError:  # half-written by a holder that died while creating it
            info = {"host": "?", "pid": "?"}
        return info, beat

    def _gone(self, info: dict, age: float) -> str | None:
        """Why the holder is certainly gone (the lock may be taken over), or None."""
        if info.get("host") == self.info["host"] and isinstance(info.get("pid"), int) \
                and not _pid_alive(info["pid"]):
            return f"pid {info['pid']} on this host is gone"
        job = info.get("job_id")
        if job and job == self.info["job_id"] and info.get("host") != self.info["host"]:
            return f"an earlier run of this job {job} (requeued)"
        state = scheduler.job_state(info.get("scheduler") or self.info["scheduler"], job)
        if state == scheduler.ENDED:
            return f"the scheduler says job {job} has ended"
        if age > STALE_AFTER_S and state != scheduler.RUNNING:
            return f"no heartbeat for {age:.0f} s"
        return None

    def _alive_here(self, info: dict) -> bool:
        return info.get("host") == self.info["host"] and isinstance(info.get("pid"), int) and _pid_alive(info["pid"])

    def acquire(self, log=print, wait_limit_s: float | None = None) -> None:
        """Take the lock (waiting for a holder that may be gone, at most long enough for its heartbeat
        to go stale, or wait_limit_s) or raise LockHeld. Starts the heartbeat thread."""
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        longest = STALE_AFTER_S + 2 * POLL_S
        deadline = time.monotonic() + (longest if wait_limit_s is None else min(longest, wait_limit_s))
        for _ in range(5):
            if self._create():
                self._start_heartbeat()
                return
            holder = self._holder()
            if holder is None:
                continue
            why = self._wait_until_gone(*holder, deadline, log)
            if why is None:
                continue  # the lock was released or changed hands meanwhile: look again
            aside = f"{self.path}.stale.{self.info['host']}.{os.getpid()}"
            try:
                os.rename(self.path, aside)
            except OSError as exc:
                if exc.errno != errno.ENOENT:
                    raise
                continue  # another job took it over first; try again
            os.unlink(aside)
            log(f"WARNING: took over the stale lock {self.path} ({_describe(holder[0])}: {why})")
        raise LockHeld(f"could not take the lock {self.path}: other jobs keep taking it")

    def _wait_until_gone(self, info: dict, beat: float, deadline: float, log) -> str | None:
        """Why the holder is gone; None when the lock file changed meanwhile. Raises LockHeld for a
        holder that lives: on this host, its heartbeat moved, or still there at the deadline."""
        reported = None
        while True:
            age, alive = time.time() - beat, self._alive_here(info)
            why = None if alive else self._gone(info, age)
            if why:
                return why
            left = deadline - time.monotonic()
            if alive or left <= 0:
                raise self._held(info, age, waited=reported is not None)
            if reported is None or time.monotonic() - reported >= COUNTDOWN_S:
                reported = time.monotonic()
                log(f"WARNING: --save {os.path.dirname(self.path)} is locked by {_describe(info)}, heartbeat "
                    f"{age:.0f} s ago; waiting up to {left:.0f} s for it to end (the lock is taken over once the "
                    f"scheduler says its job ended or its heartbeat is {STALE_AFTER_S:.0f} s old)")
            time.sleep(min(POLL_S, left))
            holder = self._holder()
            if holder is None or holder[0] != info:
                return None
            if holder[1] > beat:  # the heartbeat moved while we waited: the holder is alive
                raise self._held(info, time.time() - holder[1], waited=True)

    def _held(self, info: dict, age: float, waited: bool) -> LockHeld:
        state = scheduler.job_state(info.get("scheduler") or self.info["scheduler"], info.get("job_id"))
        still = f"; the scheduler says job {info['job_id']} is still running" if state == scheduler.RUNNING else ""
        after = " after waiting for it" if waited else ""
        return LockHeld(f"--save {os.path.dirname(self.path)} is in use by another job ({_describe(info)}; "
                        f"heartbeat {age:.0f} s ago{still}){after}: wait for it to end or use another --save "
                        f"(if that job is gone, delete {self.path})")

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
