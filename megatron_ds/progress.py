"""Progress with an ETA for long stages (preprocessing, index building, conversion, evaluation).

On a terminal this is a tqdm bar. Redirected to a file (a batch job's log) a bar would write a
carriage-return update many times a second; instead one plain line is printed every
``log_interval`` seconds (and at the end) with the count, rate and ETA, e.g.

    evaluate: 1200/5000 tokens (24%) | 310.2 tokens/s | elapsed 0:00:04 | ETA 0:00:12

Usage::

    with progress(total=n, desc="preprocess", unit="docs") as bar:
        for ...:
            bar.update(k)

``enabled=False`` (e.g. on ranks other than 0) makes it a no-op. ``print_rank0`` prints a line
once per job, from any floor.
"""
from __future__ import annotations

import sys
import time
from datetime import timedelta

DEFAULT_LOG_INTERVAL_S = 30.0


def print_rank0(*args, **kwargs) -> None:
    """Print once per job: on rank 0, or in a process that joined no process group."""
    import torch.distributed as dist  # noqa: PLC0415 - the preprocessing tools show progress without torch

    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)


def _clock(seconds: float) -> str:
    return str(timedelta(seconds=int(max(seconds, 0))))


class LineProgress:
    """The log-friendly form: one line per interval, no carriage returns."""

    def __init__(self, total: int | None, desc: str, unit: str, log_interval: float, stream):
        self.total, self.desc, self.unit = total, desc, unit
        self.log_interval = log_interval
        self.stream = stream
        self.n = 0
        self.start = self._last = time.monotonic()

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self._last >= self.log_interval:
            self._last = now
            self._print(now)

    def set_postfix_str(self, *args, **kwargs) -> None:
        """tqdm's method; the lines carry no postfix."""

    def line(self, now: float | None = None) -> str:
        elapsed = (now or time.monotonic()) - self.start
        rate = self.n / elapsed if elapsed > 0 else 0.0
        count = f"{self.n}/{self.total}" if self.total else f"{self.n}"
        pct = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        eta = ""
        if self.total and rate > 0:
            eta = f" | ETA {_clock((self.total - self.n) / rate)}"
        return (f"{self.desc}: {count} {self.unit}{pct} | {rate:.1f} {self.unit}/s | "
                f"elapsed {_clock(elapsed)}{eta}")

    def _print(self, now: float) -> None:
        print(self.line(now), file=self.stream, flush=True)

    def close(self) -> None:
        self._print(time.monotonic())

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


class _NoProgress:
    n = 0

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_postfix_str(self, *args, **kwargs) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def progress(total: int | None = None, desc: str = "", unit: str = "it", *, enabled: bool = True,
             stream=None, log_interval: float = DEFAULT_LOG_INTERVAL_S, force_lines: bool = False, **tqdm_kwargs):
    """A tqdm bar when ``stream`` (default stderr) is a terminal, else a ``LineProgress``.
    ``tqdm_kwargs`` (e.g. ``unit_scale=True``) only apply to the bar."""
    if not enabled:
        return _NoProgress()
    stream = stream or sys.stderr
    if not force_lines and getattr(stream, "isatty", lambda: False)():
        from tqdm import tqdm  # noqa: PLC0415 - only needed on terminals

        return tqdm(total=total, desc=desc, unit=unit, file=stream, dynamic_ncols=True, **tqdm_kwargs)
    return LineProgress(total, desc, unit, log_interval, stream)


def track(items, total: int | None, desc: str, unit: str = "it", **kwargs):
    """Iterate over ``items`` showing ``progress`` (one update per item)."""
    with progress(total=total, desc=desc, unit=unit, **kwargs) as bar:
        for item in items:
            yield item
            bar.update(1)
