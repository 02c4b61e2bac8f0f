"""SIGTERM / SIGUSR1 through real launchers: every rank finishes the iteration, saves a complete
checkpoint with the tracker and exits 0; resuming from it gives the same losses as a run that was
never interrupted. Under mpirun only rank 1 gets the signal: the ranks agree on it collectively.
Ctrl-C (SIGINT to the job's process group) stops the same way and exits 130, with no traceback from any
process: plain python with loader workers, torchrun with pipeline parallel, pressed twice.

Losses are compared as printed (7 significant digits): the resumed run repeats the same float
operations on the same state, so any lost state (weights, Adam moments, LR step, data position,
dropout RNG -- dropout is on) shows as a different digit; identical floats print identically.
"""
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from megatron_ds.checkpoint.format import TRACKER
from megatron_ds.checkpoint.integrity import verify
from tests.launch.helpers import PYTHON, REPO, clean_env, requires_mpirun
from tests.training.cli import SMALL_GPT, iterations, printed_losses

ITERS = 40
ARGS = SMALL_GPT + ["--pipeline-model-parallel-size", "2", "--train-iters", str(ITERS),
                    "--lr-decay-iters", str(ITERS), "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
TORCHRUN = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            "--shutdown-timeout", "120"]


def _mpirun(port):
    return ["mpirun", "-np", "2", "--oversubscribe", "-bind-to", "none", "-x", f"MASTER_PORT={port}",
            "-x", "MASTER_ADDR=127.0.0.1", PYTHON]


