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
    # a holder on another host without a heartbeat for longer than STALE_AFTER_S: taken over
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


# A scheduler's answers for a job that ended and one that runs, as the real commands give them
# (megatron_ds/launch/scheduler.py cites where each message comes from).
FAKE_QSTAT = """#!/bin/sh
case "$2" in
  111.pbs1) echo "qstat: 111.pbs1 Job has finished, use -x or -H to obtain historical job information" >&2; exit 35;;
  112.pbs1) echo "qstat: Unknown Job Id 112.pbs1" >&2; exit 153;;
  222.pbs1) printf 'Job Id: 222.pbs1\n    job_state = R\n'; exit 0;;
  333) echo "Following jobs do not exist: " >&2; echo "333" >&2; exit 1;;
esac
exit 2
"""


def _fake_qstat(directory) -> str:
    directory.mkdir(exist_ok=True)
    (directory / "qstat").write_text(FAKE_QSTAT)
    (directory / "qstat").chmod(0o755)
    return str(directory)


def _short_waits(monkeypatch, stale_s=1.0):
    monkeypatch.setattr(save_lock, "STALE_AFTER_S", stale_s)
    monkeypatch.setattr(save_lock, "POLL_S", 0.05)
    monkeypatch.setattr(save_lock, "COUNTDOWN_S", 0.3)


def _holder(job_id=None, scheduler=None):
    return {"host": "node7", "pid": 4242, "job_id": job_id, "scheduler": scheduler, "started": "then"}


@pytest.mark.parametrize("job_id,scheduler", [("111.pbs1", "pbs"), ("112.pbs1", "pbs"), ("333", "sge")])
def test_lock_of_an_ended_job_is_taken_over_at_once(tmp_path, monkeypatch, job_id, scheduler):
    """A job killed with SIGKILL left its lock with a fresh heartbeat; the scheduler says it ended."""
    monkeypatch.setenv("PATH", f"{_fake_qstat(tmp_path / 'bin')}:{os.environ['PATH']}")
    _write_lock(tmp_path, _holder(job_id, scheduler))
    notes, started = [], time.monotonic()
    lock = SaveLock(str(tmp_path))
    lock.acquire(log=notes.append)
    lock.release()
    assert time.monotonic() - started < save_lock.POLL_S  # no waiting
    assert notes == [f"WARNING: took over the stale lock {tmp_path / LOCK_NAME} (host node7, pid 4242, job "
                     f"{job_id}, since then: the scheduler says job {job_id} has ended)"]


