"""kill -9 as a cluster does it (walltime after the grace period, a node failure, qdel -W force): the
whole job -- torchrun and its workers -- killed at random moments, inside saves too, then the same
command again with --load = --save. Every restart must resume from the newest complete checkpoint
(found here by reading the manifests, independently of the code under test) and print the losses of
the uninterrupted run; the last one finishes. Pipeline parallel 2, and pipeline parallel 2 with
--async-save (kills land in the snapshot, in the background writers' files, in the manifest and tracker
written once they finished; the reference run saves nothing, synchronously or not). Two ranks save what one
process does and more (the other stage's files, the manifest written once every rank's are), so a
one-process layout is not run too (it cost 24 s of the suite).

Also: torchrun alone killed -- its workers notice and stop at once, saving nothing.

Losses are compared as printed (see tests/training/test_signals.py: identical floats print alike).
"""
import functools
import json
import os
import random
import re
import signal
import time
from pathlib import Path

import pytest

from megatron_ds.checkpoint.format import MANIFEST, TRACKER
from tests.launch.helpers import PYTHON, REPO
from tests.training.cli import SMALL_GPT, iterations, printed_losses
from tests.training.test_signals import Job

ITERS = 12
ARGS = SMALL_GPT + ["--train-iters", str(ITERS), "--lr-decay-iters", str(ITERS), "--hidden-dropout", "0.1",
                    "--attention-dropout", "0.1", "--save-interval", "1"]  # a save every iteration: kills land in them
PERSISTENT = "--use-persistent-ckpt-worker"
ASYNC = ["--async-save"]  # Megatron-LM's background save (checkpoint/async_save.py): a writer forked per save
LAYOUTS = {"pp2": (2, ["--pipeline-model-parallel-size", "2"]),
           "pp2_async_save": (2, ["--pipeline-model-parallel-size", "2", *ASYNC])}
KILLS = 3  # per layout: each launch costs ~7 s of start-up on two busy cores
HANDED_OVER = re.compile(r"^saving checkpoint at iteration \d+ to \S+ in the background", re.M)
LOADED = re.compile(r"^loaded checkpoint \S+/global_step(\d+) \(iteration (\d+)\)$", re.M)


@functools.lru_cache(maxsize=None)
def _straight(nproc: int, extra: tuple) -> dict:
    losses = dict(printed_losses(nproc, [*ARGS, *extra]))
    assert sorted(losses) == list(range(1, ITERS + 1))
    return losses


def straight_losses(nproc: int, extra) -> dict:
    """The uninterrupted run's losses: the same flags on gloo processes of this session (no launcher
    start-up), without --async-save (a background save must not change a loss); once per layout."""
    return _straight(nproc, tuple(flag for flag in extra if flag not in (*ASYNC, PERSISTENT)))


def _torchrun(nproc):
    return [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]


def newest_complete(ckpt: Path) -> int:
    """The newest global_stepN whose manifest exists and whose every listed file has its size."""
    best = 0
    for d in ckpt.glob("global_step*"):
        m = re.fullmatch(r"global_step(\d+)", d.name)
        try:
            files = json.loads((d / MANIFEST).read_text())["files"]
        except (OSError, ValueError, KeyError):
            continue
        if m and all((d / n).is_file() and (d / n).stat().st_size == e["size"] for n, e in files.items()):
            best = max(best, int(m.group(1)))
    return best


def _steps(ckpt: Path) -> set:
    return {int(m.group(1)) for d in ckpt.glob("global_step*") if (m := re.fullmatch(r"global_step(\d+)", d.name))}


def _kill_at_a_random_moment(job: Job, ckpt: Path, rng: random.Random, background: bool = False) -> str:
    """SIGKILL to the job's whole process group: during start-up / loading, during training, or just
    as a new checkpoint folder appears (inside DeepSpeed's writes, the config, the manifest or the
    tracker update). ``background`` (--async-save): or within 50 ms of a save's hand-over to the writers
    (inside their files, or the manifest and tracker written once they answered)."""
    moment = rng.choice(["start-up", "training", "save", "save"] + (["background"] * 2 if background else []))
    if moment == "start-up":
        time.sleep(rng.uniform(0.5, 6.0))
    elif _training(job):
        if moment == "training":
            time.sleep(rng.uniform(0.0, 0.6))
        elif moment == "background":
            handed = len(HANDED_OVER.findall(job.out_path.read_text()))
            deadline = time.time() + 30
            while len(HANDED_OVER.findall(job.out_path.read_text())) == handed and job.proc.poll() is None \
                    and time.time() < deadline:
                time.sleep(0.002)
            time.sleep(rng.uniform(0.0, 0.05))
        else:
            before = _steps(ckpt)
            deadline = time.time() + 30
            while not (_steps(ckpt) - before) and job.proc.poll() is None and time.time() < deadline:
                time.sleep(0.002)
    kill_whole_job(job)
    return moment


