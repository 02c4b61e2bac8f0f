"""Run a test function on N gloo processes on localhost.

    from tests.distributed import run_distributed

    def _check(rank, world_size, n):            # module level: it is pickled by name
        t = torch.full((n,), float(rank))
        torch.distributed.all_reduce(t)
        return t.tolist()

    def test_sum():
        assert run_distributed(_check, 2, 3) == [[1.0] * 3] * 2

Each child is a fresh process that inherits nothing from the test process (no CUDA context, thread
pools or process groups): a "forkserver" child, forked from a clean server process that has done
nothing but import torch (and, without CUDA, DeepSpeed and the training stack: see
`_forkserver_preload`). That gives what a "spawn" child gets while skipping the ~2 s of importing
torch, and ~3 s more of DeepSpeed and megatron_ds (far more on a busy 2-core box), in every child;
set START_METHOD = "spawn" to compare. A child gets the standard launcher variables (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and an initialized gloo default process group, so code
that calls `deepspeed.init_distributed()` finds the group already there. Children run on the CPU
even where GPUs exist (DS_ACCELERATOR=cpu, CUDA_VISIBLE_DEVICES=""; `env` may override them).

Rendezvous: the parent process hosts the TCPStore, bound to a port the OS picks (port 0), and the
children connect to it as clients (TORCHELASTIC_USE_AGENT_STORE=True, the mechanism torchrun uses).
The usual "find a free port, release it, hope rank 0 gets it first" race therefore cannot happen:
the port is held for the whole run. Should the store still fail to come up, start-up is retried.

Failures: any rank's exception makes the parent raise `DistributedTestError` carrying that rank's
full traceback (the earliest failure first: later ones are usually peers losing their connection).
A run that is still going after `timeout` seconds is dumped (each live rank's Python stack, via
faulthandler) and killed, and `DistributedTimeoutError` says which ranks hung and where.
Children are always joined, so no zombies are left; they also exit on their own if the parent dies.
"""
from __future__ import annotations

import faulthandler
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import signal
import sys
import tempfile
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path

__all__ = ["run_distributed", "cuda_env", "DistributedTestError", "DistributedTimeoutError"]

START_METHOD = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"

# After the first rank fails, how long to wait for the others' reports before killing them. Peers
# blocked in a collective with the dead rank usually fail within this window; waiting longer only
# slows failing tests down.
_FAILURE_GRACE_S = 1.0
_STORE_START_ATTEMPTS = 3


class DistributedTestError(RuntimeError):
    """One or more ranks raised (or crashed). `.failures` maps rank -> traceback text."""

    def __init__(self, message: str, failures: dict[int, str]):
        super().__init__(message)
        self.failures = failures


class DistributedTimeoutError(TimeoutError):
    """The run did not finish within the timeout. `.stacks` maps hung rank -> stack dump."""

    def __init__(self, message: str, stacks: dict[int, str]):
        super().__init__(message)
        self.stacks = stacks


