"""Which batch job this process belongs to, and whether another job is still running.

Used by the --save lock (``megatron_ds.checkpoint.lock``): a job killed with SIGKILL leaves its lock
behind with a fresh heartbeat, and the follow-on job (``qsub -W depend=afterany:...``, ``-hold_jid``,
a requeue) asks the scheduler whether the holder's job still runs instead of waiting five minutes.

The answers are read from the schedulers' own messages for a job that is gone:
  * PBS Professional: ``qstat -f ID`` exits non-zero with "qstat: ID Job has finished, use -x or -H
    to obtain historical job information" or "qstat: Unknown Job Id ID";
  * Grid Engine: ``qstat -j ID`` prints "Following jobs do not exist" (msg_qstat.h,
    MSG_QSTAT_FOLLOWINGDONOTEXIST);
  * Slurm: ``squeue -h -j ID -o %T`` prints nothing, or "Invalid job id specified" once purged.
Anything else (no command, a time-out, an unexpected answer) is "unknown": the caller then decides
by the heartbeat alone.
"""
from __future__ import annotations

import os
import subprocess
from typing import Mapping

# environment variable -> scheduler, in the order they are looked up
_JOB_VARS = (("PBS_JOBID", "pbs"), ("JOB_ID", "sge"), ("SLURM_JOB_ID", "slurm"), ("LSB_JOBID", "lsf"))
QUERY_TIMEOUT_S = 20.0

RUNNING, ENDED = "running", "ended"


def current_job(environ: Mapping[str, str] | None = None) -> tuple[str | None, str | None]:
    """(scheduler, job id) of this process's batch job, (None, None) outside one."""
    env = os.environ if environ is None else environ
    for var, scheduler in _JOB_VARS:
        if env.get(var):
            return scheduler, env[var]
    return None, None


def _pbs(rc: int, text: str) -> str | None:
    if rc == 0 and "job_state = F" not in text:
        return RUNNING  # queued, running, held or exiting (E): not over yet
    if "Job has finished" in text or "Unknown Job Id" in text or "job_state = F" in text:
        return ENDED
    return None


def _sge(rc: int, text: str) -> str | None:
    if "Following jobs do not exist" in text:
        return ENDED
    return RUNNING if rc == 0 else None


def _slurm(rc: int, text: str) -> str | None:
    if "Invalid job id" in text or (rc == 0 and not text.strip()):
        return ENDED
    return RUNNING if rc == 0 else None


_QUERIES = {"pbs": (("qstat", "-f"), _pbs), "sge": (("qstat", "-j"), _sge),
            "slurm": (("squeue", "-h", "-o", "%T", "-j"), _slurm)}


def job_state(scheduler: str | None, job_id: str | None) -> str | None:
    """RUNNING, ENDED, or None when the scheduler cannot be asked or gives no clear answer."""
    if scheduler not in _QUERIES or not job_id:
        return None
    command, read = _QUERIES[scheduler]
    try:
        proc = subprocess.run([*command, str(job_id)], capture_output=True, text=True, timeout=QUERY_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return read(proc.returncode, proc.stdout + proc.stderr)
