"""Who am I in the job? Rank discovery for every launcher we support.

Each process of a job must agree on (rank, world size, master address/port) before
`torch.distributed` / `deepspeed.init_distributed()` can rendezvous. Launchers publish this in
different environment variables:

- torchrun / `python -m torch.distributed.run` / the `deepspeed` launcher: RANK, WORLD_SIZE,
  LOCAL_RANK, MASTER_ADDR, MASTER_PORT (deepspeed also passes `--local_rank`);
- Open MPI (`mpirun`, the ABCI way): OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE} only;
- PMI-based MPIs (MPICH/Hydra, Intel MPI, MVAPICH): PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, ...

Under `mpirun` nothing sets RANK, so code that reads only RANK makes every process rank 0 of 1 and
the job either hangs or trains N identical copies. `discover_dist_env` maps whichever source is
present onto one `DistEnv`; `apply_dist_env` writes it back as the torch env:// variables.

Both functions are pure apart from reading the scheduler's host file (the first host becomes the
master when the launcher did not name one), so they are unit-tested with fake environments.
"""
from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from typing import Mapping, MutableMapping

logger = logging.getLogger(__name__)

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500  # torch's own default; used when the scheduler gives no job id
PORT_BASE, PORT_SPAN = 10000, 50000  # job-derived ports land in [10000, 60000): no root, no clash

LAUNCHERS = ("torchrun", "deepspeed", "openmpi", "pmi", "single")

# Open MPI's per-process variables; the other three are required once RANK is taken from here.
_OMPI = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
         "OMPI_COMM_WORLD_LOCAL_SIZE")
# PMI-based MPIs name the node-local rank/size differently (Hydra & Intel MPI, MVAPICH2, Cray PALS).
_PMI_LOCAL_RANK = ("MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK", "PALS_LOCAL_RANKID")
_PMI_LOCAL_SIZE = ("MPI_LOCALNRANKS", "MV2_COMM_WORLD_LOCAL_SIZE", "PALS_LOCAL_SIZE")


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    launcher: str  # one of LAUNCHERS

    def __str__(self) -> str:
        return (f"rank {self.rank}/{self.world_size} (local {self.local_rank}/"
                f"{self.local_world_size}) master {self.master_addr}:{self.master_port} "
                f"via {self.launcher}")


def discover_dist_env(use_mpi: bool = False, environ: Mapping[str, str] | None = None,
                      local_rank_arg: int | None = None) -> DistEnv:
    """Work out this process's place in the job from `environ` (default: os.environ).

    Order: an explicit MPI request (`use_mpi`, i.e. `--use-mpi`), then RANK/WORLD_SIZE set by
    torchrun or deepspeed, then Open MPI / PMI variables found without `--use-mpi` (logged), then a
    single process. Raises ValueError, naming the variables, when sources are incomplete or
    disagree.
    """
    env = os.environ if environ is None else environ
    mpi = _mpi_source(env)

    if use_mpi:
        if mpi is None:
            raise ValueError("--use-mpi was given but neither OMPI_COMM_WORLD_RANK (Open MPI) "
                             "nor PMI_RANK (MPICH/Intel MPI/MVAPICH) is set: launch with mpirun, "
                             "or drop --use-mpi for torchrun/deepspeed")
        launcher = mpi
    elif "RANK" in env:
        launcher = _torch_launcher(env, local_rank_arg)
    elif mpi is not None:
        launcher = mpi
    elif env.get("WORLD_SIZE", "1").strip() != "1":
        raise ValueError(f"WORLD_SIZE={env['WORLD_SIZE']} is set but RANK is not: set both "
                         "(torchrun and deepspeed do), or unset WORLD_SIZE for a single process")
    else:
        launcher = "single"

    if launcher == "openmpi":
        rank, world, local_rank, local_world = _read_openmpi(env)
    elif launcher == "pmi":
        rank, world, local_rank, local_world = _read_pmi(env)
    elif launcher == "single":
        rank, world, local_rank, local_world = 0, 1, 0, 1
    else:
        rank, world, local_rank, local_world = _read_torch(env, local_rank_arg)

    if launcher in ("openmpi", "pmi"):
        _check_agrees_with_torch_vars(env, launcher, rank, world)
        if rank == 0 and not use_mpi:
            # Correct but surprising: say so once, so a missing --use-mpi is visible in the log.
            logger.warning("%s variables found without --use-mpi and RANK unset: taking ranks from "
                           "%s (world size %d)", launcher, launcher, world)
    if launcher in ("openmpi", "pmi", "single") and local_rank_arg not in (None, local_rank):
        how = "a single process" if launcher == "single" else f"{launcher} (drop --local_rank)"
        raise ValueError(f"--local_rank {local_rank_arg} disagrees with local rank {local_rank} "
                         f"of {how}")

    _check_ranks(rank, world, local_rank, local_world, launcher)
    master_addr, master_port = _master(env, launcher, world, local_world)
    return DistEnv(rank, world, local_rank, local_world, master_addr, master_port, launcher)


