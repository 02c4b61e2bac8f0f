"""--start-weight-decay / --end-weight-decay / --weight-decay-incr-style against a transcription of
Megatron-DeepSpeed's OptimizerParamScheduler (megatron/optimizer_param_scheduler.py get_wd and step,
deepspeedai/Megatron-DeepSpeed commit 4efb479) and of the span megatron/training.py
get_optimizer_param_scheduler gives it (wd_incr_steps = train_iters x global batch, or train_samples)."""
from __future__ import annotations

import math

import pytest
import torch

from megatron_ds.config import parse_args, resolve
from megatron_ds.errors import ConfigError
from megatron_ds.families.gpt.gpt_family import GPT
from megatron_ds.model.param_groups import param_groups
from megatron_ds.training.lr_schedule import make_lr_schedule

ARGS = ("--num-layers 2 --hidden-size 8 --num-attention-heads 2 --seq-length 8 --micro-batch-size 1 "
        "--lr 1e-3 --weight-decay 0.1").split()


class MegatronWeightDecay:
    """OptimizerParamScheduler's weight-decay half, transcribed: num_steps counts samples."""

    def __init__(self, start_wd, end_wd, wd_incr_steps, wd_incr_style):
        self.start_wd, self.end_wd = start_wd, end_wd
        self.wd_incr_steps, self.wd_incr_style = wd_incr_steps, wd_incr_style
        self.num_steps = 0

    def get_wd(self):
        if self.num_steps > self.wd_incr_steps:
            return self.end_wd
        if self.wd_incr_style == "constant":
            assert self.start_wd == self.end_wd
            return self.end_wd
        incr_ratio = float(self.num_steps) / float(self.wd_incr_steps)
        delta_wd = self.end_wd - self.start_wd
        if self.wd_incr_style == "linear":
            coeff = incr_ratio
        elif self.wd_incr_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * (1 - incr_ratio)) + 1.0)
        return self.start_wd + coeff * delta_wd

    def step(self, increment):
        self.num_steps += increment
        return self.get_wd()


def _schedule(argv):
    cfg, _ = parse_args(ARGS + argv)
    run = resolve(cfg, world_size=1, vocab_size=100, device_type="cpu", family=GPT)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    opt = torch.optim.AdamW(param_groups(model, run.optimizer.weight_decay), lr=1e-3)
    return run, opt, make_lr_schedule(opt, run)


@pytest.mark.parametrize("style", ["linear", "cosine"])
@pytest.mark.parametrize("batching", [["--train-iters", "12", "--global-batch-size", "4"],
                                      ["--train-samples", "40", "--global-batch-size", "4",
                                       "--rampup-batch-size", "2", "2", "16"]])
def test_weight_decay_follows_megatron(style, batching):
    run, opt, sched = _schedule(batching + ["--start-weight-decay", "0.01", "--end-weight-decay", "0.1",
                                            "--weight-decay-incr-style", style])
    samples = run.layout.schedule
    span = 40 if "--train-samples" in batching else 12 * 4  # train_samples / train_iters x global batch
    ref = MegatronWeightDecay(0.01, 0.1, span, style)
    assert opt.param_groups[0]["weight_decay"] == pytest.approx(ref.get_wd(), abs=1e-15) == 0.01
    consumed, seen = 0, []
    for _ in range(run.layout.train_iters + 3):  # past the end: stays at end_wd
        batch = samples.global_batch_at(consumed)
        if hasattr(sched, "begin_iteration"):
            sched.begin_iteration(batch, consumed * 8)
        sched.step()
        expected = ref.step(batch)
        consumed += batch
        assert opt.param_groups[0]["weight_decay"] == pytest.approx(expected, rel=1e-12)
        assert opt.param_groups[1]["weight_decay"] == 0.0  # biases and norms never decay
        seen.append(expected)
    assert seen[-1] == pytest.approx(0.1) and len(set(seen)) > 5


def test_constant_style_keeps_weight_decay():
    _, opt, _ = _schedule(["--train-iters", "5"])
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]


@pytest.mark.parametrize("argv,message", [
    (["--start-weight-decay", "0.1"], "need --weight-decay-incr-style linear or cosine"),
    (["--weight-decay-incr-style", "linear", "--end-weight-decay", "0.1"], "needs both"),
    (["--weight-decay-incr-style", "cosine", "--start-weight-decay", "0.2", "--end-weight-decay", "0.1"],
     "0 <= start <= end"),
])
def test_weight_decay_flags_are_checked(argv, message):
    cfg, _ = parse_args(ARGS + ["--train-iters", "5"] + argv)
    with pytest.raises(ConfigError, match=message):
        resolve(cfg, world_size=1, vocab_size=100, device_type="cpu", family=GPT)
