"""Cache of dataset index arrays as `.npy` files, built by one process while the others wait.

Files are keyed by the md5 of a text description of what they index (data path, split, number of
samples, sequence length, seed, ...): `{hash}_{name}.npy` for each array and `{hash}.dsc`, the
description itself, written last so its presence means the set is complete.

Coordination uses the file system only, so it works across nodes sharing a file system and needs
no torch.distributed (Megatron's rank-0-builds-then-barrier deadlocks or races when ranks on
several nodes see one cache directory):
- the builder is whoever creates `{hash}.lock` first (O_CREAT | O_EXCL is atomic, NFS included);
- every file is written under a temporary name and renamed into place (atomic), so a reader
  never sees a partial array;
- the builder rewrites a counter in its lock file every few seconds (a heartbeat). A waiter that
  sees the lock unchanged for `stale_s` of its own clock (no clock comparison between nodes)
  decides the builder died, removes the lock and competes to build;
- waiters poll for the description file and give up with a clear message after `timeout_s`.
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np


@dataclass(frozen=True)
class CacheTimings:
    heartbeat_s: float = 5.0   # how often a builder proves it is alive
    stale_s: float = 120.0     # a lock unchanged this long belongs to a dead builder
    timeout_s: float = 7200.0  # the longest a waiter waits for a live builder
    poll_s: float = 0.5        # first wait between checks; grows to max_poll_s
    max_poll_s: float = 5.0
    report_s: float = 30.0     # how often waiting/building progress is logged


def description_hash(desc: str) -> str:
    return hashlib.md5(desc.encode("utf-8")).hexdigest()


def fallback_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "megatron_ds", "index-cache")


def _writable_dir(path: str) -> bool:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return False
    return os.access(path, os.W_OK | os.X_OK)


def cache_dirs(data_prefix: str, data_cache_path: str | None = None) -> tuple[list[str], str]:
    """(directories to look in, directory to build in) for indices of the dataset at data_prefix.

    An existing cache beside the data is reused first (one copy for everyone); new files go to
    data_cache_path when given, else beside the data, else to a per-user cache when the data
    directory is read-only.
    """
    beside = os.path.join(os.path.dirname(os.path.abspath(data_prefix)), "index-cache")
    look = [beside]
    if data_cache_path:
        build = os.path.abspath(data_cache_path)
    elif _writable_dir(beside):
        build = beside
    else:
        build = fallback_cache_dir()
    if build not in look:
        look.append(build)
    return look, build


def _paths(directory: str, key: str, names: Sequence[str]) -> tuple[dict[str, str], str]:
    return {n: os.path.join(directory, f"{key}_{n}.npy") for n in names}, os.path.join(directory, f"{key}.dsc")


def _complete(directory: str, key: str, names: Sequence[str]) -> bool:
    arrays, dsc = _paths(directory, key, names)
    return os.path.isfile(dsc) and all(os.path.isfile(p) for p in arrays.values())


def _load(directory: str, key: str, names: Sequence[str]) -> dict[str, np.ndarray]:
    arrays, _ = _paths(directory, key, names)
    out = {}
    for name, path in arrays.items():
        try:
            out[name] = np.load(path, mmap_mode="r", allow_pickle=False)
        except ValueError as exc:
            raise ValueError(f"index cache file {path} is unreadable ({exc}); delete it to rebuild") from exc
    return out


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return None


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _atomic_write(path: str, token: str, write: Callable) -> None:
    tmp = f"{path}.tmp-{socket.gethostname()}-{os.getpid()}-{token[:8]}"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())  # other nodes must see the bytes once they see the name
        os.replace(tmp, path)
    finally:
        _unlink(tmp)


class _Lock:
    """`{hash}.lock`: created exclusively, rewritten in place as a heartbeat, removed by its owner."""

    def __init__(self, path: str, timings: CacheTimings, log: Callable[[str], None]):
        self.path, self.timings, self.log = path, timings, log
        self.token = uuid.uuid4().hex
        self.owner = f"{socket.gethostname()}:{os.getpid()}"
        self._stop = threading.Event()
        self._thread = None

    def _content(self, beat: int) -> bytes:
        # Fixed width, so rewriting in place never truncates and a reader never sees an empty file.
        return json.dumps({"owner": self.owner, "token": self.token, "beat": f"{beat:012d}"}).encode()

    def try_acquire(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        try:
            os.write(fd, self._content(0))
            os.fsync(fd)
        finally:
            os.close(fd)
        self._thread = threading.Thread(target=self._heartbeat, name="index-cache-heartbeat", daemon=True)
        self._thread.start()
        return True

    def _mine(self) -> bool:
        content = _read(self.path)
        return content is not None and self.token in content

    def _heartbeat(self) -> None:
        beat, start = 0, time.monotonic()
        next_report = start + self.timings.report_s
        while not self._stop.wait(self.timings.heartbeat_s):
            if not self._mine():  # declared dead and taken over: the new builder owns the lock now
                return
            beat += 1
            try:
                fd = os.open(self.path, os.O_WRONLY)
                try:
                    os.write(fd, self._content(beat))
                finally:
                    os.close(fd)
            except FileNotFoundError:
                return
            if time.monotonic() >= next_report:
                self.log(f" > still building index files ({time.monotonic() - start:.0f} s so far)")
                next_report += self.timings.report_s

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._mine():
            _unlink(self.path)


class _Watch:
    """Remembers when a file's content last changed, by this process's monotonic clock."""

    def __init__(self, stale_s: float):
        self.stale_s, self.content, self.since = stale_s, None, time.monotonic()

    def observe(self, content: str) -> bool:
        """Record the content; True when it has not changed for stale_s."""
        now = time.monotonic()
        if content != self.content:
            self.content, self.since = content, now
        return now - self.since >= self.stale_s


def _owner(content: str | None) -> str:
    try:
        return json.loads(content)["owner"]
    except (TypeError, ValueError, KeyError):
        return "another process"


def _break_stale_lock(lock_path: str, stale_content: str, breaker_watch: _Watch, log) -> None:
    """Remove a dead builder's lock; one waiter does it while the others keep waiting."""
    breaker = lock_path + ".break"
    try:
        fd = os.open(breaker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        # Someone else is breaking it (a few milliseconds), or died doing so: clear that too.
        content = _read(breaker)
        if content is not None and breaker_watch.observe(content):
            _unlink(breaker)
        return
    try:
        os.write(fd, uuid.uuid4().hex.encode())
        os.close(fd)
        # Only remove the lock we judged stale, not a fresh one created since we looked.
        if _read(lock_path) == stale_content:
            _unlink(lock_path)
            log(f" > index cache lock {lock_path} of {_owner(stale_content)} showed no heartbeat; taking over")
    finally:
        _unlink(breaker)


def load_or_build(
    desc: str,
    names: Sequence[str],
    build: Callable[[], dict[str, np.ndarray]],
    *,
    search_dirs: Sequence[str],
    build_dir: str,
    log: Callable[[str], None] = print,
    timings: CacheTimings = CacheTimings(),
) -> dict[str, np.ndarray]:
    """The arrays `names` described by desc, memory-mapped from the cache; built once if absent.

    `build()` returns {name: array}. It runs in exactly one process among all that call this at
    once with the same description and build_dir; the rest wait and then load its files.
    """
    key = description_hash(desc)
    for directory in search_dirs:
        if _complete(directory, key, names):
            log(f" > loading cached index files {key}_* from {directory}")
            return _load(directory, key, names)
    try:
        os.makedirs(build_dir, exist_ok=True)
    except OSError as exc:
        raise OSError(f"cannot create the index cache directory {build_dir} ({exc.strerror}); "
                      "pass --data-cache-path with a writable directory") from exc
    lock = _Lock(os.path.join(build_dir, f"{key}.lock"), timings, log)
    lock_watch, breaker_watch = _Watch(timings.stale_s), _Watch(timings.stale_s)
    start = time.monotonic()
    next_report, poll = start + timings.report_s, timings.poll_s
    while True:
        if _complete(build_dir, key, names):
            return _load(build_dir, key, names)
        if lock.try_acquire():
            try:
                if not _complete(build_dir, key, names):  # finished between our check and the lock
                    _build_and_save(build_dir, key, names, desc, build, lock.token, log)
            finally:
                lock.release()
            return _load(build_dir, key, names)
        content = _read(lock.path)
        if content is None:  # released this instant: check for the files and race for the lock
            continue
        if lock_watch.observe(content):
            _break_stale_lock(lock.path, content, breaker_watch, log)
            continue
        now = time.monotonic()
        if now - start > timings.timeout_s:
            raise TimeoutError(
                f"waited {now - start:.0f} s for {_owner(content)} to build index files {key}_* in {build_dir}; "
                f"if no process is building them, delete {lock.path}"
            )
        if now >= next_report:
            log(f" > waiting for {_owner(content)} to build index files {key}_* in {build_dir} "
                f"({now - start:.0f} s so far)")
            next_report += timings.report_s
        time.sleep(poll)
        poll = min(poll * 1.5, timings.max_poll_s)


def _build_and_save(directory, key, names, desc, build, token, log) -> None:
    log(f" > building index files {key}_* in {directory}")
    start = time.time()
    arrays = build()
    missing = set(names) - set(arrays)
    if missing:
        raise KeyError(f"index build returned no array for {sorted(missing)}")
    paths, dsc = _paths(directory, key, names)
    for name, path in paths.items():
        _atomic_write(path, token, lambda f, a=np.ascontiguousarray(arrays[name]): np.save(f, a, allow_pickle=False))
    _atomic_write(dsc, token, lambda f: f.write(desc.encode("utf-8")))  # last: marks the set complete
    log(f" > built and saved index files {key}_* in {time.time() - start:.2f} s")


# DataLoader workers pickle datasets; a memory-mapped index would travel as a full in-memory copy,
# so datasets pickle the file name instead (mmap_state) and map it again in the worker.
def mmap_state(attrs: dict) -> dict:
    return {k: ("__mmap__", v.filename) if isinstance(v, np.memmap) and v.filename else v for k, v in attrs.items()}


def mmap_restore(state: dict) -> dict:
    return {
        k: np.load(v[1], mmap_mode="r", allow_pickle=False) if isinstance(v, tuple) and v[:1] == ("__mmap__",) else v
        for k, v in state.items()
    }