def apply_dist_env(env: DistEnv, environ: MutableMapping[str, str] | None = None) -> None:
    """Export `env` as the variables torch's env:// and deepspeed.init_distributed() read.

    With all of RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT present, DeepSpeed skips its own
    MPI discovery (which would need mpi4py), so every process sees the world we discovered.
    """
    target = os.environ if environ is None else environ
    target.update({
        "RANK": str(env.rank),
        "WORLD_SIZE": str(env.world_size),
        "LOCAL_RANK": str(env.local_rank),
        "LOCAL_WORLD_SIZE": str(env.local_world_size),
        "MASTER_ADDR": env.master_addr,
        "MASTER_PORT": str(env.master_port),
    })


# --------------------------------------------------------------------------- sources

def _mpi_source(env: Mapping[str, str]) -> str | None:
    if "OMPI_COMM_WORLD_RANK" in env:
        return "openmpi"
    if "PMI_RANK" in env:
        return "pmi"
    return None


def _torch_launcher(env: Mapping[str, str], local_rank_arg: int | None) -> str:
    # torchrun always sets TORCHELASTIC_RUN_ID; the deepspeed launcher passes --local_rank and
    # sets CROSS_RANK. Anything else with RANK set (hand-exported env://) behaves like torchrun.
    if "TORCHELASTIC_RUN_ID" in env:
        return "torchrun"
    if local_rank_arg is not None or "CROSS_RANK" in env:
        return "deepspeed"
    return "torchrun"


def _read_torch(env: Mapping[str, str], local_rank_arg: int | None) -> tuple[int, int, int, int]:
    if "WORLD_SIZE" not in env:
        raise ValueError(f"RANK={env['RANK']} is set but WORLD_SIZE is not: set both (torchrun and "
                         "deepspeed do), or unset RANK for a single-process run")
    rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    if "LOCAL_RANK" in env:
        local_rank = _int(env, "LOCAL_RANK")
        if local_rank_arg is not None and local_rank_arg != local_rank:
            raise ValueError(f"--local_rank {local_rank_arg} disagrees with LOCAL_RANK={local_rank}"
                             " from the environment; pass one of them")
    elif local_rank_arg is not None:
        local_rank = local_rank_arg
    elif world == 1:
        local_rank = 0
    else:
        raise ValueError(f"RANK={rank} WORLD_SIZE={world} are set but LOCAL_RANK is not (nor "
                         "--local_rank): set LOCAL_RANK, or launch with torchrun/deepspeed")
    # torchrun: LOCAL_WORLD_SIZE; the deepspeed launcher: LOCAL_SIZE. Without either, all ranks
    # are assumed to share this host (true for hand-made single-node env:// runs).
    if "LOCAL_WORLD_SIZE" in env:
        local_world = _int(env, "LOCAL_WORLD_SIZE")
    elif "LOCAL_SIZE" in env:
        local_world = _int(env, "LOCAL_SIZE")
    else:
        local_world = world
    return rank, world, local_rank, local_world


def _read_openmpi(env: Mapping[str, str]) -> tuple[int, int, int, int]:
    missing = [name for name in _OMPI if name not in env]
    if missing:
        raise ValueError(f"Open MPI environment is incomplete (missing {', '.join(missing)}): "
                         "launch with Open MPI's mpirun (version >= 1.3)")
    return tuple(_int(env, name) for name in _OMPI)  # type: ignore[return-value]


def _read_pmi(env: Mapping[str, str]) -> tuple[int, int, int, int]:
    if "PMI_SIZE" not in env:
        raise ValueError("PMI_RANK is set but PMI_SIZE is not: launch with your MPI's "
                         "mpirun/mpiexec")
    rank, world = _int(env, "PMI_RANK"), _int(env, "PMI_SIZE")
    local_rank = _first_int(env, _PMI_LOCAL_RANK)
    local_world = _first_int(env, _PMI_LOCAL_SIZE)
    if local_rank is None or local_world is None:
        if world == 1:
            return rank, world, 0, 1
        raise ValueError(f"PMI_RANK={rank} PMI_SIZE={world} are set but the node-local rank/size "
                         f"are not (looked for {', '.join(_PMI_LOCAL_RANK + _PMI_LOCAL_SIZE)}): "
                         "export LOCAL_RANK/RANK/WORLD_SIZE yourself and drop --use-mpi")
    return rank, world, local_rank, local_world


