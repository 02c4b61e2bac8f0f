"""A hung collective as one line: which operation, at which iteration, which ranks never came.

gloo raises on every waiting rank once --distributed-timeout-minutes have passed, naming only the
transport operation ("recv"), not the peer. To name the missing ranks, each rank that sees its
collective fail writes a note into the rendezvous key-value store (the TCPStore at
MASTER_ADDR:MASTER_PORT that every launcher provides); a rank blocked elsewhere -- the hung one --
writes none. After a short grace period for the others' notes, the ranks without a note are the
missing ones. NCCL's own watchdog reports its timeouts (it names the operation and sequence
number) and ends the process, so this covers the gloo/CPU paths.
"""
from __future__ import annotations

import os
import re
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_ds.ds_compat import cpp_warnings_quiet

_PREFIX = "megatron_ds/collective_failed/"


def apply_timeout_to_new_groups(timeout: timedelta, log=print) -> None:
    """Give process groups made later by new_group() without a timeout -- DeepSpeed's pipeline and
    data parallel groups, where a hung rank is first waited for -- the run's timeout instead of
    torch's default (30 min for gloo). Megatron passes its timeout to every new_group; DeepSpeed
    does not, so torch's default is changed: a module global that torch reads at each new_group
    (``ds_compat.set_default_group_timeout``), checked there so a torch without it only loses
    this, with a note."""
    from megatron_ds.ds_compat import set_default_group_timeout  # noqa: PLC0415

    if not set_default_group_timeout(timeout):
        log(f"NOTE: torch {torch.__version__} has no default process-group timeout to set: groups made by "
            f"DeepSpeed keep torch's own timeout")


def is_collective_failure(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(
        s in text for s in ("timed out", "timeout", "connection closed by peer", "connection reset by peer",
                            "gloo", "nccl", "monitoredbarrier"))


class CollectiveWatch:
    """Made at start-up on every rank (needs MASTER_ADDR/MASTER_PORT, as env:// rendezvous does)."""

    def __init__(self, timeout_minutes: float):
        self.timeout_minutes = timeout_minutes
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.store = None
        if self.world > 1:
            try:
                self.store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                           is_master=False, timeout=timedelta(seconds=30))
            except (KeyError, ValueError, RuntimeError):
                self.store = None  # reports then say less, nothing else changes

    def _missing(self, grace_s: float) -> list[int] | None:
        if self.store is None:
            return None
        # The store's host may be gone too (its launcher killed, with the ranks of its node): the store
        # calls then fail, as handled below, and torch would print each failure as a C++ warning with a
        # 20-frame stack besides.
        try:
            with cpp_warnings_quiet():
                self.store.set(f"{_PREFIX}{self.rank}", "1")
                deadline = time.time() + grace_s
                while True:
                    noted = [r for r in range(self.world) if self.store.check([f"{_PREFIX}{r}"])]
                    if len(noted) == self.world or time.time() > deadline:
                        return [r for r in range(self.world) if r not in noted]
                    time.sleep(0.5)
        except RuntimeError:  # the store's host is gone
            return None

    def describe(self, exc: BaseException, where: str) -> str:
        """The one line for a failed collective (waits up to a grace period for the other ranks:
        theirs time out within the skew between ranks of the moment they started waiting)."""
        grace = min(10.0, max(3.0, self.timeout_minutes * 60.0 / 4))
        missing = self._missing(grace)
        text = str(exc)
        kind = re.search(r"for (\w+) operation", text)
        what = f"{where} (gloo {kind.group(1)})" if kind else where
        if "timed out" in text.lower() or "timeout" in text.lower():
            head = f"a collective in {what} timed out after --distributed-timeout-minutes {self.timeout_minutes:g}"
        else:
            head = f"a collective in {what} failed ({text.strip().splitlines()[0][:160]})"
        if missing:
            tail = f"; rank(s) {', '.join(map(str, missing))} never arrived: look at their logs (hung or dead)"
        elif missing == []:
            tail = "; every rank reported the failure (a network problem?)"
        else:
            tail = "; the missing rank(s) could not be determined"
        return head + tail
