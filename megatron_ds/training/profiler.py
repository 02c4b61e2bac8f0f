"""--profile pt|pt-full: torch profiler traces of chosen steps on chosen ranks, for TensorBoard.

Megatron-DeepSpeed's megatron/profiler.py (commit 4efb479): steps are counted from this process's first
training step (1-based, not the iteration number, which differs after a resume); ``--profile_steps A,B``
records steps A..B inclusive in one trace; ``--profile-ranks`` names the global ranks that record (all by
default); ``pt-full`` adds Python stacks. The trace goes to --tensorboard-dir through
``torch.profiler.tensorboard_trace_handler`` (gzipped ``*.pt.trace.json.gz``, read by TensorBoard's
profiler plugin and by chrome://tracing).

``--profile`` given alone is Megatron-LM's switch (megatron/training/training.py, core_v0.19.0): the steps
taken at iterations ``--profile-step-start`` to ``--profile-step-end`` - 1 (default 10..11, i.e. steps
11 and 12 of a fresh run), counted here from this process's first step as above.
"""
from __future__ import annotations

import torch


class StepProfiler:
    """Called around every training step: ``begin()`` before it, ``end()`` after it."""

    def __init__(self, kind: str, steps: tuple[int, int], trace_dir: str, device_type: str):
        self.first, self.last = steps
        self.step = 0
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device_type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(
            schedule=torch.profiler.schedule(wait=0, warmup=0, active=self.last - self.first + 1, repeat=1),
            activities=activities, with_stack=kind == "pt-full",
            on_trace_ready=torch.profiler.tensorboard_trace_handler(trace_dir, use_gzip=True))

    def begin(self) -> None:
        self.step += 1
        if self.step == self.first:
            self.profiler.start()

    def end(self) -> None:
        if self.first <= self.step <= self.last:
            self.profiler.step()
        if self.step == self.last:
            self.profiler.stop()


def step_profiler(logging, rank: int, device_type: str) -> StepProfiler | None:
    """The run's profiler on this rank (``logging``: the run's LoggingConfig), or None."""
    ranks = logging.profile_ranks
    if logging.profile is None or (ranks is not None and rank not in {int(r) for r in ranks}):
        return None
    if logging.profile == "window":  # Megatron-LM's --profile: the steps after iterations [start, end)
        first, last, kind = logging.profile_step_start + 1, logging.profile_step_end, "pt"
    else:
        (first, last), kind = (int(v) for v in logging.profile_steps.split(",")), logging.profile
    return StepProfiler(kind, (first, last), logging.tensorboard_dir, device_type)