def _check_agrees_with_torch_vars(env: Mapping[str, str], launcher: str, rank: int,
                                  world: int) -> None:
    # A RANK/WORLD_SIZE inherited from the login shell or the job script would be the same on every
    # process; trusting it over MPI is the "everyone is rank 0" bug, silently ignoring it hides it.
    for name, value in (("RANK", rank), ("WORLD_SIZE", world)):
        if name in env and _int(env, name) != value:
            raise ValueError(f"{name}={env[name]} in the environment disagrees with {launcher} "
                             f"({name.lower().replace('_', ' ')} {value}): unset {name} in the "
                             "job script (mpirun -x must not export it)")


def _check_ranks(rank: int, world: int, local_rank: int, local_world: int, launcher: str) -> None:
    if world < 1:
        raise ValueError(f"world size {world} from {launcher} must be >= 1")
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside world size {world} (from {launcher}): the "
                         "launcher's variables are inconsistent")
    if not 1 <= local_world <= world:
        raise ValueError(f"local world size {local_world} must be between 1 and the world size "
                         f"{world} (from {launcher})")
    if not 0 <= local_rank < local_world:
        raise ValueError(f"local rank {local_rank} is outside local world size {local_world} "
                         f"(from {launcher})")


# --------------------------------------------------------------------------- master address/port

def _master(env: Mapping[str, str], launcher: str, world: int,
            local_world: int) -> tuple[str, int]:
    addr = env.get("MASTER_ADDR") or None
    if addr is None:
        if launcher == "single":
            addr = DEFAULT_MASTER_ADDR  # one process: never dial another host
        else:
            addr = scheduler_first_host(env) or None
    if addr is None:
        if world > local_world:
            # Every node would rendezvous with itself and wait forever: fail now instead.
            raise ValueError(f"world size {world} spans several hosts but MASTER_ADDR is unset "
                             "and no scheduler host list (SGE_JOB_HOSTLIST, PBS_NODEFILE) was "
                             "found: export MASTER_ADDR=<first host> and pass it with "
                             "mpirun -x MASTER_ADDR")
        addr = DEFAULT_MASTER_ADDR
    if env.get("MASTER_PORT"):
        port = _int(env, "MASTER_PORT")
        if not 1 <= port <= 65535:
            raise ValueError(f"MASTER_PORT={port} is not a TCP port (1-65535)")
    else:
        port = job_port(env)
    return addr, port


def scheduler_job_id(env: Mapping[str, str]) -> int | None:
    """The numeric job id: SGE's JOB_ID, or PBS's PBS_JOBID without its `.server` suffix."""
    for name in ("JOB_ID", "PBS_JOBID"):
        match = re.match(r"\s*(\d+)", env.get(name, ""))
        if match:
            return int(match.group(1))
    return None


def job_port(env: Mapping[str, str]) -> int:
    """MASTER_PORT derived from the job id, so jobs sharing a node do not collide."""
    job_id = scheduler_job_id(env)
    return DEFAULT_MASTER_PORT if job_id is None else PORT_BASE + job_id % PORT_SPAN


def scheduler_first_host(env: Mapping[str, str]) -> str | None:
    """First host of the Grid Engine (SGE_JOB_HOSTLIST) or PBS (PBS_NODEFILE) host file.

    Both files list one host per line; PBS repeats a host once per slot, so its first line is
    also its first unique host. A variable naming a missing/empty file is an error: the scheduler
    promised a host list, and guessing 127.0.0.1 would hang a multi-node job.
    """
    for name in ("SGE_JOB_HOSTLIST", "PBS_NODEFILE"):
        path = env.get(name)
        if not path:
            continue
        try:
            with open(path, encoding="utf-8") as handle:
                hosts = [line.split()[0] for line in handle if line.strip()]
        except OSError as exc:
            raise ValueError(f"{name}={path} cannot be read ({exc.strerror})") from None
        if not hosts:
            raise ValueError(f"{name}={path} lists no hosts")
        return hosts[0]
    return None


# --------------------------------------------------------------------------- parsing

def _int(env: Mapping[str, str], name: str) -> int:
    value = env[name]
    try:
        return int(value.strip())
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None


def _first_int(env: Mapping[str, str], names: tuple[str, ...]) -> int | None:
    for name in names:
        if name in env:
            return _int(env, name)
    return None
