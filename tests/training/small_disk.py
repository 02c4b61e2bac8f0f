"""A small disk for the full-disk tests: a real tmpfs where one can be mounted, else a stand-in.

The real one: ``unshare --user --map-root-user --mount`` gives an unprivileged user a mount
namespace in which it may mount a tmpfs of a chosen size, seen only by the command it runs. The
kernel itself then answers ENOSPC to the writer, through torch's serializer, as a full Lustre or NFS
quota does on a cluster. Where user namespaces are disabled (some container runtimes), the same
story runs on a stand-in: file writes under the directory fail with ENOSPC once a byte budget is
spent, and ``shutil.disk_usage`` reports that budget -- the same OSError reaches the writer, from
Python instead of the kernel.

``python -m tests.training.small_disk ROOT OUT [--stand-in BYTES] -- FLAGS`` runs ``story`` with the
run's FLAGS on ROOT (a mounted tmpfs, or a plain directory with the stand-in) and writes what
happened to OUT/story.json; ``run_story`` starts it one way or the other.
"""
from __future__ import annotations

import argparse
import builtins
import errno
import json
import os
import shutil
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _used(root: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files
               if os.path.exists(os.path.join(d, f)))


class _Budgeted:
    """A file opened for writing under the stand-in's root: writes past the budget fail as the kernel's do."""

    def __init__(self, f, root: str, capacity: int):
        self._f, self._root, self._capacity = f, root, capacity

    def write(self, data):
        size = len(data.encode()) if isinstance(data, str) else memoryview(data).nbytes
        if _used(self._root) + size > self._capacity:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


def _patch_open(should_wrap):
    """builtins.open, with files opened for writing that ``should_wrap(path)`` passes through it."""
    real_open = builtins.open

    def open_(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        if isinstance(file, (str, os.PathLike)) and any(c in mode for c in "wax"):
            return should_wrap(os.path.abspath(file), f)
        return f

    builtins.open = open_


def install_stand_in(root: str, capacity: int) -> None:
    """This process sees ``root`` as a disk of ``capacity`` bytes."""
    root = os.path.abspath(root)
    real_usage = shutil.disk_usage
    _patch_open(lambda path, f: _Budgeted(f, root, capacity) if path.startswith(root + os.sep) else f)

    def disk_usage(path):
        if not os.path.abspath(path).startswith(root):
            return real_usage(path)
        used = _used(root)
        return namedtuple("usage", "total used free")(capacity, used, max(0, capacity - used))

    shutil.disk_usage = disk_usage


def fail_writes(fragment: str, code: int) -> None:
    """Opening a file whose path holds ``fragment`` for writing fails with ``code`` (EIO: a failing disk)."""
    def check(path, f):
        if fragment in path:
            f.close()
            raise OSError(code, os.strerror(code), path)
        return f
    _patch_open(check)


def tmpfs_works(scratch: Path) -> bool:
    """Whether this user can mount a tmpfs in a user and mount namespace."""
    scratch.mkdir(parents=True, exist_ok=True)
    try:
        return subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                               f"mount -t tmpfs -o size=64k tmpfs {scratch}"], capture_output=True,
                              timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def run_story(root: Path, out: Path, size: int, args: list[str], timeout: float) -> tuple[dict, str]:
    """``story`` on a ``size``-byte disk at ``root``: (what happened, "tmpfs" or "stand-in")."""
    root.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    driver = [sys.executable, "-m", "tests.training.small_disk", str(root), str(out)]
    if tmpfs_works(out / "probe"):
        kind, cmd = "tmpfs", ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                              f"mount -t tmpfs -o size={size} tmpfs {root} && exec \"$@\"", "sh", *driver, "--", *args]
    else:
        kind, cmd = "stand-in", driver + ["--stand-in", str(size), "--", *args]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "story.json").read_text()), kind


def _cli(rank, world_size, argvs, root, capacity):
    from tests.training.cli import cli_many

    if capacity:
        install_stand_in(root, capacity)
    return cli_many(rank, world_size, argvs)


def _fill_to(root: str, free: int) -> None:
    """Write a filler file so that ``free`` bytes remain (less, by the file system's rounding)."""
    now = shutil.disk_usage(root).free
    with open(os.path.join(root, "filler"), "wb") as f:
        f.write(b"\0" * max(0, now - free))


def story(root: str, out: str, capacity: int | None, base: list[str]) -> None:
    """A run that fills the disk (saving every iteration, no --keep-last); a resume refused at start-up
    because the disk holds 64 KB less than one checkpoint; room made, the same resume again."""
    from tests.distributed import run_distributed

    if capacity:  # this process too: it measures and fills the disk
        install_stand_in(root, capacity)
    save = os.path.join(root, "ckpt")

    def run(argv):
        return run_distributed(_cli, 1, [base + argv], root, capacity, timeout=600)[0][0]

    told = {"filled": run(["--train-iters", "6", "--save", save])}
    told["after_filled"] = sorted(os.listdir(save))
    told["free_after_filled"] = shutil.disk_usage(root).free
    last = max(int(n[len("global_step"):]) for n in os.listdir(save) if n.startswith("global_step"))
    newest = os.path.join(save, f"global_step{last}")
    told["newest_bytes"] = sum(os.path.getsize(os.path.join(newest, n)) for n in os.listdir(newest))
    _fill_to(root, told["newest_bytes"] - 64_000)
    told["free_short"] = shutil.disk_usage(root).free
    told["short"] = run(["--train-iters", "8", "--load", save, "--save", save])
    os.remove(os.path.join(root, "filler"))
    for name in os.listdir(save):
        if name.startswith("global_step") and name != f"global_step{last}":
            shutil.rmtree(os.path.join(save, name))
    told["resumed"] = run(["--train-iters", "6", "--load", save, "--save", save])
    told["after_resumed"] = sorted(os.listdir(save))
    Path(out, "story.json").write_text(json.dumps(told))


if __name__ == "__main__":
    split = sys.argv.index("--")
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("out")
    parser.add_argument("--stand-in", type=int, default=None)
    a = parser.parse_args(sys.argv[1:split])
    story(a.root, a.out, a.stand_in, sys.argv[split + 1:])
