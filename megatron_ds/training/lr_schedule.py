"""Megatron's learning-rate schedule: linear warmup, then constant / linear / cosine /
inverse-square-root decay to --min-lr, or Megatron-LM's WSD (warmup, stable at --lr, then a decay over the
last --lr-wsd-decay-iters of the decay span), stepped once per applied optimizer step.

DeepSpeed steps it (it is passed as the engine's lr_scheduler) only when the optimizer step was
applied, so skipped fp16-overflow or NaN steps do not advance the schedule, as in Megatron.

``LRSchedule`` counts iterations, which equals Megatron's count of samples divided by a constant
global batch. ``ConsumedLRSchedule`` is Megatron-DeepSpeed's OptimizerParamScheduler
(megatron/optimizer_param_scheduler.py) for runs whose schedule cannot be counted in iterations
(a batch-size ramp-up, token spans): steps are counted in samples (each applied optimizer step adds
that step's global batch, as Megatron passes ``increment = micro-batches x micro x DP``) and
``--lr-warmup-tokens`` / ``--lr-decay-tokens`` follow consumed tokens. As there, the tokens seen by a
step are those consumed *before* it (Megatron-DeepSpeed updates ``args.consumed_train_tokens`` after
``train_step``, inside which the scheduler steps). The spans come resolved from the run's layout
(``megatron_ds.config.run_length``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_ds.errors import ConfigError


@dataclass(frozen=True)
class WeightDecayIncrement:
    """OptimizerParamScheduler.get_wd (megatron/optimizer_param_scheduler.py): weight decay rises from
    ``start`` to ``end`` over ``steps`` (training's length, in the schedule's step unit), linearly or along
    a half cosine, then stays at ``end``. Each group's decay is this times its ``wd_mult`` (0 for biases
    and norms), as Megatron sets ``group['weight_decay'] = new_wd * group.get('wd_mult', 1.0)``."""
    start: float
    end: float
    steps: float
    style: str  # "linear" | "cosine"

    def at(self, step: float) -> float:
        if step > self.steps:
            return self.end
        ratio = step / self.steps
        coeff = ratio if self.style == "linear" else 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
        return self.start + coeff * (self.end - self.start)


WSD_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")


def wsd_coeff(step: float, decay_steps: float, wsd_steps: float, style: str) -> float:
    """The WSD branch of Megatron-LM's OptimizerParamScheduler.get_lr (megatron/core/
    optimizer_param_scheduler.py, core_v0.19.0), for a step after the warmup and at most ``decay_steps``:
    1 until the last ``wsd_steps`` of the decay span, then down to 0 along ``style``."""
    anneal_start = decay_steps - wsd_steps
    if step <= anneal_start:
        return 1.0
    ratio = float(step - anneal_start) / float(wsd_steps)
    if style == "linear":
        return 1.0 - ratio
    if style == "cosine":
        return 0.5 * (math.cos(math.pi * ratio) + 1.0)
    if style == "exponential":
        return (2.0 * math.pow(0.5, ratio)) - 1.0
    return 1.0 - math.sqrt(ratio)  # minus_sqrt


class LRSchedule:
    # what must agree between a checkpoint's schedule and this run's (see load_state_dict)
    SHAPE = ("max_lr", "min_lr", "warmup_steps", "decay_steps", "decay_style")

    def __init__(self, optimizer, *, max_lr: float, min_lr: float, warmup_steps: int, decay_steps: int,
                 decay_style: str, last_step: int = 0, override: bool = False, use_checkpoint: bool = False,
                 weight_decay: WeightDecayIncrement | None = None, wsd_decay_steps: int | None = None,
                 wsd_decay_style: str = "exponential"):
        if decay_style not in ("constant", "linear", "cosine", "inverse-square-root", "WSD"):
            raise ValueError(f"unknown --lr-decay-style {decay_style}")
        if decay_style == "WSD" and (wsd_decay_steps is None or wsd_decay_style not in WSD_STYLES):
            raise ValueError(f"WSD needs a decay span and one of {WSD_STYLES}")
        # WSD's decay phase (steps) and shape; None for the other styles
        self.wsd_decay_steps = wsd_decay_steps if decay_style == "WSD" else None
        self.wsd_decay_style = wsd_decay_style if decay_style == "WSD" else None
        self.optimizer = optimizer
        self.max_lr, self.min_lr = max_lr, min_lr
        self.warmup_steps, self.decay_steps = warmup_steps, max(decay_steps, 1)
        self.decay_style = decay_style
        self.num_steps = last_step
        # what loading a checkpoint whose schedule differs does: keep this run's shape
        # (--override-lr-scheduler), take the checkpoint's (--use-checkpoint-lr-scheduler), or stop
        self.override = override
        self.use_checkpoint = use_checkpoint
        # None: the optimizer keeps --weight-decay (constant style); the state saved is then unchanged
        self.weight_decay = weight_decay
        self._apply()

    def lr_at(self, step: int) -> float:
        """The LR of the parameters at --lr / --min-lr (what the iteration line prints, as Megatron-LM logs
        its default group's) after ``step`` steps."""
        return self.group_lr_at(step, self.max_lr, self.min_lr)

    def group_lr_at(self, step: int, max_lr: float, min_lr: float) -> float:
        """The schedule between ``max_lr`` and ``min_lr``: each group's own, as Megatron-LM's
        OptimizerParamScheduler.get_lr(param_group) takes a group's ``max_lr`` / ``min_lr`` (--decoupled-lr)."""
        if self.warmup_steps > 0 and step <= self.warmup_steps:
            return max_lr * step / self.warmup_steps
        if self.decay_style == "constant":
            return max_lr
        if step > self.decay_steps:  # before inverse-square-root's formula too, as both Megatrons' get_lr
            return min_lr
        if self.decay_style == "inverse-square-root":
            warm = max(self.warmup_steps, 1)
            return max(min_lr, max_lr * math.sqrt(warm) / math.sqrt(max(step, 1)))
        if self.decay_style == "WSD":
            return min_lr + wsd_coeff(step, self.decay_steps, self.wsd_decay_steps, self.wsd_decay_style) \
                * (max_lr - min_lr)
        ratio = (step - self.warmup_steps) / max(self.decay_steps - self.warmup_steps, 1)
        coeff = 1.0 - ratio if self.decay_style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return min_lr + coeff * (max_lr - min_lr)

    def get_lr(self) -> list[float]:
        return [self.lr_at(self.num_steps)]

    def get_last_lr(self) -> list[float]:
        return self.get_lr()

    def _apply(self) -> None:
        wd = self.weight_decay.at(self.num_steps) if self.weight_decay is not None else None
        for group in self.optimizer.param_groups:
            # a group without max_lr / min_lr (all but --decoupled-lr's) follows --lr / --min-lr
            group["lr"] = self.group_lr_at(self.num_steps, group.get("max_lr", self.max_lr),
                                           group.get("min_lr", self.min_lr))
            if wd is not None:  # groups of an optimizer saved before wd_mult existed: decay where it decayed
                group["weight_decay"] = wd * group.get("wd_mult", 1.0 if group["weight_decay"] else 0.0)

    def step(self, increment: int = 1, **_) -> None:
        self.num_steps += 1
        self._apply()

    def state_dict(self) -> dict:
        state = {"max_lr": self.max_lr, "min_lr": self.min_lr, "warmup_steps": self.warmup_steps,
                 "decay_steps": self.decay_steps, "decay_style": self.decay_style, "num_steps": self.num_steps}
        if self.decay_style == "WSD":  # other styles' state stays as it was (older checkpoints load alike)
            state.update(wsd_decay_steps=self.wsd_decay_steps, wsd_decay_style=self.wsd_decay_style)
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore the step (DeepSpeed calls this while loading a checkpoint). A schedule shape that
        differs from this run's is an error unless a flag says which one wins, as in Megatron."""
        # WSD's span and shape are compared when the checkpoint has them; Megatron-LM never saves them (its
        # state_dict), so a checkpoint without them (Megatron-LM's, another style's) takes this run's
        shape = self.SHAPE + tuple(k for k in ("wsd_decay_steps", "wsd_decay_style") if k in state)
        if ("num_tokens" in state) != ("num_tokens" in self.state_dict()):
            raise ConfigError("the checkpoint's learning-rate schedule counts {} but this run's counts {} "
                              "(--rampup-batch-size / --lr-warmup-tokens / --lr-decay-tokens differ); resume with "
                              "the checkpoint's flags, or pass --no-load-lr-state to start the schedule afresh"
                              .format(*(("samples and tokens", "iterations") if "num_tokens" in state
                                        else ("iterations", "samples and tokens"))))
        diffs = [f"{k}: checkpoint {state[k]!r} vs now {getattr(self, k)!r}" for k in shape
                 if state[k] != getattr(self, k)]
        if diffs and not (self.override or self.use_checkpoint):
            raise ConfigError(f"the learning-rate schedule differs from the checkpoint's ({'; '.join(diffs)}); "
                              f"pass --override-lr-scheduler to use this run's or "
                              f"--use-checkpoint-lr-scheduler to keep the checkpoint's")
        if not self.override:
            for k in shape:
                setattr(self, k, state[k])
        self.num_steps = state["num_steps"]
        self._apply()


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

    def _warmup_lr(self, step: int, max_lr: float) -> float | None:
        if self.warmup_tokens is None:
            if self.decay_tokens is not None and self.decay_start_tokens is None and step >= self.warmup_steps:
                self.decay_start_tokens = self.num_tokens
            if self.warmup_steps > 0 and step <= self.warmup_steps:
                return max_lr * step / self.warmup_steps
        elif self.warmup_tokens > 0 and self.num_tokens <= self.warmup_tokens:
            return max_lr * self.num_tokens / self.warmup_tokens
        return None

    def group_lr_at(self, step: int, max_lr: float, min_lr: float) -> float:
        warm = self._warmup_lr(step, max_lr)
        if warm is not None:
            return warm
        if self.decay_style == "constant":
            return max_lr
        by_tokens = self.decay_tokens is not None
        if (self.num_tokens > self.decay_tokens) if by_tokens else (step > self.decay_steps):
            return min_lr
        if self.decay_style == "inverse-square-root":
            if self.warmup_tokens is None:
                lr = max_lr * math.sqrt(max(self.warmup_steps, 1)) / math.sqrt(max(step, 1))
            else:
                lr = max_lr * math.sqrt(max(self.warmup_tokens, 1)) / math.sqrt(max(self.num_tokens, 1))
            return max(min_lr, lr)
        if self.decay_style == "WSD":  # counted in samples only (token spans with WSD are refused)
            return min_lr + wsd_coeff(step, self.decay_steps, self.wsd_decay_steps, self.wsd_decay_style) \
                * (max_lr - min_lr)
        if by_tokens:
            start = self.decay_start_tokens or 0
            ratio = (self.num_tokens - start) / max(self.decay_tokens - start, 1)
        else:
            ratio = (step - self.warmup_steps) / max(self.decay_steps - self.warmup_steps, 1)
        coeff = 1.0 - ratio if self.decay_style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return min_lr + coeff * (max_lr - min_lr)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "warmup_tokens": self.warmup_tokens, "decay_tokens": self.decay_tokens,
                "num_tokens": self.num_tokens, "decay_start_tokens": self.decay_start_tokens}

    def load_state_dict(self, state: dict) -> None:
        # tokens first: the base class recomputes the LR from them
        self.num_tokens = state.get("num_tokens", 0)  # absent: an iteration-counted schedule (refused below)
        if self.warmup_tokens is None:
            self.decay_start_tokens = state.get("decay_start_tokens")
        super().load_state_dict(state)


