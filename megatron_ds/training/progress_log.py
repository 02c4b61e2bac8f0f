"""--log-progress: Megatron-LM's progress log, ``progress.txt`` in the --save directory.

Transcribed from Megatron-LM (core_v0.19.0): megatron/training/utils/log_utils.py append_to_progress_log
(the line's prefix), megatron/training/training.py get_start_time_from_progress_log (where the cumulative
throughput starts) and compute_throughputs_and_append_to_progress_log (the line after a save). One line
per event, tab-separated, e.g.

    2026-11-28 16:20:01	Job ID: 12345.pbs1	# GPUs: 16	Starting job
    2026-11-28 17:02:44	Job ID: 12345.pbs1	# GPUs: 16	Saved checkpoint	Iteration: 1000	Job throughput: 171.3 TFLOP/s/GPU	Cumulative throughput: 171.3 TFLOP/s/GPU	Floating-point operations: 3.52e+18	Tokens (in billions): 4.19

The job id is the batch job's (Slurm's SLURM_JOB_ID, as upstream, or PBS's / Grid Engine's, which
upstream leaves empty). FLOPs are the model FLOPs of the iteration line's TFLOP/s, summed over the
iterations trained so far across jobs (checkpoints carry the sum, as upstream's
``num_floating_point_operations_so_far``); tokens are the consumed training tokens.
"""
from __future__ import annotations

import os
import time
from datetime import datetime
from typing import Iterable

import torch.distributed as dist

from megatron_ds.launch.scheduler import current_job

PROGRESS_FILE = "progress.txt"
_TIME_FORMAT = "%Y-%m-%d %H:%M:%S"


def progress_line(text: str, world_size: int, now: datetime, environ=os.environ) -> str:
    """One line of progress.txt: time, job id, GPUs, then ``text``."""
    job_id = current_job(environ)[1] or ""
    return f"{now.strftime(_TIME_FORMAT)}\tJob ID: {job_id}\t# GPUs: {world_size}\t{text}\n"


def start_of_world(lines: Iterable[str], world_size: int) -> tuple[datetime, float] | None:
    """(start time, FLOPs done then) of the first job of the latest unbroken series of jobs at
    ``world_size`` GPUs (a job at another size starts the series again), or None without one; the FLOPs
    are those of the last checkpoint saved before that job (get_start_time_from_progress_log)."""
    start = None
    latest_flops, uncommitted = 0.0, None
    for line in lines:
        tokens = line.strip().split("\t")
        if len(tokens) < 4:
            continue
        world_in_line = int(tokens[2].split(": ")[1])
        event = tokens[3]
        if event == "Saved checkpoint":
            latest_flops = float(tokens[7].split(": ")[1])
        elif event == "Saving async checkpoint":  # committed once "Saved async checkpoint" follows
            uncommitted = float(tokens[7].split(": ")[1])
        elif event == "Saved async checkpoint" and uncommitted is not None:
            latest_flops, uncommitted = uncommitted, None
        if world_in_line != world_size:
            start = None
            continue
        if event == "Starting job" and start is None:
            start = (datetime.strptime(tokens[0], _TIME_FORMAT), latest_flops)
    return start


def saved_text(iteration: int, job_tflops: float, cumulative_tflops: float, flops_so_far: float,
               tokens_so_far: int) -> str:
    """The event of a line written after a checkpoint is saved."""
    return (f"Saved checkpoint\tIteration: {iteration}\t"
            f"Job throughput: {job_tflops:.1f} TFLOP/s/GPU\t"
            f"Cumulative throughput: {cumulative_tflops:.1f} TFLOP/s/GPU\t"
            f"Floating-point operations: {flops_so_far:.2e}\t"
            f"Tokens (in billions): {tokens_so_far / 10 ** 9:.2f}")


class ProgressLog:
    """progress.txt of one job: every rank calls ``start_job`` and ``saved`` (a barrier, as upstream's
    append_to_progress_log), rank 0 writes."""

    def __init__(self, save_dir: str, world_size: int, job_start_time: float):
        self.path = os.path.join(save_dir, PROGRESS_FILE)
        self.world_size = world_size
        self.job_start_time = job_start_time  # time.time() when the job started (upstream's _TRAIN_START_TIME)
        self.job_start_flops = 0.0  # FLOPs done before this job: the loaded checkpoint's

    def _append(self, text: str) -> None:
        if dist.is_initialized():
            dist.barrier()
        if not dist.is_initialized() or dist.get_rank() == 0:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            with open(self.path, "a+") as f:
                f.write(progress_line(text, self.world_size, datetime.now()))

    def start_job(self) -> None:
        """Once the ranks have joined, before the model is built (upstream: after initialize_megatron);
        the trainer sets ``job_start_flops`` once the checkpoint is loaded."""
        self._append("Starting job")

    def saved(self, iteration: int, flops_so_far: float, tokens_so_far: int) -> None:
        """After checkpoint ``iteration`` is saved: this job's throughput, and the throughput since the
        first job of this world size, in model TFLOP/s per GPU."""
        job = (flops_so_far - self.job_start_flops) / ((time.time() - self.job_start_time) * 1e12 * self.world_size)
        start = None
        if not dist.is_initialized() or dist.get_rank() == 0:
            with open(self.path) as f:
                start = start_of_world(f, self.world_size)
        # the file holds this job's "Starting job" line; without it (edited meanwhile) this job is the series
        start_time, start_flops = start or (datetime.fromtimestamp(self.job_start_time), self.job_start_flops)
        elapsed = max((datetime.now() - start_time).total_seconds(), 1e-9)
        cumulative = (flops_so_far - start_flops) / (elapsed * 1e12 * self.world_size)
        self._append(saved_text(iteration, job, cumulative, flops_so_far, tokens_so_far))