def _training(job: Job, timeout: float = 300) -> bool:
    """Wait for the job's first iteration line; False when it ended first (nothing left to train)."""
    deadline = time.time() + timeout
    while job.proc.poll() is None and time.time() < deadline:
        if re.search(r"^ iteration\s+\d+/", job.out_path.read_text(), re.M):
            return True
        time.sleep(0.02)
    return False


def kill_whole_job(job: Job) -> None:
    """SIGKILL to torchrun and every worker at once, as a scheduler ends a job (torchrun starts its
    workers in sessions of their own, so its process group alone would miss them)."""
    for pid in [job.proc.pid, *_pids_of(job)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    job.proc.wait()


def _check_segment(out: str, expected_start: int, straight: dict, what: str) -> None:
    """The run loaded the newest complete checkpoint (if it got that far) and printed straight's losses."""
    loaded = LOADED.findall(out)
    if loaded:
        assert [(int(a), int(b)) for a, b in loaded] == [(expected_start, expected_start)], (what, out[-3000:])
    elif expected_start == 0 and "starting from scratch" in out:
        pass
    printed = iterations(out)
    if printed:
        assert printed[0][0] == expected_start + 1, (what, printed)
    for it, loss in printed:
        assert loss == straight[it], (what, it, loss, straight[it])


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_kill_loop_resumes_from_the_newest_complete_step(tmp_path, layout):
    nproc, extra = LAYOUTS[layout]
    command = _torchrun(nproc) + [REPO / "pretrain_gpt.py", *ARGS, *extra]
    straight = straight_losses(nproc, extra)

    ckpt = tmp_path / "ckpt"
    same_command = command + ["--save", ckpt, "--load", ckpt]
    seed = random.randrange(10 ** 6)
    rng = random.Random(seed)
    for n in range(KILLS):
        expected = newest_complete(ckpt)
        job = Job(same_command, tmp_path, f"killed{n}")
        moment = _kill_at_a_random_moment(job, ckpt, rng, background=ASYNC[0] in extra)
        _check_segment(job.out_path.read_text(), expected, straight, f"seed {seed}, kill {n} ({moment})")
    expected = newest_complete(ckpt)
    rc, out, err = Job(same_command, tmp_path, "last").finish()
    assert rc == 0, (seed, err[-3000:])
    _check_segment(out, expected, straight, f"seed {seed}, the last run")
    # a last kill after the final checkpoint was complete leaves nothing to train (and nothing printed)
    assert expected == ITERS or iterations(out)[-1][0] == ITERS
    assert (ckpt / TRACKER).read_text() == str(ITERS) and newest_complete(ckpt) == ITERS


def _pids_of(job: Job) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
            cmd = (entry / "cmdline").read_bytes()
            state = (entry / "status").read_text()
        except OSError:
            continue
        if f"MEGATRON_DS_TEST_TAG={job.tag}".encode() in env and b"pretrain_gpt.py" in cmd and \
                b"torch.distributed.run" not in cmd and "State:\tZ" not in state:
            pids.append(int(entry.name))
    return pids


def test_workers_stop_when_torchrun_alone_is_killed(tmp_path):
    """kill -9 of torchrun only: its workers used to train on unnoticed; now they stop within about a
    second (parent_watch.POLL_S), and save nothing."""
    ckpt = tmp_path / "ckpt"
    long_run = SMALL_GPT + ["--train-iters", "100000", "--lr-decay-iters", "100000", "--pipeline-model-parallel-size",
                            "2", "--save", ckpt, "--save-interval", "100000"]
    job = Job(_torchrun(2) + [REPO / "pretrain_gpt.py", *long_run], tmp_path, "orphaned")
    try:
        job.wait_for(r"^ iteration\s+3/", timeout=300)
        workers = _pids_of(job)
        assert len(workers) == 2
        os.kill(job.proc.pid, signal.SIGKILL)
        job.proc.wait()
        killed = time.time()
        while _pids_of(job) and time.time() - killed < 20:
            time.sleep(0.1)
        assert not _pids_of(job), "the workers trained on without their launcher"
        assert time.time() - killed < 10
    finally:
        kill_whole_job(job)
    # the first to notice exits; its pipeline peer may find it gone in the next collective first
    err = job.err_path.read_text()
    assert re.search(r"error: the torchrun launcher \(pid \d+\) is gone: stopping this worker", err), err
    assert CPP_STACK not in err, err[-3000:]
    assert not list(ckpt.glob("global_step*"))  # nothing saved, partial or whole


CPP_STACK = "Exception raised from"  # the head of a C++ warning's stack (torch's c10d store calls)


def test_killing_the_torchrun_that_hosts_the_store_leaves_one_line_per_rank(tmp_path):
    """Two nodes (here two torchruns on one host, static rendezvous, a pipeline stage on each); kill -9 of
    node 0's torchrun, which hosts the c10d store. Node 0's worker stops in one line; node 1's worker finds
    its peer gone in a collective and says so in one line -- asking the store (gone too) which ranks are
    missing used to add torch's warning with a 20-frame C++ stack."""
    from tests.launch.helpers import free_port

    port = free_port()
    long_run = SMALL_GPT + ["--train-iters", "100000", "--lr-decay-iters", "100000", "--pipeline-model-parallel-size",
                            "2"]
    nodes = [Job([PYTHON, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node), "--nproc_per_node",
                  "1", "--master-addr", "127.0.0.1", "--master-port", str(port), REPO / "pretrain_gpt.py", *long_run],
                 tmp_path, f"node{node}") for node in (0, 1)]
    try:
        nodes[1].wait_for(r"^ iteration\s+3/", timeout=300)  # the last stage prints them
        os.kill(nodes[0].proc.pid, signal.SIGKILL)
        nodes[0].proc.wait()
        rc, _, err1 = nodes[1].finish(timeout=120)
    finally:
        for job in nodes:
            kill_whole_job(job)
    err0 = nodes[0].err_path.read_text()
    assert re.fullmatch(r"error: the torchrun launcher \(pid \d+\) is gone: stopping this worker \(pid \d+\) now, "
                        r"without saving\n", err0), err0
    assert rc != 0 and re.search(r"^error: a collective in the training loop at iteration \d+ failed", err1, re.M), err1
    assert CPP_STACK not in err1, err1[-3000:]


