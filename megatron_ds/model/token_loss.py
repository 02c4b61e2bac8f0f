"""--calculate-per-token-loss: the language-model loss normalised by the loss tokens of the whole
global batch, as Megatron-LM does (megatron/core/pipeline_parallel/schedules.py
``forward_step_calc_loss`` leaves each micro-batch's summed token loss undivided; its
``finalize_model_grads`` sums the gradients over the data parallel ranks and divides them by the
loss tokens of every micro-batch on every data parallel rank; megatron/training/training.py
``train_step`` reports sum(losses) / sum(tokens) over the same set).

DeepSpeed's engine instead averages what each micro-batch's loss returns: it divides the gradient by
the micro-batches of a step (``engine.backward``) and by the data parallel size (its gradient
all-reduce), and the loop reports the mean over both. So each micro-batch's loss here is its summed
token loss times ``factor = DP x micro-batches / tokens of the global batch``: the engine's
averaging then leaves exactly sum(token losses) / tokens, in the gradients (before clipping, as
Megatron's scaling comes before its clipping) and in the reported loss alike.

The training loop knows the global batch before its step (it counts the loss masks of the step's
micro-batches and all-reduces the count over the data parallel ranks, one scalar per step) and
sets the factor for that step (``GlobalTokenScale.scaled``); outside such a block the loss is the
plain mean of the micro-batch.
"""
from __future__ import annotations

import contextlib

import torch


class GlobalTokenScale:
    """The factor of the step being computed (see the module docstring); None outside one."""

    def __init__(self):
        self.factor: float | None = None

    @contextlib.contextmanager
    def scaled(self, divisor: float, global_tokens: float):
        """Within the block, losses are micro-batch token sums x ``divisor / global_tokens`` (a global
        batch without loss tokens: x 0, as Megatron's clamp of the count to 1 gives a zero loss)."""
        self.factor = divisor / max(global_tokens, 1.0)
        try:
            yield self
        finally:
            self.factor = None

    def apply(self, mean_loss: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
        """The micro-batch's loss from its mean over ``loss_mask`` (the whole sequence's mask)."""
        if self.factor is None:
            return mean_loss
        return mean_loss * loss_mask.float().sum().clamp(min=1.0) * self.factor
