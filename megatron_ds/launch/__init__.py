"""Launcher and rank discovery: torchrun, deepspeed, Open MPI, PMI; SGE and PBS host lists; the batch
job (``scheduler``) and the launcher's life (``parent_watch``)."""
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
