"""The index cache: hashing, reuse, one builder among racing processes, stale-lock takeover."""
import json
import multiprocessing as mp
import os
import threading
import time

import numpy as np
import pytest

from megatron_ds.data import index_cache
from megatron_ds.data.index_cache import CacheTimings, cache_dirs, description_hash, load_or_build

# Short timings so the tests take seconds; the ratios match the defaults (heartbeat << stale).
FAST = CacheTimings(heartbeat_s=0.05, stale_s=0.5, timeout_s=20.0, poll_s=0.02, max_poll_s=0.05, report_s=60)
NAMES = ("first", "second")


def arrays():
    return {"first": np.arange(1000, dtype=np.int64), "second": np.array([[1, 2], [3, 4]], dtype=np.int32)}


class CountingBuild:
    def __init__(self, delay=0.0):
        self.calls, self.delay = 0, delay

    def __call__(self):
        self.calls += 1
        time.sleep(self.delay)
        return arrays()


def call(directory, desc, build, timings=FAST, log=None):
    return load_or_build(desc, NAMES, build, search_dirs=[directory], build_dir=directory,
                         log=log or (lambda _m: None), timings=timings)


def check(result):
    expected = arrays()
    for name in NAMES:
        assert isinstance(result[name], np.memmap)  # loaded with mmap, not read into memory
        np.testing.assert_array_equal(result[name], expected[name])


def test_second_call_loads_and_new_description_rebuilds(tmp_path):
    build = CountingBuild()
    check(call(str(tmp_path), "desc A", build))
    check(call(str(tmp_path), "desc A", build))
    assert build.calls == 1
    check(call(str(tmp_path), "desc B", build))
    assert build.calls == 2
    assert description_hash("desc A") != description_hash("desc B")
    key = description_hash("desc A")
    assert (tmp_path / f"{key}.dsc").read_text() == "desc A"
    # No lock or temporary file is left behind.
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith((".npy", ".dsc"))) == []


def _race_worker(directory, marker, barrier, queue):
    def build():
        with open(marker, "a") as f:  # O_APPEND: one line per build, whoever runs it
            f.write(f"{os.getpid()}\n")
        time.sleep(0.3)
        return arrays()

    barrier.wait(timeout=60)  # all processes reach the lock together
    result = call(directory, "raced", build)
    queue.put({name: np.asarray(result[name]).tolist() for name in NAMES})


def test_racing_processes_build_exactly_once(tmp_path):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    marker = tmp_path / "builds.txt"
    barrier = ctx.Barrier(4)
    procs = [ctx.Process(target=_race_worker, args=(str(tmp_path / "cache"), str(marker), barrier, queue))
             for _ in range(4)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert len(marker.read_text().split()) == 1
    expected = {name: value.tolist() for name, value in arrays().items()}
    assert all(r == expected for r in results)


def test_stale_lock_of_dead_builder_is_taken_over(tmp_path):
    key = description_hash("orphaned")
    # A builder that crashed: its lock (and a half-finished takeover marker) never change again.
    (tmp_path / f"{key}.lock").write_text(json.dumps({"owner": "node7:4242", "token": "x", "beat": "0"}))
    (tmp_path / f"{key}.lock.break").write_text("dead breaker")
    messages = []
    build = CountingBuild()
    start = time.monotonic()
    check(call(str(tmp_path), "orphaned", build, log=messages.append))
    assert build.calls == 1
    assert time.monotonic() - start < 10  # two stale periods (breaker, then lock) plus polling
    assert any("node7:4242" in m and "taking over" in m for m in messages)
    assert not (tmp_path / f"{key}.lock").exists()


def test_live_builder_is_waited_for_not_taken_over(tmp_path):
    # The build lasts two stale periods: only the heartbeats keep the waiter from taking over.
    # stale_s is 20 heartbeats so a loaded machine delaying a few of them does not break the test.
    timings = CacheTimings(heartbeat_s=0.05, stale_s=1.0, timeout_s=20.0, poll_s=0.02, max_poll_s=0.05)
    build = CountingBuild(delay=2.0)
    builder = threading.Thread(target=call, args=(str(tmp_path), "slow", build, timings))
    builder.start()
    while not any(p.suffix == ".lock" for p in tmp_path.iterdir()):
        time.sleep(0.01)
    waiter_build = CountingBuild()
    check(call(str(tmp_path), "slow", waiter_build, timings))
    builder.join()
    assert build.calls == 1 and waiter_build.calls == 0


def test_waiter_times_out_with_a_clear_message(tmp_path):
    key = description_hash("forever")
    lock = tmp_path / f"{key}.lock"
    stop = threading.Event()

    def beat(n):  # fixed width, rewritten in place: what a live builder's heartbeat does
        fd = os.open(lock, os.O_CREAT | os.O_WRONLY)
        os.write(fd, json.dumps({"owner": "node3:99", "token": "t", "beat": f"{n:012d}"}).encode())
        os.close(fd)

    def heartbeat():  # a live builder that never finishes
        n = 1
        while not stop.is_set():
            beat(n)
            n += 1
            time.sleep(0.02)

    beat(0)
    thread = threading.Thread(target=heartbeat)
    thread.start()
    try:
        timings = CacheTimings(heartbeat_s=0.05, stale_s=0.5, timeout_s=0.6, poll_s=0.02, max_poll_s=0.05)
        with pytest.raises(TimeoutError, match=rf"node3:99 .*if no process is building them, delete .*{key}\.lock"):
            call(str(tmp_path), "forever", CountingBuild(), timings=timings)
    finally:
        stop.set()
        thread.join()


def test_failed_build_releases_the_lock(tmp_path):
    def broken():
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):
        call(str(tmp_path), "fragile", broken)
    build = CountingBuild()
    check(call(str(tmp_path), "fragile", build))
    assert build.calls == 1


def test_cache_locations(tmp_path, monkeypatch):
    prefix = str(tmp_path / "data" / "corpus_text_document")
    os.makedirs(tmp_path / "data")
    beside = str(tmp_path / "data" / "index-cache")
    assert cache_dirs(prefix) == ([beside], beside)
    # An explicit --data-cache-path is where new files go; a cache beside the data is still reused.
    assert cache_dirs(prefix, str(tmp_path / "cache")) == ([beside, str(tmp_path / "cache")], str(tmp_path / "cache"))
    # Read-only data directory: fall back to the per-user cache.
    monkeypatch.setattr(index_cache, "_writable_dir", lambda _path: False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    fallback = str(tmp_path / "xdg" / "megatron_ds" / "index-cache")
    assert cache_dirs(prefix) == ([beside, fallback], fallback)