SAVING = re.compile(r"^saving checkpoint at iteration (\d+) to \S+ in the background \(training paused [\d.]+ ms to "
                    r"copy [\d.]+ [KMG]?B of state\)$")
SAVED = re.compile(r"^saved checkpoint at iteration (\d+) to \S+ \(written in the background in ([\d.]+) s, complete "
                   r"([\d.]+) s after the snapshot(?:; (\d+) iterations? trained meanwhile at ([\d.]+) ms each "
                   r"\(([\d.]+) ms each before the save\))?\)$")
ELAPSED = re.compile(r"^ iteration\s+(\d+)/.*\| elapsed time per iteration \(ms\): ([\d.]+) \|")


def _check_save_lines(out: str, saved_every: int) -> None:
    """Every save is announced, then completed; the iterations the completion line counts are the
    iteration lines printed in between, at the mean time those lines print (one process: the same clock)."""
    lines = out.splitlines()
    started = {int(m.group(1)): n for n, line in enumerate(lines) if (m := SAVING.match(line))}
    assert sorted(started) == list(range(saved_every, ITERS + 1, saved_every)), out[-3000:]
    for n, line in enumerate(lines):
        if not line.startswith("saved checkpoint"):
            continue
        m = SAVED.match(line)
        assert m, line
        iteration, writing, complete = int(m.group(1)), float(m.group(2)), float(m.group(3))
        assert 0 <= writing <= complete + 0.01, line
        between = [float(e.group(2)) for x in lines[started[iteration]:n] if (e := ELAPSED.match(x))]
        if m.group(4) is None:
            assert between == [] and iteration == ITERS, line  # the last save, waited for at the end
            continue
        assert int(m.group(4)) == len(between) > 0, (line, between)
        mean = sum(between) / len(between)
        # the line's time runs from the loop's top to the iteration's end, the iteration line's from
        # the previous line's end to this line: they differ by the printing of one line (well under 2 ms)
        assert abs(float(m.group(5)) - mean) <= 2.0 + 0.05 * mean, (line, between)
        assert float(m.group(6)) > 0


@pytest.mark.slow
def test_async_save_trains_as_without_it_and_says_what_it_cost(tmp_path):
    """One process, --async-save with a writer forked per save and with the persistent writer (and
    --keep-last 2): the losses are the uninterrupted synchronous run's, every checkpoint kept is complete
    and verifies, and each save's line says how long it was written in the background and how long the
    iterations meanwhile took."""
    from megatron_ds.checkpoint.integrity import verify
    from tests.distributed import run_distributed
    from tests.training.cli import cli_many

    straight = straight_losses(1, [])
    runs = {"forked": ASYNC, "persistent": [*ASYNC, PERSISTENT, "--keep-last", "2"]}
    argvs = [[*ARGS, "--save", str(tmp_path / name), "--save-interval", "3", *flags] for name, flags in runs.items()]
    [results] = run_distributed(cli_many, 1, argvs, timeout=600)
    for name, (rc, out, err) in zip(runs, results):
        assert rc == 0, err[-3000:]
        assert dict(iterations(out)) == straight, name
        _check_save_lines(out, 3)
        ckpt = tmp_path / name
        assert (ckpt / TRACKER).read_text() == str(ITERS)
        kept = [9, 12] if "--keep-last" in runs[name] else [3, 6, 9, 12]  # --keep-last 2 after the last completed
        assert sorted(_steps(ckpt)) == kept and [verify(str(ckpt / f"global_step{it}")) for it in kept] == [None] * len(kept)
