"""Ramp-up, token targets and the sample/token LR schedule against transcriptions of Megatron-DeepSpeed's
own code (megatron/microbatches.py, megatron/training.py update_train_iters,
megatron/optimizer_param_scheduler.py), driven step by step with the same inputs."""
from __future__ import annotations

import math

import pytest
import torch

from megatron_ds.config import parse_args, resolve
from megatron_ds.config.run_length import Rampup
from megatron_ds.errors import ConfigError
from megatron_ds.families.gpt.gpt_family import GPT
from megatron_ds.training.lr_schedule import ConsumedLRSchedule, LRSchedule


class MegatronRampup:
    """megatron/microbatches.py RampupBatchsizeNumMicroBatches, transcribed."""

    def __init__(self, start, increment, ramup_samples, global_batch_size):
        self.start, self.increment, self.samples, self.gbs = start, increment, ramup_samples, global_batch_size
        self.per_increment = ramup_samples / ((global_batch_size - start) // increment)

    def update(self, consumed_samples):
        if consumed_samples > self.samples:
            return self.gbs
        steps = int(consumed_samples / self.per_increment)
        return self.start + steps * self.increment


def megatron_train_iters(train_samples, ramp: MegatronRampup):
    """megatron/training.py update_train_iters, transcribed."""
    iterations = consumed = 0
    while consumed <= ramp.samples:
        consumed += ramp.update(consumed)
        iterations += 1
    return iterations + (train_samples - consumed) // ramp.gbs


class MegatronScheduler:
    """megatron/optimizer_param_scheduler.py OptimizerParamScheduler.get_lr/step, transcribed."""

    def __init__(self, max_lr, min_lr, warmup_steps, decay_steps, style, warmup_tokens, decay_tokens):
        self.max_lr, self.min_lr, self.lr_warmup_steps, self.lr_decay_steps = max_lr, min_lr, warmup_steps, decay_steps
        self.lr_decay_style, self.lr_warmup_tokens, self.lr_decay_tokens = style, warmup_tokens, decay_tokens
        self.num_steps = self.num_tokens = 0

    def get_lr(self):
        if self.lr_warmup_tokens is None:
            if self.lr_warmup_steps > 0 and self.num_steps <= self.lr_warmup_steps:
                if self.num_steps == self.lr_warmup_steps and self.lr_decay_tokens is not None:
                    self.lr_warmup_tokens = self.num_tokens
                return self.max_lr * float(self.num_steps) / float(self.lr_warmup_steps)
        else:
            if self.lr_warmup_tokens > 0 and self.num_tokens <= self.lr_warmup_tokens:
                return self.max_lr * float(self.num_tokens) / float(self.lr_warmup_tokens)
        if self.lr_decay_style == "constant":
            return self.max_lr
        if self.lr_decay_tokens is None:
            if self.num_steps > self.lr_decay_steps:
                return self.min_lr
        else:
            if self.num_tokens > self.lr_decay_tokens:
                return self.min_lr
        if self.lr_decay_style == "inverse-square-root":
            if self.lr_warmup_tokens is None:
                lr = self.max_lr * max(self.lr_warmup_steps, 1) ** 0.5 / (max(self.num_steps, 1) ** 0.5)
            else:
                lr = self.max_lr * max(self.lr_warmup_tokens, 1) ** 0.5 / (max(self.num_tokens, 1) ** 0.5)
            return max(self.min_lr, lr)
        if self.lr_decay_tokens is None:
            ratio = (self.num_steps - self.lr_warmup_steps) / (self.lr_decay_steps - self.lr_warmup_steps)
        else:
            ratio = (self.num_tokens - self.lr_warmup_tokens) / (self.lr_decay_tokens - self.lr_warmup_tokens)
        coeff = (1.0 - ratio) if self.lr_decay_style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def step(self, increment, token_num):
        self.num_tokens = token_num
        self.num_steps += increment
        return self.get_lr()


def test_rampup_batches_and_iterations_match_megatron():
    for start, inc, samples, gbs, total in [(16, 16, 5859375, 1536, 146484375), (32, 32, 1953125, 512, 439453125),
                                            (2, 2, 12, 6, 40), (4, 4, 100, 64, 1000)]:
        ours, ref = Rampup(start, inc, samples, gbs), MegatronRampup(start, inc, samples, gbs)
        for consumed in sorted({0, 1, samples - 1, samples, samples + 1, *range(0, samples + 2, max(samples // 97, 1))}):
            assert ours.global_batch_at(consumed) == ref.update(consumed), (start, consumed)
        cfg, _ = parse_args(["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2",
                             "--seq-length", "8", "--micro-batch-size", "1", "--lr", "1e-3",
                             "--global-batch-size", str(gbs), "--rampup-batch-size", str(start), str(inc), str(samples),
                             "--train-samples", str(total)])
        layout = resolve(cfg, world_size=1, vocab_size=100, device_type="cpu", family=GPT).layout
        assert layout.train_iters == megatron_train_iters(total, ref)


@pytest.mark.parametrize("argv,message", [
    (["--train-iters", "10", "--rampup-batch-size", "2", "2", "8"], "--rampup-batch-size needs --train-samples"),
    (["--train-samples", "100", "--rampup-batch-size", "3", "1", "8"], "must be multiples of --micro-batch-size x DP = 2"),
    (["--train-samples", "100", "--rampup-batch-size", "2", "3", "8"], "must be a non-negative multiple of INCREMENT 3"),
    (["--train-samples", "100", "--rampup-batch-size", "2", "2"], "takes 3 values"),
    (["--train-samples", "100", "--train-tokens", "0"], "--train-tokens must be positive"),
])
def test_bad_rampup_and_token_flags(argv, message):
    cfg, _ = parse_args(["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2", "--seq-length", "8",
                         "--micro-batch-size", "1", "--lr", "1e-3", "--global-batch-size", "6", *argv])
    with pytest.raises(ConfigError, match=message):
        resolve(cfg, world_size=2, vocab_size=100, device_type="cpu", family=GPT)


def _drive(style, warmup_steps, warmup_tokens, decay_tokens, decay_steps=10 ** 9, steps=60):
    """Feed both schedules the same applied steps: a ramping batch, 128 tokens per sample, and
    every fifth step skipped (an fp16 overflow: DeepSpeed does not call step(), tokens still grow)."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    ours = ConsumedLRSchedule(opt, max_lr=1.0, min_lr=0.05, warmup_steps=warmup_steps, decay_steps=decay_steps,
                              decay_style=style, warmup_tokens=warmup_tokens, decay_tokens=decay_tokens)
    ref = MegatronScheduler(1.0, 0.05, warmup_steps, decay_steps, style, warmup_tokens, decay_tokens)
    ref.step(0, 0)
    consumed = tokens = 0
    lrs = []
    for i in range(steps):
        batch = 4 + 4 * min(i // 10, 3)
        ours.begin_iteration(batch, tokens)
        if i % 5 != 4:
            ours.step()
            expected = ref.step(batch, tokens)
            assert ours.get_lr()[0] == pytest.approx(expected, rel=1e-12, abs=1e-15), (style, i)
            assert opt.param_groups[0]["lr"] == ours.get_lr()[0]
            lrs.append(expected)
        consumed += batch
        tokens += batch * 128
    return lrs


@pytest.mark.parametrize("style", ["linear", "cosine", "inverse-square-root", "constant"])
def test_token_lr_schedule_matches_megatron(style):
    lrs = _drive(style, warmup_steps=0, warmup_tokens=8 * 1024, decay_tokens=80 * 1024)
    assert max(lrs) == pytest.approx(1.0, rel=0.2)  # the schedule did reach its peak region


def test_sample_warmup_then_token_decay_matches_megatron():
    # warmup of 48 samples hit exactly at a step boundary (4+4+...): Megatron then pins warmup tokens
    _drive("cosine", warmup_steps=48, warmup_tokens=None, decay_tokens=80 * 1024)


def test_lr_state_round_trip_mid_schedule():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    kw = dict(max_lr=1.0, min_lr=0.0, warmup_steps=0, decay_steps=10 ** 6, decay_style="cosine",
              warmup_tokens=1000, decay_tokens=20000)
    a = ConsumedLRSchedule(opt, **kw)
    for i in range(7):
        a.begin_iteration(8, i * 8 * 64)
        a.step()
    b = ConsumedLRSchedule(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0), **kw)
    b.load_state_dict(a.state_dict())
    for i in range(7, 20):
        for s in (a, b):
            s.begin_iteration(8, i * 8 * 64)
            s.step()
        assert a.get_lr() == b.get_lr()
    other = ConsumedLRSchedule(opt, **{**kw, "decay_tokens": 30000})
    with pytest.raises(ConfigError, match="decay_tokens: checkpoint 20000 vs now 30000"):
        other.load_state_dict(a.state_dict())
    # switching between iteration-counted and sample/token-counted schedules mid-run: units differ
    plain = LRSchedule(opt, max_lr=1.0, min_lr=0.0, warmup_steps=0, decay_steps=100, decay_style="cosine")
    with pytest.raises(ConfigError, match="counts samples and tokens but this run's counts iterations"):
        plain.load_state_dict(a.state_dict())
    with pytest.raises(ConfigError, match="counts iterations but this run's counts samples and tokens"):
        ConsumedLRSchedule(opt, **kw).load_state_dict(plain.state_dict())


@pytest.mark.parametrize("style", ["linear", "cosine", "inverse-square-root", "constant"])
def test_iteration_schedule_matches_megatron_past_the_decay_span(style):
    """The iteration-counted schedule (no tokens, no ramp) with --lr-decay-iters shorter than training: after the
    decay span every style but constant is at --min-lr, inverse-square-root included (get_lr returns min_lr
    for num_steps > lr_decay_steps before any style's formula)."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    ours = LRSchedule(opt, max_lr=1.0, min_lr=0.05, warmup_steps=3, decay_steps=12, decay_style=style)
    ref = MegatronScheduler(1.0, 0.05, 3 * 4, 12 * 4, style, None, None)  # in samples: a global batch of 4
    for _ in range(20):
        ours.step()
        assert ours.get_lr()[0] == pytest.approx(ref.step(4, 0), rel=1e-12, abs=1e-15), (style, ours.num_steps)