def run_distributed(fn, world_size: int, *args, timeout: float = 120, env: dict | None = None, **kwargs):
    """Run `fn(rank, world_size, *args, **kwargs)` on `world_size` processes; return the ranks'
    return values in rank order. `fn` must be a module-level function and its arguments and return
    value picklable. `env` is applied to each child's environment before the process group starts
    (torch is already imported by then: variables torch reads at import time have no effect).
    """
    __tracebackhide__ = True  # pytest: show the failing rank's traceback, not this helper's frames
    if world_size < 1:
        raise ValueError(f"run_distributed: world_size must be >= 1, got {world_size}")
    # gloo processes on the CPU, also on a machine with GPUs (ranks > 0 would have no GPU of their
    # own there); `env` may override both.
    env = {"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "", **(env or {})}
    store = _start_store(timeout)
    try:
        with tempfile.TemporaryDirectory(prefix="run_distributed_") as workdir:
            return _launch(fn, world_size, args, kwargs, timeout, dict(env or {}), store.port, Path(workdir))
    finally:
        del store  # closes the listening socket


def cuda_env() -> dict:
    """``env`` for children that train on this machine's GPUs (LOCAL_RANK i drives GPU i): the
    defaults above force the CPU and hide every GPU, so a child measuring CUDA memory would find no
    device. The CPU switch is turned off and the parent's CUDA_VISIBLE_DEVICES (all GPUs where it is
    unset) is passed on."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        import torch

        visible = ",".join(str(i) for i in range(torch.cuda.device_count()))
    return {"DS_ACCELERATOR": "cuda", "CUDA_VISIBLE_DEVICES": visible}


def _start_store(timeout: float):
    import torch.distributed as dist

    error = None
    for _ in range(_STORE_START_ATTEMPTS):
        try:
            # port=0: the OS assigns a free port atomically; world_size=None: do not wait for clients.
            return dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=timeout), wait_for_workers=False)
        except Exception as exc:  # noqa: BLE001 - e.g. transient EADDRINUSE on a busy machine
            error = exc
            time.sleep(0.2)
    raise RuntimeError(f"run_distributed: could not start the rendezvous store on 127.0.0.1: {error}")


def _launch(fn, world_size, args, kwargs, timeout, env, port, workdir: Path):
    __tracebackhide__ = True
    ctx = mp.get_context(START_METHOD)
    if START_METHOD == "forkserver":
        # Takes effect when the server starts (the first run of the session); later calls are no-ops.
        ctx.set_forkserver_preload(_forkserver_preload())
    procs = []
    try:
        for rank in range(world_size):
            p = ctx.Process(
                target=_child_main,
                args=(fn, rank, world_size, args, kwargs, timeout, env, port, str(workdir)),
                name=f"run_distributed-rank{rank}",
                daemon=True,  # multiprocessing kills daemons if the test process exits
            )
            p.start()
            procs.append(p)
        if _wait(procs, timeout) is None:
            stacks = _dump_stacks(procs, workdir)
            hung = sorted(stacks)
            where = "\n".join(f"--- rank {r} stack ---\n{stacks[r]}" for r in hung)
            raise DistributedTimeoutError(
                f"run_distributed({fn.__qualname__}, world_size={world_size}): ranks {hung} still running "
                f"after {timeout:g} s (deadlock or mismatched collectives?); killed them.\n{where}",
                stacks,
            )
        failures = _collect_failures(procs, workdir)
        if failures:
            ordered = sorted(failures, key=lambda r: failures[r][0])
            text = "\n".join(f"--- rank {r} ---\n{failures[r][1]}" for r in ordered)
            raise DistributedTestError(
                f"run_distributed({fn.__qualname__}, world_size={world_size}): rank {ordered[0]} failed"
                f" (failed ranks, earliest first: {ordered})\n{text}",
                {r: failures[r][1] for r in ordered},
            )
        return [_load(workdir / f"result{r}.pkl") for r in range(world_size)]
    finally:
        _kill_all(procs)


def _forkserver_preload() -> list[str]:
    """What the server imports once for all children. Torch always. On a machine without CUDA, also
    DeepSpeed and the training stack the children run (about 3 s of CPU per child on a 2-core box,
    most of a short run's start-up). Not where CUDA exists: DeepSpeed picks its accelerator once, at
    import, from DS_ACCELERATOR, and a child there may be handed ``env=cuda_env()`` -- it must import
    DeepSpeed itself, after its `env` is applied. A module that fails to import here is skipped by
    multiprocessing; the child then imports it as before.

    DS_ACCELERATOR may be unset here: the server starts at the session's first run, which may be a
    module- or session-scoped fixture, set up before the per-test fixture that sets it (conftest.py).
    Without CUDA DeepSpeed detects the CPU then, and the children set DS_ACCELERATOR=cpu themselves."""
    import torch

    modules = ["torch", "torch.distributed"]
    if os.environ.get("DS_ACCELERATOR", "cpu") == "cpu" and not torch.cuda.is_available():
        modules += ["deepspeed", "megatron_ds.families", "megatron_ds.training.trainer"]
    return modules


def _wait(procs, timeout):
    """Wait until every process exits (-> False) or one fails (-> True, after a grace period for
    the others' reports), or the timeout passes (-> None)."""
    deadline = time.monotonic() + timeout
    live = {p.sentinel: p for p in procs}
    while live:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        for sentinel in mp.connection.wait(list(live), timeout=remaining):
            proc = live.pop(sentinel)
            proc.join()
            if proc.exitcode != 0:
                grace_end = time.monotonic() + _FAILURE_GRACE_S
                while live and time.monotonic() < grace_end:
                    for s in mp.connection.wait(list(live), timeout=grace_end - time.monotonic()):
                        live.pop(s).join()
                return True
    return False


def _collect_failures(procs, workdir):
    failures = {}
    for rank, p in enumerate(procs):
        err_file = workdir / f"error{rank}.pkl"
        if err_file.exists():
            failures[rank] = _load(err_file)
        elif p.exitcode not in (0, None):
            how = f"killed by signal {-p.exitcode}" if p.exitcode < 0 else f"exit code {p.exitcode}"
            failures[rank] = (time.time(), f"process died ({how}) without a Python exception (crash?)\n")
        elif p.exitcode == 0 and not (workdir / f"result{rank}.pkl").exists():
            failures[rank] = (time.time(), "process exited with code 0 before returning (os._exit in fn?)\n")
    return failures


def _dump_stacks(procs, workdir):
    alive = [(r, p) for r, p in enumerate(procs) if p.is_alive()]
    for _, p in alive:
        try:
            os.kill(p.pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    time.sleep(0.5)  # faulthandler writes from a signal handler; give it a moment
    stacks = {}
    for r, _ in alive:
        path = workdir / f"stack{r}.txt"
        stacks[r] = path.read_text(errors="replace") if path.exists() else "(no stack dump)\n"
    return stacks


def _kill_all(procs):
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
        p.close()


def _load(path: Path):
    with open(path, "rb") as f:
        return pickle.load(f)


def _dump(obj, path: Path):
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        pickle.dump(obj, f)
    os.replace(tmp, path)  # the parent never reads a half-written file


# ---------------------------------------------------------------------------- child side


def _child_main(fn, rank, world_size, args, kwargs, timeout, env, port, workdir):
    workdir = Path(workdir)
    _exit_with_parent()
    stack_file = open(workdir / f"stack{rank}.txt", "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)

    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_USE_AGENT_STORE="True",  # connect to the parent's store instead of hosting one
        TORCHELASTIC_RESTART_COUNT="0",  # older torch reads it whenever the agent store is used
    )
    os.environ.update({k: str(v) for k, v in env.items()})

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # N ranks share a small machine; oversubscription makes tests crawl
    try:
        dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=timeout))
        try:
            result = fn(rank, world_size, *args, **kwargs)
        except BaseException:  # noqa: BLE001 - SystemExit/KeyboardInterrupt in a rank are failures too
            # Report before tearing down: peers notice this rank leaving and fail too, and the
            # timestamp is what lets the parent name the root cause rather than a peer.
            _dump((time.time(), traceback.format_exc()), workdir / f"error{rank}.pkl")
            raise
        if dist.is_initialized():  # fn may have torn it down itself
            dist.destroy_process_group()  # without it gloo may abort at exit ("terminate called ...")
        _dump(result, workdir / f"result{rank}.pkl")
    except BaseException:  # noqa: BLE001
        if not (workdir / f"error{rank}.pkl").exists():  # init or pickling the result failed
            _dump((time.time(), traceback.format_exc()), workdir / f"error{rank}.pkl")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # skip atexit/gloo teardown that can block on peers stuck in a collective


def _exit_with_parent():
    """If the test process dies hard (SIGKILL, OOM), exit instead of hanging in a collective forever.
    Our parent (the test process, or the forkserver, which exits with it) going away shows as
    this process being re-parented."""
    parent_pid = os.getppid()

    def watch():
        while True:
            if os.getppid() != parent_pid:
                os._exit(3)
            time.sleep(1.0)

    threading.Thread(target=watch, daemon=True, name="parent-watchdog").start()
