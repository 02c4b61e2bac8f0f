"""Progress for long conversions: a tqdm bar on a terminal, a few plain lines in batch logs
(a bar's carriage returns make an unreadable job log)."""
from __future__ import annotations

import sys
from typing import Callable, Iterable, Iterator


def progress(items: Iterable, total: int, desc: str, log: Callable = print) -> Iterator:
    if sys.stderr.isatty():
        from tqdm import tqdm  # noqa: PLC0415

        yield from tqdm(items, total=total, desc=desc, unit="layer")
        return
    step = max(1, total // 10)
    for n, item in enumerate(items, 1):
        yield item
        if n % step == 0 or n == total:
            log(f"{desc}: {n}/{total} layers")
