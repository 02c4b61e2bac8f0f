"""Launcher and rank discovery: torchrun, deepspeed, Open MPI, PMI; SGE and PBS host lists; the batch
job (``scheduler``), the launcher's life (``parent_watch``); torchrun ending on a signal in one line
(``torchrun``, run as ``python -m megatron_ds.launch.torchrun``)."""
from megatron_ds.launch.env import (
    DistEnv,
    apply_dist_env,
    discover_dist_env,
    job_port,
    scheduler_first_host,
    scheduler_job_id,
)

__all__ = [
    "DistEnv",
    "apply_dist_env",
    "discover_dist_env",
    "job_port",
    "scheduler_first_host",
    "scheduler_job_id",
]
