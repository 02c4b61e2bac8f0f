"""Token-based training and batch-size ramp-up in the training loop.

``TrainPlan`` tells the loop whether to go on (iterations and the ``--train-tokens`` target), sets the
DeepSpeed engine's global batch before each step (ramp-up, as Megatron-DeepSpeed's train loop calls
``model[0].set_train_batch_size``) and counts consumed samples and tokens.

``ConsumedLRSchedule`` is Megatron-DeepSpeed's OptimizerParamScheduler (megatron/optimizer_param_scheduler.py)
for runs whose schedule cannot be counted in iterations: steps are counted in samples (each applied
optimizer step adds that step's global batch, as Megatron passes ``increment = micro-batches x micro x
DP``) and ``--lr-warmup-tokens`` / ``--lr-decay-tokens`` follow consumed tokens. As there, the tokens
seen by a step are those consumed *before* it (Megatron-DeepSpeed updates ``args.consumed_train_tokens``
after ``train_step``, inside which the scheduler steps).
"""
from __future__ import annotations

import math

from megatron_ds.config import Config, Layout
from megatron_ds.training.lr_schedule import LRSchedule


class ConsumedLRSchedule(LRSchedule):
    """LR as a function of consumed samples and tokens; see the module docstring."""

    SHAPE = LRSchedule.SHAPE + ("warmup_tokens", "decay_tokens")

    def __init__(self, optimizer, *, warmup_tokens: int | None, decay_tokens: int | None, **kwargs):
        self.warmup_tokens, self.decay_tokens = warmup_tokens, decay_tokens
        self.num_tokens = 0
        # Megatron-DeepSpeed's "step/sample-wise warmup + token-wise decay": decay starts from the tokens
        # consumed when the sample warmup ended (it sets lr_warmup_tokens = num_tokens at that step).
        self.decay_start_tokens = warmup_tokens
        self._next_increment, self._next_tokens = 0, 0
        super().__init__(optimizer, **kwargs)

    def begin_iteration(self, global_batch: int, tokens_before: int) -> None:
        """What the next applied step() counts: its global batch and the tokens consumed before it."""
        self._next_increment, self._next_tokens = global_batch, tokens_before

    def step(self, increment: int = 1, **_) -> None:
        self.num_tokens = self._next_tokens
        self.num_steps += self._next_increment
        self._apply()

    def _warmup_lr(self, step: int) -> float | None:
        if self.warmup_tokens is None:
            if self.decay_tokens is not None and self.decay_start_tokens is None and step >= self.warmup_steps:
                self.decay_start_tokens = self.num_tokens
            if self.warmup_steps > 0 and step <= self.warmup_steps:
                return self.max_lr * step / self.warmup_steps
        elif self.warmup_tokens > 0 and self.num_tokens <= self.warmup_tokens:
            return self.max_lr * self.num_tokens / self.warmup_tokens
        return None

    def lr_at(self, step: int) -> float:
        warm = self._warmup_lr(step)
        if warm is not None:
            return warm
        if self.decay_style == "constant":
            return self.max_lr
        by_tokens = self.decay_tokens is not None
        if (self.num_tokens > self.decay_tokens) if by_tokens else (step > self.decay_steps):
            return self.min_lr
        if self.decay_style == "inverse-square-root":
            if self.warmup_tokens is None:
                lr = self.max_lr * math.sqrt(max(self.warmup_steps, 1)) / math.sqrt(max(step, 1))
            else:
                lr = self.max_lr * math.sqrt(max(self.warmup_tokens, 1)) / math.sqrt(max(self.num_tokens, 1))
            return max(self.min_lr, lr)
        if by_tokens:
            start = self.decay_start_tokens or 0
            ratio = (self.num_tokens - start) / max(self.decay_tokens - start, 1)
        else:
            ratio = (step - self.warmup_steps) / max(self.decay_steps - self.warmup_steps, 1)
        coeff = 1.0 - ratio if self.decay_style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "warmup_tokens": self.warmup_tokens, "decay_tokens": self.decay_tokens,
                "num_tokens": self.num_tokens, "decay_start_tokens": self.decay_start_tokens}

    def load_state_dict(self, state: dict) -> None:
        # tokens first: the base class recomputes the LR from them
        self.num_tokens = state.get("num_tokens", 0)  # absent: an iteration-counted schedule (refused below)
        if self.warmup_tokens is None:
            self.decay_start_tokens = state.get("decay_start_tokens")
        super().load_state_dict(state)


def make_lr_schedule(optimizer, cfg: Config, layout: Layout) -> LRSchedule:
    """Iteration-counted schedule for constant-batch runs (equal to Megatron's sample count divided by
    the constant global batch); the sample/token-counted one for ramp-up and token spans."""
    o, run = cfg.optimizer, layout.run
    common = dict(max_lr=o.lr, min_lr=o.min_lr, decay_style=o.lr_decay_style)
    if not run.needs_sample_lr:
        return LRSchedule(optimizer, warmup_steps=layout.lr_warmup_iters, decay_steps=layout.lr_decay_iters,
                          **common)
    return ConsumedLRSchedule(optimizer, warmup_steps=run.lr_warmup_samples, decay_steps=run.lr_decay_samples,
                              warmup_tokens=run.lr_warmup_tokens, decay_tokens=run.lr_decay_tokens, **common)


class TrainPlan:
    """The loop's per-iteration bookkeeping for ramp-up and token targets."""

    def __init__(self, layout: Layout):
        self.run, self.train_iters = layout.run, layout.train_iters

    def keep_going(self, state) -> bool:
        """megatron/training.py: while iteration < train_iters and consumed_train_tokens < train_tokens."""
        if state.iteration >= self.train_iters:
            return False
        return self.run.train_tokens is None or state.consumed_train_tokens < self.run.train_tokens

    def begin(self, engine, state) -> int:
        """Set the engine's global batch for the next step; returns it."""
        batch = self.run.global_batch_at(state.consumed_train_samples)
        if self.run.rampup is not None and engine.train_batch_size() != batch:
            engine.set_train_batch_size(batch)  # DeepSpeed keeps the micro batch, changes accumulation steps
        if isinstance(engine.lr_scheduler, ConsumedLRSchedule):
            engine.lr_scheduler.begin_iteration(batch, state.consumed_train_tokens)
        return batch

    def end(self, state, batch: int) -> None:
        state.consumed_train_samples += batch
        state.consumed_train_tokens += batch * self.run.seq_length
