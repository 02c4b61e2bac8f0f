"""Megatron's log lines (existing log parsers keep working) and optional TensorBoard scalars."""
from __future__ import annotations

import datetime
import math
import resource
import sys

import torch


def print_last_rank(*args) -> None:
    """Losses live on the last pipeline stage; Megatron prints the iteration line from there."""
    if not torch.distributed.is_initialized() or \
            torch.distributed.get_rank() == torch.distributed.get_world_size() - 1:
        print(*args, flush=True)


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 30
    # CPU: peak resident set size of this process (Linux reports KiB)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


def iteration_line(*, iteration: int, train_iters: int, consumed_samples: int, elapsed_ms: float, lr: float,
                   global_batch_size: int, loss: float | None, loss_scale: float, grad_norm: float | None,
                   skipped: int, nans: int, samples_per_s: float, tokens_per_s_per_gpu: float,
                   tflops_per_gpu: float, mem_gb: float, consumed_tokens: int | None = None,
                   eta_s: float | None = None, curriculum_seqlen: int | None = None,
                   reported: dict | None = None) -> str:
    """``reported``: the loss function's other named scalars (``model/loss_report.py``), printed after
    ``lm loss`` as ``| name: value |`` (None values left out)."""
    parts = [
        f" iteration {iteration:8d}/{train_iters:8d}",
        f" consumed samples: {consumed_samples:12d}",
    ]
    if consumed_tokens is not None:  # token-based runs: Megatron-DeepSpeed's field, in its place
        parts.append(f" consumed tokens: {consumed_tokens:12d}")
    parts += [
        f" elapsed time per iteration (ms): {elapsed_ms:.1f}",
        f" learning rate: {lr:.3E}",
        f" global batch size: {global_batch_size:5d}",
    ]
    if loss is not None:
        parts.append(f" lm loss: {loss:.6E}")
    parts += [f" {name}: {value:.6E}" for name, value in (reported or {}).items() if value is not None]
    parts.append(f" loss scale: {loss_scale:.1f}")
    if grad_norm is not None:
        parts.append(f" grad norm: {grad_norm:.3f}")
    if curriculum_seqlen is not None:  # Megatron-DeepSpeed's field of a sequence-length warm-up, in its place
        parts.append(f" curriculum seqlen: {curriculum_seqlen:5d}")
    parts += [
        f" number of skipped iterations: {skipped:3d}",
        f" number of nan iterations: {nans:3d}",
        f" samples per second: {samples_per_s:.3f}",
        f" tokens per second per GPU: {tokens_per_s_per_gpu:.1f}",
        f" TFLOP/s per GPU: {tflops_per_gpu:.2f}",
        f" peak memory (GB): {mem_gb:.2f}",
    ]
    if eta_s is not None:  # after Megatron's fields, so their parsers are unaffected
        parts.append(f" ETA: {datetime.timedelta(seconds=int(eta_s))}")
    return "".join(p + " |" for p in parts)


def validation_lines(label: str, loss: float, reported: dict | None = None) -> str:
    """Megatron's validation line; ``reported`` (as for ``iteration_line``) follow as ``| name value: X |``."""
    ppl = math.exp(min(20.0, loss))
    body = f" validation loss at {label} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} | "
    body += "".join(f"{name} value: {value:.6E} | " for name, value in (reported or {}).items() if value is not None)
    bar = "-" * len(body)
    return f"{bar}\n{body}\n{bar}"


class TensorBoard:
    """A SummaryWriter on the last rank (where losses are), or nothing."""

    def __init__(self, log_dir: str | None, enabled_rank: bool):
        self.writer = None
        if log_dir and enabled_rank:
            try:
                from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415 - optional dependency
            except ImportError:
                print("WARNING: --tensorboard-dir given but tensorboard is not installed "
                      "(pip install tensorboard); not writing scalars", file=sys.stderr)
                return
            self.writer = SummaryWriter(log_dir=log_dir, max_queue=1000)

    def scalars(self, step: int, values: dict) -> None:
        if self.writer is None:
            return
        for key, value in values.items():
            if value is not None and math.isfinite(value):
                self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
