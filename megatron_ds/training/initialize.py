"""Joining the job: which rank this process is (from whichever launcher started it), and the
default process group with the run's timeout applied to every group made afterwards."""
from __future__ import annotations

from datetime import timedelta

import torch

from megatron_ds.ds_compat import skip_shm_comm_op
from megatron_ds.errors import ConfigError
from megatron_ds.launch import apply_dist_env, discover_dist_env
from megatron_ds.progress import print_rank0
from megatron_ds.training.collective_timeout import apply_timeout_to_new_groups
from megatron_ds.training.startup_checks import explain_init_error


def discover_world(*, use_mpi: bool, local_rank: int | None):
    """Rank/world from whichever launcher started us (``--use-mpi``: Open MPI's variables; ``--local_rank``:
    the deepspeed launcher's), exported for deepspeed/torch env:// init."""
    try:
        env = discover_dist_env(use_mpi=use_mpi, local_rank_arg=local_rank)
    except ValueError as exc:  # inconsistent launcher variables: the message says which
        raise ConfigError(str(exc)) from None
    apply_dist_env(env)
    return env


def init_distributed(distributed, device: torch.device) -> None:
    """The default process group; ``distributed``: the run's ``DistributedSettings``."""
    import deepspeed  # noqa: PLC0415 - heavy; keep --dry-run and --help fast

    backend = distributed.distributed_backend or ("nccl" if device.type == "cuda" else "gloo")
    timeout = timedelta(minutes=distributed.distributed_timeout_minutes)
    apply_timeout_to_new_groups(timeout, log=print_rank0)
    if device.type == "cpu":
        skip_shm_comm_op()  # DeepSpeed's inference-only CPU collective: not compiled for a run that never uses it
    try:
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False, timeout=timeout)
    except Exception as exc:  # a port clash becomes one line; anything else stays as it is
        clash = explain_init_error(exc)
        if clash is None:
            raise
        raise clash from None
