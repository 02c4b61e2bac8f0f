"""Named scalars a model's loss function reports next to the loss it returns for backward.

A loss function returns one tensor, the one backward runs on; what else it knows (the parts of a
sum of losses, a statistic of the routing) goes to a ``LossReport`` the engine builder gave it:
``report.add("name", tensor)`` per micro-batch, detached. The training loop averages each name
over every ``add`` on every rank since its last line (``reduce``) and prints it on the iteration
and validation lines, after ``lm loss`` (``megatron_ds.training.log``).

The names are declared when the report is built, the same on every rank, so every rank joins the
same reduction -- also the ranks that add nothing (pipeline stages without the loss): the sums and
the counts of all names go in one all-reduce, and a name nobody added reads None. A report with no
names costs nothing (no collective). Training and evaluation accumulate apart (``phase``), so a
validation pass between two iteration lines leaves the training average alone.

A declared ``"lm loss"`` is what the lines print as ``lm loss`` (when the returned loss is more than
the language-model loss: Megatron-DeepSpeed's ``pretrain_gpt.py`` loss_func logs the language-model
loss under that name and the other terms under their own).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

TRAIN, EVAL = "train", "eval"


class LossReport:
    def __init__(self, names=(), token_scale=None):
        """``token_scale``: the run's ``model.token_loss.GlobalTokenScale`` (--calculate-per-token-loss),
        which the language-model loss applies and the training loop sets per step; None: none."""
        self.names = tuple(names)
        self.token_scale = token_scale
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"duplicate names in {self.names}")
        self._index = {name: i for i, name in enumerate(self.names)}
        self._phase = TRAIN
        # phase -> [sums..., counts...] (float64: sums over thousands of micro-batches stay exact enough)
        self._acc: dict[str, torch.Tensor] = {}

    def __bool__(self) -> bool:
        return bool(self.names)

    def add(self, name: str, value: torch.Tensor | float) -> None:
        """Count ``value`` (a scalar; detached here) once for ``name`` in the current phase."""
        if name not in self._index:
            raise KeyError(f"{name!r} is not a declared name of this report {self.names}")
        value = value.detach().reshape(()) if isinstance(value, torch.Tensor) else torch.tensor(float(value))
        acc = self._acc.get(self._phase)
        if acc is None:
            acc = self._acc[self._phase] = torch.zeros(2 * len(self.names), dtype=torch.float64, device=value.device)
        i = self._index[name]
        acc[i] += value.to(acc.device, torch.float64)
        acc[len(self.names) + i] += 1

    @contextlib.contextmanager
    def phase(self, phase: str):
        """Accumulate into ``phase`` (``TRAIN`` or ``EVAL``) inside the block."""
        previous, self._phase = self._phase, phase
        try:
            yield self
        finally:
            self._phase = previous

    def reduce(self, device: torch.device, group=None, phase: str = TRAIN) -> dict[str, float | None]:
        """Collective over ``group`` (default: every rank; each must call it): the mean of each name
        over every ``add`` of ``phase`` on every rank since the last ``reduce`` of that phase, or None
        where none was made. Resets that phase."""
        if not self.names:
            return {}
        acc = self._acc.pop(phase, None)
        acc = torch.zeros(2 * len(self.names), dtype=torch.float64, device=device) if acc is None else acc.to(device)
        if dist.is_initialized():
            dist.all_reduce(acc, group=group)
        n = len(self.names)
        return {name: (float(acc[i] / acc[n + i]) if acc[n + i] > 0 else None) for i, name in enumerate(self.names)}
