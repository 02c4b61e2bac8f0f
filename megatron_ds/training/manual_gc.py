"""--manual-gc: Python's garbage collection at the same points on every rank, as Megatron-LM does it
(megatron/training/training.py, core_v0.19.0: train() disables the collector and collects once before
the first iteration; post_training_step_callbacks collects every --manual-gc-interval iterations; the
evaluation in the training loop is preceded by a full collection and followed by a young-generation
one unless --no-manual-gc-eval). An automatic collection starts on whichever rank crosses its
allocation threshold first, and the others wait for it at the next collective; by hand, all ranks
collect together.

Upstream leaves the collector off until the process ends; ``restore`` turns it back to how it was
once training (and its final evaluation) is over, which a process that exits sees no difference in
and one that calls ``main()`` again (tests, fine-tuning tasks) needs.
"""
from __future__ import annotations

import gc


class ManualGC:
    """The collection points of a run; every method does nothing without --manual-gc."""

    def __init__(self, enabled: bool, interval: int, around_eval: bool):
        self.enabled, self.interval, self.around_eval = enabled, interval, around_eval
        self._was_enabled: bool | None = None  # the collector's state before ``start``

    def start(self) -> None:
        """Before the first training iteration: automatic collection off, one full collection."""
        if not self.enabled:
            return
        if self._was_enabled is None:
            self._was_enabled = gc.isenabled()
        gc.disable()
        gc.collect()

    def after_step(self, iteration: int) -> None:
        """After training iteration ``iteration`` (counted from 1, across resumes)."""
        if self.enabled and self.interval != 0 and iteration % self.interval == 0:
            gc.collect()

    def before_eval(self) -> None:
        """Before a validation inside the training loop: collect all objects."""
        if self.enabled and self.around_eval:
            gc.collect()

    def after_eval(self) -> None:
        """After it: only the objects created and dropped by the evaluation (generation 0)."""
        if self.enabled and self.around_eval:
            gc.collect(generation=0)

    def restore(self) -> None:
        """Training is over: the collector as it was before ``start``."""
        if self._was_enabled:
            gc.enable()
        self._was_enabled = None
