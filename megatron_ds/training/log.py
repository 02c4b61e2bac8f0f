"""Megatron's log lines (existing log parsers keep working) and optional TensorBoard scalars."""
from __future__ import annotations

import datetime
import logging
import math
import os
import resource
import sys

import torch

from megatron_ds.errors import ConfigError

# Megatron-LM's environment variable for the default of --logging-level (megatron/training/initialize.py)
LOGGING_LEVEL_ENV = "MEGATRON_LOGGING_LEVEL"


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
                   reported: dict | None = None, throughput_tflops: float | None = None) -> str:
    """``reported``: the loss function's other named scalars (``model/loss_report.py``), printed after
    ``lm loss`` as ``| name: value |`` (None values left out). ``throughput_tflops`` (--log-throughput):
    Megatron-LM's field, in its place after the time per iteration (megatron/training/training.py
    training_log); Megatron-DeepSpeed's lines, and so the parsers of them, never have it."""
    parts = [
        f" iteration {iteration:8d}/{train_iters:8d}",
        f" consumed samples: {consumed_samples:12d}",
    ]
    if consumed_tokens is not None:  # token-based runs: Megatron-DeepSpeed's field, in its place
        parts.append(f" consumed tokens: {consumed_tokens:12d}")
    parts += [
        f" elapsed time per iteration (ms): {elapsed_ms:.1f}",
    ]
    if throughput_tflops is not None:
        parts.append(f" throughput per GPU (TFLOP/s/GPU): {throughput_tflops:.1f}")
    parts += [
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


class _ConsoleHandler(logging.Handler):
    """megatron_ds's log records as Megatron-LM prints its own (``logging.basicConfig``'s format in
    megatron/training/training.py): INFO and below to stdout, warnings and errors to stderr, each
    stream looked up when the record comes (a caller may have redirected it since)."""

    def __init__(self):
        super().__init__()
        self.setFormatter(logging.Formatter(logging.BASIC_FORMAT))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:  # noqa: BLE001 - logging's own rule: a failing handler reports, never raises
            self.handleError(record)


def configure_logging(level: int | None, environ=os.environ) -> int:
    """--logging-level: Megatron-LM's setup_logging (megatron/training/initialize.py) sets the root logger's
    level from the flag, else from MEGATRON_LOGGING_LEVEL, and prints INFO records by default. Here the same
    level goes to the root logger (third-party loggers without a level of their own follow it) and to
    megatron_ds's loggers, whose records get a console handler (added once). Returns the level in force."""
    if level is None and environ.get(LOGGING_LEVEL_ENV):
        try:
            level = int(environ[LOGGING_LEVEL_ENV])
        except ValueError:
            raise ConfigError(f"{LOGGING_LEVEL_ENV}={environ[LOGGING_LEVEL_ENV]!r} is not an integer logging "
                             f"level (10 DEBUG, 20 INFO, 30 WARNING, 40 ERROR)") from None
    ours = logging.getLogger("megatron_ds")
    if not any(isinstance(h, _ConsoleHandler) for h in ours.handlers):
        ours.addHandler(_ConsoleHandler())
    if level is not None:
        logging.getLogger().setLevel(level)
    ours.setLevel(logging.INFO if level is None else level)
    return ours.level


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