class Job:
    """A launcher run with its output in files, so the test can watch it while it runs."""

    def __init__(self, cmd, workdir: Path, name: str, **env_vars):
        self.out_path, self.err_path = workdir / f"{name}.out", workdir / f"{name}.err"
        self.tag = uuid.uuid4().hex
        env = clean_env(MEGATRON_DS_TEST_TAG=self.tag, **env_vars)
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen([str(c) for c in cmd], stdout=out, stderr=err, env=env, cwd=workdir,
                                         start_new_session=True)

    def wait_for(self, pattern: str, timeout=600):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if re.search(pattern, self.out_path.read_text(), re.M):
                return
            if self.proc.poll() is not None:
                pytest.fail(f"exited before {pattern!r}:\n{self.out_path.read_text()[-3000:]}\n"
                            f"{self.err_path.read_text()[-3000:]}")
            time.sleep(0.05)
        self.kill()
        pytest.fail(f"no {pattern!r} after {timeout}s")

    def finish(self, timeout=600):
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"still running after {timeout}s:\n{self.err_path.read_text()[-3000:]}")
        return rc, self.out_path.read_text(), self.err_path.read_text()

    def kill(self):
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def all_pids(self):
        """Every process of this job (the launcher, the training processes, their loader workers)."""
        pids = []
        for entry in Path("/proc").iterdir():
            try:
                env = (entry / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"MEGATRON_DS_TEST_TAG={self.tag}".encode() in env:
                pids.append(int(entry.name))
        return pids

    def rank_pids(self, rank):
        """pids of this job's training processes of one rank (found by the tag in their environment)."""
        pids = []
        for entry in Path("/proc").iterdir():
            try:
                env = (entry / "environ").read_bytes().split(b"\0")
                cmd = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if f"MEGATRON_DS_TEST_TAG={self.tag}".encode() in env and b"pretrain_gpt.py" in cmd and \
                    f"OMPI_COMM_WORLD_RANK={rank}".encode() in env:
                pids.append(int(entry.name))
        # not the rank's DataLoader workers (forked children: same environment and command line)
        return [pid for pid in pids if _parent(pid) not in pids]


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


@pytest.fixture(scope="module")
def straight():
    """The uninterrupted run's printed losses: the same flags on two gloo processes of this session
    (the launchers do not enter the numbers; a torchrun launch would only add its start-up)."""
    losses = printed_losses(2, ARGS)
    assert [it for it, _ in losses] == list(range(1, ITERS + 1))
    return losses


# The default --num-workers: DataLoader worker processes, which a signal to a whole process group (or
# to every process of the job, as PBS and Grid Engine send it) reaches too. The loader's order and the
# model's RNG do not depend on them, so the straight run (no workers) still gives the losses.
LOADER_WORKERS = ["--num-workers", "2"]


def _interrupt_and_resume(tmp_path, launcher, send, extra=()):
    ckpt = str(tmp_path / "ckpt")
    job = Job(launcher + [REPO / "pretrain_gpt.py", *ARGS, *extra, "--save", ckpt, "--save-interval", "1000"],
              tmp_path, "first")
    job.wait_for(r"^ iteration\s+3/")
    send(job)
    rc, out, err = job.finish()
    first = iterations(out)
    stopped = first[-1][0]
    assert stopped < ITERS, "the signal came too late to test anything"
    assert f"saved checkpoint at iteration {stopped} to {ckpt}" in out
    assert f"exiting at iteration {stopped} (stop signal received)" in out
    assert "received SIGTERM: finishing this iteration, then saving and exiting" in err
    assert open(os.path.join(ckpt, TRACKER)).read() == str(stopped)
    assert verify(os.path.join(ckpt, f"global_step{stopped}")) is None  # complete, every CRC matches
    assert "DataLoader worker" not in err and "error:" not in err, err[-3000:]
    rc2, out2, err2 = Job(launcher + [REPO / "pretrain_gpt.py", *ARGS, *extra, "--load", ckpt, "--save", ckpt],
                          tmp_path, "second").finish()
    assert rc2 == 0, err2[-3000:]
    return rc, first + iterations(out2)


def test_sigterm_under_torchrun_saves_and_resumes_exactly(tmp_path, straight):
    # torchrun forwards SIGTERM to each worker's process group -- the worker and its DataLoader
    # workers -- and SIGKILLs them after --shutdown-timeout (30 s by default); the workers' save
    # finishes well inside the 120 s given here. torchrun itself then reports the signal with its own
    # traceback and a non-zero status, which is its behaviour.
    _, losses = _interrupt_and_resume(tmp_path, TORCHRUN, lambda job: os.kill(job.proc.pid, signal.SIGTERM),
                                      LOADER_WORKERS)
    assert losses == straight


def test_sigterm_to_every_process_of_the_job_saves_and_resumes_exactly(tmp_path, straight):
    """As PBS (qdel, walltime) and Grid Engine signal a job: every process at once -- torchrun, the
    training processes and their DataLoader workers."""
    def to_everyone(job):
        for pid in job.all_pids():
            os.kill(pid, signal.SIGTERM)

    _, losses = _interrupt_and_resume(tmp_path, TORCHRUN, to_everyone, LOADER_WORKERS)
    assert losses == straight


def test_sigterm_under_deepspeed_launcher_saves_and_resumes_exactly(tmp_path, straight):
    # DeepSpeed's launch.py sends SIGTERM to one worker after the other, SIGKILLing each after 30 s:
    # the first worker's signal is enough, the ranks agree on it and all save.
    import base64
    import json

    from tests.launch.helpers import free_port

    world_info = base64.urlsafe_b64encode(json.dumps({"localhost": [0, 1]}).encode()).decode()
    launcher = [PYTHON, "-m", "deepspeed.launcher.launch", f"--world_info={world_info}",
                "--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    _, losses = _interrupt_and_resume(tmp_path, launcher, lambda job: os.kill(job.proc.pid, signal.SIGTERM))
    assert losses == straight


@requires_mpirun
def test_sigterm_to_one_rank_under_mpirun_saves_and_resumes_exactly(tmp_path, straight):
    from tests.launch.helpers import free_port

    def to_rank_1(job):
        [pid] = job.rank_pids(1)
        os.kill(pid, signal.SIGTERM)

    launcher = _mpirun(free_port()) + []
    rc, losses = _interrupt_and_resume(tmp_path, launcher, to_rank_1, LOADER_WORKERS)
    assert rc == 0  # every rank exited 0, so mpirun does too
    assert losses == straight


def _job_gone(job: Job, timeout: float = 15.0) -> list[int]:
    """The job's processes still alive after ``timeout`` s (zombies aside): [] once all have ended."""
    deadline = time.time() + timeout
    while True:
        alive = [pid for pid in job.all_pids() if "State:\tZ" not in _status(pid)]
        if not alive or time.time() > deadline:
            return alive
        time.sleep(0.1)


def _status(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return "State:\tZ"


CTRL_C = ("received SIGINT: finishing this iteration, then saving and exiting (send it again, 3 s or more later, "
          "to stop at once without saving)")
ONE_PROCESS = SMALL_GPT + ["--train-iters", str(ITERS), "--lr-decay-iters", str(ITERS)] + LOADER_WORKERS


def test_ctrl_c_finishes_the_iteration_saves_and_exits_130(tmp_path):
    """Ctrl-C at a terminal: SIGINT to the foreground process group -- the trainer and its DataLoader
    workers. The trainer stops as on a walltime signal (saves a complete checkpoint) and exits 130 in one
    line; the workers print nothing and end with it."""
    ckpt = tmp_path / "ckpt"
    job = Job([PYTHON, REPO / "pretrain_gpt.py", *ONE_PROCESS, "--save", ckpt, "--save-interval", "1000"], tmp_path,
              "ctrl_c")
    job.wait_for(r"^ iteration\s+3/")
    os.killpg(job.proc.pid, signal.SIGINT)
    rc, out, err = job.finish()
    stopped = iterations(out)[-1][0]
    assert rc == 128 + signal.SIGINT and stopped < ITERS, err[-3000:]
    assert err.splitlines() == [CTRL_C], err[-3000:]  # no traceback, from any process
    assert f"saved checkpoint at iteration {stopped} to {ckpt}" in out
    assert out.splitlines()[-1] == f"exiting at iteration {stopped} (stop signal received)"
    assert (ckpt / TRACKER).read_text() == str(stopped) and verify(str(ckpt / f"global_step{stopped}")) is None
    assert _job_gone(job) == []


def test_ctrl_c_under_torchrun_with_pipeline_parallel_is_clean(tmp_path):
    """Ctrl-C to torchrun (megatron_ds.launch.torchrun: torchrun itself, ending in one line): it forwards
    SIGINT to each worker's process group (worker and loader workers); both pipeline stages save the same
    iteration, and nothing prints a traceback."""
    ckpt = tmp_path / "ckpt"
    launcher = [PYTHON, "-m", "megatron_ds.launch.torchrun", *TORCHRUN[3:]]
    job = Job(launcher + [REPO / "pretrain_gpt.py", *ARGS, *LOADER_WORKERS, "--save", ckpt, "--save-interval", "1000"],
              tmp_path, "ctrl_c_torchrun", PYTHONPATH=REPO)
    job.wait_for(r"^ iteration\s+3/")
    os.killpg(job.proc.pid, signal.SIGINT)  # torchrun's group: its workers run in sessions of their own
    rc, out, err = job.finish()
    stopped = iterations(out)[-1][0]
    assert rc == 128 + signal.SIGINT and stopped < ITERS, err[-3000:]
    assert "Traceback" not in err and "DataLoader worker" not in err, err[-3000:]
    # once per rank; counted in the text, not by line: torchrun's agent and the two ranks write to one stderr,
    # and a warning of the agent's can land on the line a rank's message ends
    assert err.count(CTRL_C) == 2
    assert err.splitlines()[-1] == "torchrun: stopped by SIGINT; its workers were sent it and have ended"
    assert (ckpt / TRACKER).read_text() == str(stopped) and verify(str(ckpt / f"global_step{stopped}")) is None
    assert _job_gone(job) == []


def test_ctrl_c_twice_stops_at_once_without_saving(tmp_path):
    """A second Ctrl-C while the first one's iteration is still running: exit 130 at once, no save, one
    line more. Iterations here take a few seconds (many micro-batches); the job is stopped (SIGSTOP, as
    Ctrl-Z does) between the two presses so that the second comes after the repeat window and before the
    iteration ends, however fast the machine."""
    from megatron_ds.training.signals import REPEAT_WINDOW_S

    ckpt = tmp_path / "ckpt"
    job = Job([PYTHON, REPO / "pretrain_gpt.py", *ONE_PROCESS, "--global-batch-size", "512", "--save", ckpt,
               "--save-interval", "1000"], tmp_path, "twice")
    job.wait_for(r"^ iteration\s+1/")
    os.killpg(job.proc.pid, signal.SIGINT)
    deadline = time.time() + 60
    while CTRL_C not in job.err_path.read_text() and time.time() < deadline:
        time.sleep(0.01)
    os.killpg(job.proc.pid, signal.SIGSTOP)
    time.sleep(REPEAT_WINDOW_S + 0.5)
    os.killpg(job.proc.pid, signal.SIGINT)
    os.killpg(job.proc.pid, signal.SIGCONT)
    rc, out, err = job.finish(timeout=60)
    assert rc == 128 + signal.SIGINT, err[-3000:]
    assert err.splitlines() == [CTRL_C, "received SIGINT again: exiting now, without saving"], err[-3000:]
    assert [it for it, _ in iterations(out)] == [1] and not list(ckpt.glob("global_step*"))
    assert _job_gone(job) == []


def test_ctrl_c_while_loader_workers_are_forked_is_not_lost(tmp_path):
    """A Ctrl-C that arrives while the trainer forks its DataLoader workers (a large process forks for
    tens of milliseconds) used to be lost: Python ran the KeyboardInterrupt inside logging's after-fork
    hook, which printed "Exception ignored" and trained on. Here the signal is sent from an after-fork
    hook of the parent, so it lands in that window every time."""
    proc = subprocess.run([sys.executable, "-c", CTRL_C_AT_FORK_PROBE], capture_output=True, text=True, timeout=120,
                          cwd=REPO, env=clean_env(), start_new_session=True)
    assert proc.stdout.splitlines() == ["KeyboardInterrupt after the workers started"], proc.stdout + proc.stderr
    assert "Exception ignored" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]


CTRL_C_AT_FORK_PROBE = """
import os, signal
from megatron_ds.config.schema import DataConfig
from megatron_ds.training.data import MockGPTDataset, build_loader

loader = build_loader(MockGPTDataset(64, 8, 50, seed=0), DataConfig(num_workers=2), lambda samples: samples,
                      consumed_samples=0, micro_batch_size=2, dp_rank=0, dp_size=1)
os.register_at_fork(after_in_parent=lambda: os.kill(os.getpid(), signal.SIGINT))
try:
    batches = iter(loader)
    print("no KeyboardInterrupt", flush=True)
except KeyboardInterrupt:
    print("KeyboardInterrupt after the workers started", flush=True)
"""


SECOND_SIGNAL = """
import os, signal, sys, time
from megatron_ds.training.signals import StopSignals
with StopSignals() as s:
    os.kill(os.getpid(), signal.SIGUSR1)
    os.kill(os.getpid(), signal.SIGUSR1)  # the same event again (a launcher forwarding it): ignored
    time.sleep(0.2)
    print("first:", s.name, flush=True)
    time.sleep(float(sys.argv[1]))
    os.kill(os.getpid(), signal.SIGTERM)  # a second request, later: exits at once
    time.sleep(30)
print("not reached", flush=True)
"""


def test_second_signal_exits_at_once(tmp_path):
    from megatron_ds.training.signals import REPEAT_WINDOW_S

    started = time.time()
    proc = subprocess.run([sys.executable, "-c", SECOND_SIGNAL, str(REPEAT_WINDOW_S + 0.5)], capture_output=True,
                          text=True, timeout=120, cwd=REPO, env=clean_env())
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    assert proc.stdout == "first: SIGUSR1\n"
    assert proc.stderr.splitlines()[-1] == "received SIGTERM again: exiting now, without saving"
    assert time.time() - started < 25  # not the 30 s sleep: it left at once


LOADER_WORKERS_PROBE = """
import os, signal, time, torch
from megatron_ds.training.signals import StopSignals, ignore_stop_signals

class Numbers(torch.utils.data.Dataset):
    def __len__(self):
        return 1000
    def __getitem__(self, i):
        return i

loader = torch.utils.data.DataLoader(Numbers(), batch_size=2, num_workers=2, persistent_workers=True,
                                     worker_init_fn=ignore_stop_signals)
batches = iter(loader)  # kept referenced until exit, as DeepSpeed's pipeline engine keeps its data iterator
for _ in range(4):  # batches come from the workers in turn: both are running (past worker_init_fn)
    next(batches)
with StopSignals() as stop:
    os.killpg(0, signal.SIGTERM)  # the whole process group: this process and its two loader workers
    while stop.received is None:
        time.sleep(0.01)
    time.sleep(1.0)  # a killed worker would be noticed by now
    print("after the signal:", next(batches).tolist(), flush=True)
"""


def _as_if_in_background():
    """A job script's ``cmd &`` (or nohup) starts cmd with SIGINT ignored, which its loader workers inherit;
    the trainer ends them with SIGINT at exit (signals.py): this is how two full-suite runs started in the
    background hung here while foreground runs passed."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def test_loader_workers_outlive_a_group_signal_and_end_with_the_trainer(tmp_path):
    """SIGTERM to the trainer's process group: its DataLoader workers ignore it (the batch after the
    signal still arrives), and the process still exits promptly, ending them itself (multiprocessing's
    exit handler would SIGTERM and wait for them forever)."""
    # -X faulthandler: on a hang, SIGABRT to the group prints where each process (the probe and its
    # workers, which inherit the handler) is stuck, so a failure says which side did not end
    proc = subprocess.Popen([sys.executable, "-X", "faulthandler", "-c", LOADER_WORKERS_PROBE], cwd=REPO,
                            env=clean_env(), start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=_as_if_in_background)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        tree = subprocess.run(["ps", "-o", "pid,ppid,stat,etime,args", "-g", str(proc.pid)], capture_output=True,
                              text=True).stdout
        for sig in (signal.SIGABRT, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):  # (the group may have ended meanwhile)
                os.killpg(proc.pid, sig)
            time.sleep(2)
        out, err = proc.communicate()
        pytest.fail(f"the probe did not end in 120 s; its processes then:\n{tree}\nstdout:\n{out[-2000:]}\n"
                    f"stderr (stacks):\n{err[-6000:]}")
    assert proc.returncode == 0, err[-3000:]
    assert out.splitlines()[-1].startswith("after the signal: [")
    assert "DataLoader worker" not in err and "Traceback" not in err, err[-3000:]


LOADER_WITHOUT_HANDLER_PROBE = """
from megatron_ds.config.schema import DataConfig
from megatron_ds.training.data import MockGPTDataset, build_loader

loader = build_loader(MockGPTDataset(64, 8, 50, seed=0), DataConfig(num_workers=2), lambda samples: samples,
                      consumed_samples=0, micro_batch_size=2, dp_rank=0, dp_size=1)
batches = iter(loader)  # still referenced at exit, with both workers running
for _ in range(4):
    next(batches)
print("exiting", flush=True)
"""


def test_a_process_with_loader_workers_and_no_signal_handler_exits():
    """Loader workers ignore SIGTERM (ignore_stop_signals), which multiprocessing's exit handler sends its
    daemonic children before waiting for them without a limit: any process that builds a loader (a tool,
    a test; not only the trainer, whose StopSignals took care of it) must end them itself, or never exit."""
    proc = subprocess.run([sys.executable, "-c", LOADER_WITHOUT_HANDLER_PROBE], capture_output=True, text=True,
                          timeout=120, cwd=REPO, env=clean_env(), start_new_session=True,
                          preexec_fn=_as_if_in_background)
    assert proc.returncode == 0 and proc.stdout.strip() == "exiting", proc.stderr[-3000:]


def _writers(job: Job) -> list[int]:
    """pids of the job's background checkpoint writers (--async-save), by their process name."""
    from megatron_ds.checkpoint.background import NAME

    return [pid for pid in job.all_pids() if _comm(pid) == NAME and "State:\tZ" not in _status(pid)]


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def test_sigterm_while_an_async_save_is_written_waits_for_it_saves_and_resumes_exactly(tmp_path, straight):
    """--async-save --use-persistent-ckpt-worker under torchrun, PP 2: each rank's writer is held stopped
    (SIGSTOP) from the start, so the save of iteration 5 stays in flight while training goes on; SIGTERM
    then stops the job, which waits for that save (once the writers go on: the stop's save, or the save
    of iteration 10 if the signal came later, waits for it), completes it, saves the iteration it stopped
    at and exits 0. Both checkpoints are complete, and resuming from the last gives
    the uninterrupted run's losses."""
    ckpt = tmp_path / "ckpt"
    flags = [*ARGS, "--save", ckpt, "--save-interval", "5", "--async-save", "--use-persistent-ckpt-worker"]
    job = Job(TORCHRUN + [REPO / "pretrain_gpt.py", *flags], tmp_path, "async")
    writers = []
    deadline = time.time() + 300
    while len(writers) < 2 and job.proc.poll() is None and time.time() < deadline:
        writers = _writers(job)  # forked when training starts, before the model is built
        time.sleep(0.01)
    assert len(writers) == 2, job.err_path.read_text()[-3000:]
    try:
        for pid in writers:
            os.kill(pid, signal.SIGSTOP)
        job.wait_for(r"^saving checkpoint at iteration 5 to \S+ in the background")
        job.wait_for(r"^ iteration\s+7/")  # training goes on while the save is written
        os.kill(job.proc.pid, signal.SIGTERM)
        job.wait_for(r"^waiting for checkpoint 5, still being written in the background, before saving iteration "
                     r"\d+$")
        assert not (ckpt / "global_step5" / "megatron_ds_manifest.json").exists()
        assert not (ckpt / TRACKER).exists()
    finally:
        for pid in writers:
            os.kill(pid, signal.SIGCONT)
    rc, out, err = job.finish()
    stopped = iterations(out)[-1][0]
    assert 7 <= stopped < ITERS, out[-3000:]
    assert re.search(r"^saved checkpoint at iteration 5 to \S+ \(written in the background", out, re.M)
    assert re.search(rf"^saved checkpoint at iteration {stopped} to \S+ \(written in the background", out, re.M)
    assert f"exiting at iteration {stopped} (stop signal received)" in out
    assert (ckpt / TRACKER).read_text() == str(stopped)
    assert verify(str(ckpt / "global_step5")) is None and verify(str(ckpt / f"global_step{stopped}")) is None
    assert "error:" not in err, err[-3000:]
    assert _job_gone(job) == []  # the writers too
    rc2, out2, err2 = Job(TORCHRUN + [REPO / "pretrain_gpt.py", *flags, "--load", ckpt], tmp_path, "resumed").finish()
    assert rc2 == 0, err2[-3000:]
    assert iterations(out) + iterations(out2) == straight
