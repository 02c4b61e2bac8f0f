"""Start-up checks before any compute, through pretrain_gpt.py's main: a --save directory that is
locked by another job or not writable, and a rendezvous port already taken; plus the lock's rules."""
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from megatron_ds.checkpoint import lock as save_lock
from megatron_ds.checkpoint.lock import LOCK_NAME, LockHeld, SaveLock
from tests.distributed import run_distributed
from tests.launch.helpers import REPO, clean_env, run_bounded
from tests.training.cli import SMALL_GPT, cli_many, iterations

ARGS = SMALL_GPT + ["--train-iters", "2"]


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_locked_or_unwritable_save_is_refused_before_iteration_one(tmp_path):
    locked = tmp_path / "locked"
    holder = SaveLock(str(locked))
    holder.acquire()  # this test process plays the job that is still running
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    unwritable = str(blocker / "ckpt")  # root may write anywhere else; nobody can below a file
    try:
        results = run_distributed(cli_many, 1, [ARGS + ["--save", str(locked)], ARGS + ["--save", unwritable]],
                                  timeout=900)[0]
    finally:
        holder.release()
    (rc1, out1, err1), (rc2, out2, err2) = results
    host = socket.gethostname()
    assert rc1 == 1 and err1.startswith(f"error: --save {locked} is in use by another job (host {host}, "
                                         f"pid {os.getpid()}"), err1
    assert len(err1.strip().splitlines()) == 1
    assert rc2 == 1 and err2.strip() == (f"error: --save {unwritable} is not writable (Not a directory); "
                                         f"choose a directory this job can write to")
    assert not iterations(out1) and not iterations(out2)
    assert not (locked / LOCK_NAME).exists()  # released by its holder


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_save_is_refused(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    [(rc, out, err)] = run_distributed(cli_many, 1, [ARGS + ["--save", str(ro)]], timeout=900)[0]
    assert rc == 1 and "is not writable (Permission denied" in err and not iterations(out)


def _write_lock(directory, info, age_s=0.0):
    path = directory / LOCK_NAME
    path.write_text(json.dumps(info))
    past = time.time() - age_s
    os.utime(path, (past, past))
    return path


def test_lock_rules(tmp_path, monkeypatch):
    host = socket.gethostname()
    # a live holder on another host with a fresh heartbeat: refused, naming host, pid and job
    _write_lock(tmp_path, {"host": "node7", "pid": 4242, "job_id": "12345.pbs1", "started": "then"})
    with pytest.raises(LockHeld, match=r"in use by another job \(host node7, pid 4242, job 12345.pbs1"):
        SaveLock(str(tmp_path)).acquire()
    # the same holder without a heartbeat for longer than STALE_AFTER_S: taken over
    _write_lock(tmp_path, {"host": "node7", "pid": 4242}, age_s=save_lock.STALE_AFTER_S + 60)
    notes = []
    lock = SaveLock(str(tmp_path))
    lock.acquire(log=notes.append)
    assert "took over the stale lock" in notes[0] and "no heartbeat for" in notes[0]
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()
    # a holder on this host whose process is gone: stale at once
    _write_lock(tmp_path, {"host": host, "pid": _dead_pid()})
    notes = []
    lock = SaveLock(str(tmp_path))
    lock.acquire(log=notes.append)
    assert "on this host is gone" in notes[0]
    # the heartbeat keeps the mtime fresh while the job runs
    monkeypatch.setattr(save_lock, "HEARTBEAT_S", 0.05)
    lock.release()
    lock = SaveLock(str(tmp_path))
    lock.acquire()
    old = time.time() - 1000
    os.utime(tmp_path / LOCK_NAME, (old, old))
    time.sleep(0.5)
    assert time.time() - os.stat(tmp_path / LOCK_NAME).st_mtime < 100
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_port_clash_without_launcher_is_one_line(tmp_path):
    """Two runs on one host without a launcher both want MASTER_PORT (29500 by default)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_bounded([sys.executable, str(REPO / "pretrain_gpt.py"), *ARGS],
                             clean_env(MASTER_PORT=port, MASTER_ADDR="127.0.0.1"), cwd=tmp_path, timeout=600)
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: MASTER_PORT {port} on 127.0.0.1 is already in use (another run on this host?); set MASTER_PORT "
        f"to a free port, or start with torchrun --standalone, which picks one")
    assert "Traceback" not in result.stderr


def test_dp_change_on_load_names_no_load_optim():
    from megatron_ds.errors import ConfigError
    from megatron_ds.checkpoint.checkpointing import check_compatible

    saved = {"num_layers": 2, "data_parallel_size": 2, "zero_stage": 1, "precision": "bf16"}
    now = {"num_layers": 2, "data_parallel_size": 4, "zero_stage": 1, "precision": "bf16"}
    with pytest.raises(ConfigError, match=r"data_parallel_size: checkpoint 2 vs now 4.*; or pass --no-load-optim "
                                          r"to load the weights only$"):
        check_compatible(saved, now, "ckpt/global_step6", load_optim=True)
    check_compatible(saved, now, "ckpt/global_step6", load_optim=False)  # weights only: DP may change


def test_not_enough_room_for_one_checkpoint(tmp_path):
    from megatron_ds.errors import ConfigError
    from megatron_ds.training.startup_checks import check_save_dir, checkpoint_bytes

    class Layout:  # what checkpoint_bytes reads: 13B parameters in bf16 with Adam
        total_params, precision = 13_000_000_000, "bf16"

    assert checkpoint_bytes(Layout) == 13_000_000_000 * (2 + 12)  # bf16 weights + fp32 master and moments
    with pytest.raises(ConfigError, match=r"has [0-9.]+ GB free, but one checkpoint needs about 1000000000\.0 GB"):
        check_save_dir(str(tmp_path / "ckpt"), 10 ** 18)
    check_save_dir(str(tmp_path / "ckpt"), 1)
    assert os.listdir(tmp_path / "ckpt") == []  # the write probe leaves nothing behind