def make_lr_schedule(optimizer, run) -> LRSchedule:
    """The ``Run``'s schedule: iteration-counted for constant-batch runs (equal to Megatron's sample
    count divided by the constant global batch); sample/token-counted for ramp-up and token spans."""
    o, layout, spans = run.optimizer, run.layout, run.layout.schedule
    common = dict(max_lr=o.lr, min_lr=o.min_lr, decay_style=o.lr_decay_style, override=o.override_lr_scheduler,
                  use_checkpoint=o.use_checkpoint_lr_scheduler, wsd_decay_style=o.lr_wsd_decay_style)
    wd = None
    if o.weight_decay_incr_style != "constant":
        # Megatron counts samples; an iteration-counted schedule counts them in global batches
        unit = 1 if spans.needs_sample_lr else layout.global_batch_size
        wd = WeightDecayIncrement(o.start_weight_decay, o.end_weight_decay, max(spans.wd_incr_samples / unit, 1),
                                  o.weight_decay_incr_style)
    if not spans.needs_sample_lr:
        wsd = None if spans.lr_wsd_decay_samples is None else spans.lr_wsd_decay_samples // layout.global_batch_size
        return LRSchedule(optimizer, warmup_steps=layout.lr_warmup_iters, decay_steps=layout.lr_decay_iters,
                          weight_decay=wd, wsd_decay_steps=wsd, **common)
    return ConsumedLRSchedule(optimizer, warmup_steps=spans.lr_warmup_samples, decay_steps=spans.lr_decay_samples,
                              warmup_tokens=spans.lr_warmup_tokens, decay_tokens=spans.lr_decay_tokens,
                              weight_decay=wd, wsd_decay_steps=spans.lr_wsd_decay_samples, **common)
