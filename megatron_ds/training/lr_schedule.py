"""Megatron's learning-rate schedule: linear warmup, then constant / linear / cosine /
inverse-square-root decay to --min-lr, stepped once per applied optimizer step.

DeepSpeed steps it (it is passed as the engine's lr_scheduler) only when the optimizer step was
applied, so skipped fp16-overflow or NaN steps do not advance the schedule, as in Megatron.
"""
from __future__ import annotations

import math


class LRSchedule:
    def __init__(self, optimizer, *, max_lr: float, min_lr: float, warmup_steps: int, decay_steps: int,
                 decay_style: str, last_step: int = 0):
        if decay_style not in ("constant", "linear", "cosine", "inverse-square-root"):
            raise ValueError(f"unknown --lr-decay-style {decay_style}")
        self.optimizer = optimizer
        self.max_lr, self.min_lr = max_lr, min_lr
        self.warmup_steps, self.decay_steps = warmup_steps, max(decay_steps, 1)
        self.decay_style = decay_style
        self.num_steps = last_step
        # what loading a checkpoint whose schedule differs does: keep this run's shape
        # (--override-lr-scheduler), take the checkpoint's (--use-checkpoint-lr-scheduler), or stop
        self.override = False
        self.use_checkpoint = False
        self._apply()

    def lr_at(self, step: int) -> float:
        if self.warmup_steps > 0 and step <= self.warmup_steps:
            return self.max_lr * step / self.warmup_steps
        if self.decay_style == "constant":
            return self.max_lr
        if self.decay_style == "inverse-square-root":
            warm = max(self.warmup_steps, 1)
            return max(self.min_lr, self.max_lr * math.sqrt(warm) / math.sqrt(max(step, 1)))
        if step > self.decay_steps:
            return self.min_lr
        ratio = (step - self.warmup_steps) / max(self.decay_steps - self.warmup_steps, 1)
        coeff = 1.0 - ratio if self.decay_style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def get_lr(self) -> list[float]:
        return [self.lr_at(self.num_steps)]

    def get_last_lr(self) -> list[float]:
        return self.get_lr()

    def _apply(self) -> None:
        lr = self.lr_at(self.num_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self, increment: int = 1, **_) -> None:
        self.num_steps += 1
        self._apply()

    def state_dict(self) -> dict:
        return {"max_lr": self.max_lr, "min_lr": self.min_lr, "warmup_steps": self.warmup_steps,
                "decay_steps": self.decay_steps, "decay_style": self.decay_style, "num_steps": self.num_steps}

    def load_state_dict(self, state: dict) -> None:
        """Restore the step (DeepSpeed calls this while loading a checkpoint). A schedule shape that
        differs from this run's is an error unless a flag says which one wins, as in Megatron."""
        shape = ("max_lr", "min_lr", "warmup_steps", "decay_steps", "decay_style")
        diffs = [f"{k}: checkpoint {state[k]!r} vs now {getattr(self, k)!r}" for k in shape
                 if state[k] != getattr(self, k)]
        if diffs and not (self.override or self.use_checkpoint):
            from megatron_ds.config import ConfigError  # noqa: PLC0415

            raise ConfigError(f"the learning-rate schedule differs from the checkpoint's ({'; '.join(diffs)}); "
                              f"pass --override-lr-scheduler to use this run's or "
                              f"--use-checkpoint-lr-scheduler to keep the checkpoint's")
        if not self.override:
            for k in shape:
                setattr(self, k, state[k])
        self.num_steps = state["num_steps"]
        self._apply()
