"""--async-save's writer processes: they write a ``snapshot.Snapshot`` to disk while training goes on.

A writer writes each file with ``torch.save`` (hashing the bytes as they go, for the manifest), fsyncs
it, writes rank 0's record of the run (``META``, atomically) and fsyncs the checkpoint folder, then
answers with every file's size and CRC-32, or with the first error (a full disk). The manifest and
the trackers are not its business: the training process writes them once every rank's writer has
answered (``async_save.AsyncSaver``), so a checkpoint is complete exactly when a synchronous one is.

``ForkedWriter`` forks one process per save (Megatron-LM's default, ``TemporalAsyncCaller``);
``PersistentWriter`` (``--use-persistent-ckpt-worker``) forks one process when the run starts, before
the model is built, and sends it each save's memory file over a socket. Either process:

* is named ``ckpt-writer`` (``ps``, ``top``; the tests find it so);
* ignores the stop signals (SIGTERM, SIGINT, SIGUSR1, SIGUSR2), which reach it with its trainer's
  process group: the trainer finishes the write it waits for, then saves and exits;
* is killed (SIGKILL) the moment its trainer dies (``PR_SET_PDEATHSIG``), so no writer of a job killed
  with kill -9 goes on writing into a folder the next run is already using. What it left unfinished is
  an interrupted save, which the next run moves aside.
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import multiprocessing
import multiprocessing.connection
import os
import signal
import time
import zlib
from dataclasses import dataclass

import torch
from multiprocessing.reduction import recv_handle, send_handle

from megatron_ds.checkpoint.format import atomic_write
from megatron_ds.checkpoint.snapshot import Snapshot, restore

NAME = "ckpt-writer"
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
_PR_SET_PDEATHSIG, _PR_SET_NAME = 1, 15


@dataclass(frozen=True)
class Job:
    """What a writer writes besides the snapshot: the checkpoint folder (whose files the answer names
    relative to it), torch.save's zip format switch, and rank 0's record (path, text) or None."""
    ckpt_dir: str
    zipfile: bool
    meta: tuple[str, str] | None


class _Hashing:
    """A file that keeps the size and CRC-32 of what is written through it."""

    def __init__(self, f):
        self.f, self.size, self.crc, self.error = f, 0, 0, None

    def write(self, data) -> int:
        try:
            written = self.f.write(data)
        except OSError as exc:
            self.error = exc
            raise
        self.crc = zlib.crc32(data, self.crc)
        self.size += len(data)
        return written

    def flush(self) -> None:
        self.f.flush()


def _write_one(state, path: str, zipfile: bool) -> tuple[int, int]:
    with open(path, "wb") as f:
        out = _Hashing(f)
        try:
            torch.save(state, out, _use_new_zipfile_serialization=zipfile)
        except RuntimeError:
            if out.error is None:
                raise
            raise out.error from None  # torch's writer wraps the OSError of a full disk
        f.flush()
        os.fsync(f.fileno())
    return out.size, out.crc


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write(job: Job, snapshot: Snapshot, fd: int) -> dict:
    """Write the snapshot (its memory file open as ``fd``); the answer: {"files": {name: (size, crc)},
    "seconds": s} or {"error": (errno, strerror, filename)}."""
    start = time.monotonic()
    # a private mapping: writable for torch.frombuffer, and nothing written reaches the memory file
    arena = mmap.mmap(fd, snapshot.nbytes, access=mmap.ACCESS_COPY) if snapshot.nbytes else b""
    files = {}
    try:
        for path, state in restore(snapshot.files, snapshot.storages, arena):
            files[os.path.relpath(path, job.ckpt_dir)] = _write_one(state, path, job.zipfile)
            del state
        if job.meta is not None:
            path, text = job.meta
            atomic_write(path, text)
            data = text.encode()
            files[os.path.relpath(path, job.ckpt_dir)] = (len(data), zlib.crc32(data))
        _fsync_dir(job.ckpt_dir)
    except OSError as exc:
        return {"error": (exc.errno, exc.strerror or type(exc).__name__, exc.filename or job.ckpt_dir)}
    except Exception as exc:  # noqa: BLE001 - a bug or a torch error: reported as this save's failure
        return {"error": (errno.EIO, f"the background writer failed: {type(exc).__name__}: {exc}", job.ckpt_dir)}
    return {"files": files, "seconds": time.monotonic() - start}


def _become_writer(parent: int) -> None:
    """In the new process: its name, no stop signals, death with its trainer."""
    for sig in _STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(NAME.encode()), 0, 0, 0)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: a persistent writer ends when its connection closes
        pass
    if os.getppid() != parent:  # the trainer died before the death signal was armed
        os._exit(1)


class _Child:
    """A forked process (os.fork: the trainer may itself be a daemonic multiprocessing child, which
    multiprocessing forbids to start processes of its own)."""

    def __init__(self, target, args):
        # the stop signals stay blocked across the fork, so none reaches the child before it ignores them
        # (the trainer gets them once unblocked)
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
        try:
            self.pid = os.fork()
            if self.pid == 0:
                code = 1
                try:
                    target(*args)
                    code = 0
                finally:
                    os._exit(code)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        self.exitcode = None

    def is_alive(self) -> bool:
        if self.exitcode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.exitcode = os.waitstatus_to_exitcode(status)
        return self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.is_alive() and (deadline is None or time.monotonic() < deadline):
            time.sleep(0.01)

    def kill(self) -> None:
        if self.is_alive():
            os.kill(self.pid, signal.SIGKILL)
            self.join()


def _died(process: _Child, ckpt_dir: str) -> dict:
    process.join(timeout=5)
    code = process.exitcode
    how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with status {code}"
    return {"error": (errno.EIO, f"the background checkpoint writer (pid {process.pid}) {how}", ckpt_dir)}


def _write_once(parent: int, job: Job, snapshot: Snapshot, conn) -> None:
    _become_writer(parent)
    conn.send(write(job, snapshot, snapshot.fd))


class _Writer:
    """What both writers share: ``process`` (a ``_Child``), ``conn`` (its answers), ``job`` (the save in hand)."""
    process: _Child | None
    conn: object
    job: Job | None

    def done(self) -> bool:
        return self.conn.poll() or not self.process.is_alive()

    def _answer(self) -> dict:
        """The save's files and time, or its error (the writer's own, or that it died)."""
        try:
            return self.conn.recv()
        except EOFError:
            return _died(self.process, self.job.ckpt_dir)


class ForkedWriter(_Writer):
    """One process per save, forked with the snapshot's memory file open."""

    def __init__(self):
        self.process = self.conn = self.job = None

    def submit(self, job: Job, snapshot: Snapshot) -> None:
        self.job = job
        self.conn, child = multiprocessing.Pipe(duplex=False)
        self.process = _Child(_write_once, (os.getpid(), job, snapshot, child))
        child.close()

    def result(self) -> dict:
        answer = self._answer()
        self.process.join()
        self.conn.close()
        return answer

    def close(self) -> None:
        """Abandon an unfinished save (an error elsewhere ends the run): what it wrote is an interrupted save."""
        if self.process is not None:
            self.process.kill()
            self.conn.close()


def _serve(parent: int, conn) -> None:
    _become_writer(parent)
    while True:
        message = conn.recv()
        if message is None:
            return
        job, snapshot = message
        fd = recv_handle(conn)
        try:
            answer = write(job, snapshot, fd)
        finally:
            os.close(fd)
        conn.send(answer)


class PersistentWriter(_Writer):
    """--use-persistent-ckpt-worker: one process for every save of the run, forked by ``start``."""

    def __init__(self):
        self.conn, child = multiprocessing.Pipe()
        self.process = _Child(_serve, (os.getpid(), child))
        child.close()
        self.job = None

    def submit(self, job: Job, snapshot: Snapshot) -> None:
        self.job = job
        self.conn.send((job, snapshot))
        send_handle(self.conn, snapshot.fd, self.process.pid)

    def result(self) -> dict:
        answer = self._answer()
        self.job = None
        return answer

    def close(self) -> None:
        """At the end of the run: the process ends (killed if a save is unfinished: an error ended the run)."""
        if self.process.is_alive() and self.job is None:
            try:
                self.conn.send(None)
            except OSError:
                pass
            self.process.join(timeout=10)
        self.process.kill()
        self.conn.close()