def test_lock_of_a_running_job_is_refused_after_the_wait(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", f"{_fake_qstat(tmp_path / 'bin')}:{os.environ['PATH']}")
    _short_waits(monkeypatch)
    _write_lock(tmp_path, _holder("222.pbs1", "pbs"))
    notes, started = [], time.monotonic()
    with pytest.raises(LockHeld) as held:
        SaveLock(str(tmp_path)).acquire(log=notes.append)
    # it waited past the point where the heartbeat went stale: the scheduler's word wins
    assert time.monotonic() - started >= save_lock.STALE_AFTER_S
    assert len(notes) >= 2 and all("waiting up to" in n for n in notes)
    assert str(held.value).startswith(f"--save {tmp_path} is in use by another job (host node7, pid 4242, job "
                                      f"222.pbs1, since then; heartbeat ")
    assert "; the scheduler says job 222.pbs1 is still running) after waiting for it: " in str(held.value)
    assert "\n" not in str(held.value)


def test_without_a_scheduler_the_lock_is_waited_for_until_stale(tmp_path, monkeypatch):
    _short_waits(monkeypatch)
    _write_lock(tmp_path, _holder())
    notes = []
    lock = SaveLock(str(tmp_path))
    lock.acquire(log=notes.append)
    lock.release()
    # countdown lines, then the take-over
    assert notes[0].startswith(f"WARNING: --save {tmp_path} is locked by host node7, pid 4242, since then, "
                               f"heartbeat 0 s ago; waiting up to 1 s for it to end")
    assert "no heartbeat for 1 s" in notes[-1] and "took over the stale lock" in notes[-1]
    # a holder whose heartbeat moves while we wait is alive: refused without waiting it out
    _short_waits(monkeypatch, stale_s=30.0)
    path = _write_lock(tmp_path, _holder(), age_s=5)
    import threading
    threading.Timer(0.3, lambda: os.utime(path)).start()
    started = time.monotonic()
    with pytest.raises(LockHeld, match=r"in use by another job \(host node7, .*\) after waiting for it"):
        SaveLock(str(tmp_path)).acquire(log=lambda m: None)
    assert time.monotonic() - started < 10
    # a requeued job (same job id) on another node takes over from its earlier run
    monkeypatch.setenv("PBS_JOBID", "444.pbs1")
    _write_lock(tmp_path, _holder("444.pbs1", "pbs"))
    notes = []
    lock = SaveLock(str(tmp_path))
    lock.acquire(log=notes.append)
    lock.release()
    assert notes[0].endswith("an earlier run of this job 444.pbs1 (requeued))")


def _cli_with_scheduler(rank, world_size, argvs, bin_dir):
    """cli_many with the fake qstat on PATH and the lock's waits shortened (2 s instead of 5 min)."""
    save_lock.STALE_AFTER_S, save_lock.POLL_S, save_lock.COUNTDOWN_S = 2.0, 0.1, 0.5
    os.environ["PATH"] = f"{bin_dir}:{os.environ['PATH']}"
    return cli_many(rank, world_size, argvs)


def test_chained_job_after_a_hard_kill(tmp_path):
    """Through pretrain_gpt.py: the follow-on of a SIGKILLed job starts at once; a --save whose job
    still runs is refused in one line after the wait."""
    ended, running = tmp_path / "ended", tmp_path / "running"
    for d, job in ((ended, "111.pbs1"), (running, "222.pbs1")):
        d.mkdir()
        _write_lock(d, _holder(job, "pbs"))
    results = run_distributed(_cli_with_scheduler, 1, [ARGS + ["--save", str(ended)], ARGS + ["--save", str(running)]],
                              str(_fake_qstat(tmp_path / "bin")), timeout=900)[0]
    (rc1, out1, err1), (rc2, out2, err2) = results
    assert rc1 == 0, err1
    assert "the scheduler says job 111.pbs1 has ended" in out1 and len(iterations(out1)) == 2
    assert rc2 == 1 and len(err2.strip().splitlines()) == 1, err2
    assert err2.startswith(f"error: --save {running} is in use by another job (host node7, pid 4242, job 222.pbs1")
    assert "is still running) after waiting for it" in err2
    assert "waiting up to" in out2 and not iterations(out2)


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


def test_checkpoint_size_estimate_and_units():
    from megatron_ds.checkpoint.room import estimated_bytes, human_bytes, peak_new_checkpoints, saves_planned

    class Layout:  # what estimated_bytes reads: 13B parameters in bf16 with Adam
        total_params, precision = 13_000_000_000, "bf16"

    assert estimated_bytes(Layout) == 13_000_000_000 * (2 + 12)  # bf16 weights + fp32 master and moments
    assert [human_bytes(n) for n in (512, 436_355, 1_450_000, 182e9)] == ["512 B", "436 KB", "1.45 MB", "182 GB"]
    # saves at 2, 4 and the final one at 5 (training.loop); resumed at 4: the one at 5
    assert saves_planned(0, 5, 2) == 3 and saves_planned(4, 5, 2) == 1 and saves_planned(4, 4, 2) == 0
    # counted by hand: 1 checkpoint kept, 5 saves, --keep-last 2: before save 2 the directory holds 2
    # (the old one and save 1), so 2 new ones at once; without --keep-last all 5
    assert peak_new_checkpoints(5, 1, 2) == 2 and peak_new_checkpoints(5, 1, None) == 5
    assert peak_new_checkpoints(5, 4, 2) == 1  # pruned down to 2 after the first save: never more than now


