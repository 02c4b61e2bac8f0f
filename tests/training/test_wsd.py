"""Megatron-LM's warmup-stable-decay schedule (--lr-decay-style WSD) against a transcription of Megatron-LM's
own code (core_v0.19.0): megatron/training/training.py get_optimizer_param_scheduler (the spans in samples:
iteration counts times the global batch size; --lr-wsd-decay-iters in an iteration-based run,
--lr-wsd-decay-samples in a --train-samples run) and megatron/core/optimizer_param_scheduler.py
OptimizerParamScheduler.get_lr (warmup from --lr-warmup-init, here 0; past lr_decay_steps min_lr; the WSD
branch). Our schedule is built by the real path (parse_args -> resolve -> make_lr_schedule) and stepped as
DeepSpeed steps it; every step's LR must equal the transcription's exactly."""
from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import pytest
import torch

from megatron_ds.config import parse_args, resolve
from megatron_ds.errors import ConfigError
from megatron_ds.families.gpt.gpt_family import GPT
from megatron_ds.training.lr_schedule import ConsumedLRSchedule, LRSchedule, make_lr_schedule
from tests.distributed import run_distributed

STYLES = ("exponential", "linear", "cosine", "minus_sqrt")
MODEL = "--num-layers 2 --hidden-size 8 --num-attention-heads 2 --seq-length 8 --micro-batch-size 1".split()


class MegatronLMScheduler:
    """OptimizerParamScheduler.get_lr (megatron/core/optimizer_param_scheduler.py), transcribed for the
    default param group (max_lr / min_lr the scheduler's) and init_lr = 0; step(increment) adds samples."""

    def __init__(self, max_lr, min_lr, lr_warmup_steps, lr_decay_steps, wsd_decay_steps, lr_wsd_decay_style,
                 init_lr=0.0):
        self.init_lr, self.max_lr, self.min_lr = init_lr, float(max_lr), min_lr
        self.lr_warmup_steps, self.lr_decay_steps = lr_warmup_steps, lr_decay_steps
        self.wsd_decay_steps, self.lr_wsd_decay_style = wsd_decay_steps, lr_wsd_decay_style
        self.num_steps = 0
        assert wsd_decay_steps is not None  # __init__: "if self.lr_decay_style == 'WSD'"

    def get_lr(self):
        max_lr, min_lr = self.max_lr, self.min_lr
        if self.lr_warmup_steps > 0 and self.num_steps <= self.lr_warmup_steps:
            return self.init_lr + ((max_lr - self.init_lr) * float(self.num_steps) / float(self.lr_warmup_steps))
        if self.num_steps > self.lr_decay_steps:
            return min_lr
        num_steps_ = self.num_steps - self.lr_warmup_steps
        decay_steps_ = self.lr_decay_steps - self.lr_warmup_steps
        decay_ratio = float(num_steps_) / float(decay_steps_)
        assert 0.0 <= decay_ratio <= 1.0
        delta_lr = max_lr - min_lr
        wsd_anneal_start_ = self.lr_decay_steps - self.wsd_decay_steps
        if self.num_steps <= wsd_anneal_start_:
            coeff = 1.0
        else:
            wsd_steps = self.num_steps - wsd_anneal_start_
            wsd_decay_ratio = float(wsd_steps) / float(self.wsd_decay_steps)
            if self.lr_wsd_decay_style == "linear":
                coeff = 1.0 - wsd_decay_ratio
            elif self.lr_wsd_decay_style == "cosine":
                coeff = 0.5 * (math.cos(math.pi * wsd_decay_ratio) + 1.0)
            elif self.lr_wsd_decay_style == "exponential":
                coeff = (2.0 * math.pow(0.5, wsd_decay_ratio)) - 1.0
            elif self.lr_wsd_decay_style == "minus_sqrt":
                coeff = 1.0 - math.sqrt(wsd_decay_ratio)
        return min_lr + coeff * delta_lr

    def step(self, increment):
        self.num_steps += increment
        return self.get_lr()


def megatron_lm_reference(*, lr, min_lr, gbs, style, train_iters=None, decay_iters=None, warmup_iters=0,
                          wsd_iters=None, train_samples=None, decay_samples=None, warmup_samples=0,
                          wsd_samples=None) -> MegatronLMScheduler:
    """get_optimizer_param_scheduler (megatron/training/training.py), transcribed: the spans in samples."""
    if train_iters:
        decay_steps = (decay_iters or train_iters) * gbs
        warmup_steps = warmup_iters * gbs
        wsd_steps = wsd_iters * gbs if wsd_iters is not None else None
    else:
        decay_steps, warmup_steps, wsd_steps = decay_samples or train_samples, warmup_samples, wsd_samples
    return MegatronLMScheduler(lr, min_lr, warmup_steps, decay_steps, wsd_steps, style)


def build(argv: list[str]):
    cfg, _ = parse_args(MODEL + argv)
    run = resolve(cfg, world_size=1, vocab_size=100, device_type="cpu", family=GPT)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    return run, opt, make_lr_schedule(opt, run)


def lrs_of(schedule, opt, gbs: int, steps: int) -> list[float]:
    """The LR after each of ``steps`` applied optimizer steps, as DeepSpeed steps the scheduler."""
    out = []
    for _ in range(steps):
        if isinstance(schedule, ConsumedLRSchedule):
            schedule.begin_iteration(gbs, 0)
        schedule.step()
        assert opt.param_groups[0]["lr"] == schedule.get_lr()[0]
        out.append(opt.param_groups[0]["lr"])
    return out


# (flags beyond the style, the reference's arguments): warmup then stable then decay; a decay span shorter than
# training (min_lr after it); a WSD phase longer than what follows the warmup (upstream allows it: the LR
# drops when the warmup ends); no warmup; a samples run whose spans are no whole number of global batches
CASES = [
    ("--train-iters 24 --global-batch-size 4 --lr-warmup-iters 3 --lr-wsd-decay-iters 6",
     dict(gbs=4, train_iters=24, warmup_iters=3, wsd_iters=6), 24),
    ("--train-iters 30 --lr-decay-iters 20 --global-batch-size 4 --lr-warmup-iters 2 --lr-wsd-decay-iters 5",
     dict(gbs=4, train_iters=30, decay_iters=20, warmup_iters=2, wsd_iters=5), 30),
    ("--train-iters 12 --global-batch-size 3 --lr-warmup-iters 4 --lr-wsd-decay-iters 10",
     dict(gbs=3, train_iters=12, warmup_iters=4, wsd_iters=10), 12),
    ("--train-iters 16 --global-batch-size 2 --lr-wsd-decay-iters 16",
     dict(gbs=2, train_iters=16, wsd_iters=16), 16),
    ("--train-samples 150 --global-batch-size 6 --lr-warmup-samples 20 --lr-wsd-decay-samples 41",
     dict(gbs=6, train_samples=150, warmup_samples=20, wsd_samples=41), 25),
    ("--train-samples 200 --lr-decay-samples 130 --global-batch-size 8 --lr-warmup-samples 16 "
     "--lr-wsd-decay-samples 48",
     dict(gbs=8, train_samples=200, decay_samples=130, warmup_samples=16, wsd_samples=48), 25),
]


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("flags,ref_args,steps", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_wsd_equals_megatron_lm_at_every_step(style, flags, ref_args, steps):
    lr, min_lr = 3e-4, 3e-5
    run, opt, ours = build(f"--lr {lr} --min-lr {min_lr} --lr-decay-style WSD --lr-wsd-decay-style {style} "
                           f"{flags}".split())
    assert isinstance(ours, ConsumedLRSchedule) == ("train_samples" in ref_args)
    assert opt.param_groups[0]["lr"] == (0.0 if "warmup" in flags else lr)  # before the first step
    gbs = ref_args["gbs"]
    ref = megatron_lm_reference(lr=lr, min_lr=min_lr, style=style, **ref_args)
    expected = [ref.step(gbs) for _ in range(steps)]
    got = lrs_of(ours, opt, gbs, steps)
    # Warmup steps of an iteration-counted schedule whose global batch is no power of two may differ in the
    # last bit: max_lr * n / w here, max_lr * (n * gbs) / (w * gbs) upstream (rounded after another product).
    # Every step after the warmup (WSD's own arithmetic) is exact.
    warm = ref.lr_warmup_steps
    for i, (g, e) in enumerate(zip(got, expected)):
        if (i + 1) * gbs <= warm and not isinstance(ours, ConsumedLRSchedule) and gbs & (gbs - 1):
            assert abs(g - e) <= math.ulp(e), (i, g, e)
        else:
            assert g == e, (i, g, e)
    assert got[-1] == min_lr and any(min_lr < x < lr for x in got)  # it decayed, to --min-lr


def test_wsd_state_resumes_mid_decay_and_refuses_another_span():
    argv = "--lr 1e-3 --lr-decay-style WSD --lr-wsd-decay-style cosine --train-iters 20 --global-batch-size 2 " \
           "--lr-warmup-iters 2 --lr-wsd-decay-iters 8".split()
    _, opt, a = build(argv)
    lrs_of(a, opt, 2, 15)  # 3 steps into the 8-step decay
    state = a.state_dict()
    assert (state["wsd_decay_steps"], state["wsd_decay_style"]) == (8, "cosine")
    _, opt_b, b = build(argv)
    b.load_state_dict(state)
    assert opt_b.param_groups[0]["lr"] == a.get_lr()[0]
    assert lrs_of(b, opt_b, 2, 5) == lrs_of(a, opt, 2, 5)
    _, _, other = build(argv[:-1] + ["6"])
    with pytest.raises(ConfigError, match="wsd_decay_steps: checkpoint 8 vs now 6.*--override-lr-scheduler"):
        other.load_state_dict(state)
    # Megatron-LM's state_dict has no WSD keys: this run's span and style then hold
    megatron_state = {k: v for k, v in state.items() if not k.startswith("wsd_")}
    other.load_state_dict({**megatron_state, "decay_steps": 20})
    assert other.wsd_decay_steps == 6 and other.num_steps == 15
    # which wins, as Megatron-LM's _check_and_set: this run's (--override-opt_param-scheduler) or the checkpoint's
    for flag, span in (("--override-opt_param-scheduler", 6), ("--use-checkpoint-opt_param-scheduler", 8)):
        _, opt_c, chosen = build(argv[:-1] + ["6", flag])
        chosen.load_state_dict(state)
        assert chosen.wsd_decay_steps == span and chosen.num_steps == 15
        ref = megatron_lm_reference(lr=1e-3, min_lr=0.0, gbs=2, style="cosine", train_iters=20, warmup_iters=2,
                                    wsd_iters=span)
        ref.step(15 * 2)
        assert opt_c.param_groups[0]["lr"] == ref.get_lr()
    # a cosine checkpoint's state is unchanged by WSD's keys (older checkpoints load as before)
    plain = LRSchedule(opt, max_lr=1.0, min_lr=0.0, warmup_steps=0, decay_steps=10, decay_style="cosine")
    assert set(plain.state_dict()) == {"max_lr", "min_lr", "warmup_steps", "decay_steps", "decay_style", "num_steps"}


@pytest.mark.parametrize("flags,message", [
    ("--train-iters 10 --lr-decay-style WSD", "--lr-decay-style WSD needs --lr-wsd-decay-iters in an iteration-based"),
    ("--train-samples 40 --lr-decay-style WSD", "needs --lr-wsd-decay-samples in a --train-samples run"),
    ("--train-iters 10 --lr-decay-style WSD --lr-wsd-decay-iters 2 --lr-wsd-decay-samples 8",
     "--lr-wsd-decay-samples is not read in an iteration-based run"),
    ("--train-samples 40 --lr-decay-style WSD --lr-wsd-decay-samples 8 --lr-wsd-decay-iters 2",
     "--lr-wsd-decay-iters is not read in a --train-samples run"),
    ("--train-iters 10 --lr-decay-style WSD --lr-wsd-decay-iters 2 --lr-decay-tokens 1000",
     "WSD counts samples"),
    ("--train-iters 10 --lr-decay-style WSD --lr-wsd-decay-iters -1", "lr-wsd-decay-iters"),
])
def test_wsd_flags_refused_in_one_line(flags, message):
    with pytest.raises(ConfigError, match=message):
        build(f"--lr 1e-3 --global-batch-size 4 {flags}".split())


def test_wsd_flags_without_wsd_are_ignored_as_upstream():
    """get_optimizer_param_scheduler reads them only for the WSD style."""
    _, opt, s = build("--lr 1e-3 --train-iters 10 --global-batch-size 4 --lr-decay-style cosine "
                      "--lr-wsd-decay-iters 3 --lr-wsd-decay-style linear".split())
    assert s.decay_style == "cosine" and s.wsd_decay_steps is None


LR_LINE = re.compile(r"^ iteration\s+(\d+)/\s*\d+ \|.* learning rate: (\S+) \|", re.M)


def _train_runs(rank: int, world_size: int, argvs: list[list[str]]) -> list[tuple[list, str]]:
    """pretrain_gpt.py's body for each argv in turn in this process: (the (iteration, loss) history, stdout)."""
    import contextlib
    import io

    from megatron_ds.families import pretrain

    out = []
    for argv in argvs:
        cfg, ignored = parse_args(argv)
        text = io.StringIO()
        with contextlib.redirect_stdout(text):
            state = pretrain(cfg, ignored)
        out.append((state.history, text.getvalue()))
    return out


@pytest.mark.slow
def test_wsd_run_resumed_mid_decay_equals_the_straight_run(tmp_path):
    """The real training CLI on a Megatron-LM command line (no DeepSpeed JSON): 8 steps straight with a
    4-step cosine WSD decay at the end, vs 6 steps saved (2 into the decay), then loaded for the last 2.
    Losses are compared bitwise, the printed LRs with the transcribed formula at every iteration."""
    from tests.training.cli import SMALL_GPT

    lr, min_lr, gbs, iters = 2e-3, 2e-4, 4, 8
    argv = SMALL_GPT + (f"--lr {lr} --min-lr {min_lr} --lr-decay-style WSD --lr-wsd-decay-style cosine "
                        f"--lr-wsd-decay-iters 4 --lr-warmup-iters 2 --train-iters {iters} --global-batch-size {gbs} "
                        f"--hidden-dropout 0.1").split()
    ckpt = str(tmp_path / "ckpt")
    [straight, first, second] = run_distributed(_train_runs, 1, [
        argv, argv + ["--save", ckpt, "--save-interval", "100", "--exit-interval", "6"], argv + ["--load", ckpt]],
        timeout=600)[0]
    ref = megatron_lm_reference(lr=lr, min_lr=min_lr, gbs=gbs, style="cosine", train_iters=iters, warmup_iters=2,
                                wsd_iters=4)
    expected = [(str(i), f"{ref.step(gbs):.3E}") for i in range(1, iters + 1)]
    assert LR_LINE.findall(straight[1]) == expected
    assert LR_LINE.findall(first[1]) + LR_LINE.findall(second[1]) == expected
    assert [it for it, _ in second[0]] == [7, 8]
    assert first[0] + second[0] == straight[0]


SVG = Path(__file__).resolve().parents[2] / "docs" / "wsd-schedule.svg"
COLORS = {"exponential": "#1f77b4", "linear": "#ff7f0e", "cosine": "#2ca02c", "minus_sqrt": "#d62728"}


def schedule_svg() -> str:
    """docs/wsd-schedule.svg: for each WSD decay style, our schedule (a line through its LR after every
    iteration, built from the flags below) and Megatron-LM's formula (the transcription above, a dot per
    iteration). 100 iterations, 10 of warmup, the last 30 decaying from --lr 3e-4 to --min-lr 3e-5."""
    lr, min_lr, gbs, iters, warmup, wsd = 3e-4, 3e-5, 8, 100, 10, 30
    w, h, left, top, right, bottom = 640, 360, 60, 20, 20, 50
    x = lambda i: left + (w - left - right) * i / iters  # noqa: E731
    y = lambda v: top + (h - top - bottom) * (1 - v / lr)  # noqa: E731
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" '
             f'font-size="12">', f'<rect width="{w}" height="{h}" fill="white"/>',
             f'<path d="M{left},{top} V{h - bottom} H{w - right}" fill="none" stroke="black"/>']
    for i in range(0, iters + 1, 10):
        parts.append(f'<text x="{x(i):.1f}" y="{h - bottom + 16}" text-anchor="middle">{i}</text>')
    for v in (0.0, min_lr, lr / 2, lr):
        parts.append(f'<text x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.1e}</text>')
    parts.append(f'<text x="{(left + w - right) / 2}" y="{h - 16}" text-anchor="middle">iteration</text>')
    legend_x, legend_y = left + 60, top + 150  # below the stable phase, left of the decay
    for k, style in enumerate(STYLES):
        _, opt, ours = build(f"--lr {lr} --min-lr {min_lr} --lr-decay-style WSD --lr-wsd-decay-style {style} "
                             f"--train-iters {iters} --global-batch-size {gbs} --lr-warmup-iters {warmup} "
                             f"--lr-wsd-decay-iters {wsd}".split())
        got = [opt.param_groups[0]["lr"], *lrs_of(ours, opt, gbs, iters)]
        ref = megatron_lm_reference(lr=lr, min_lr=min_lr, gbs=gbs, style=style, train_iters=iters,
                                    warmup_iters=warmup, wsd_iters=wsd)
        expected = [ref.get_lr(), *(ref.step(gbs) for _ in range(iters))]
        assert got == expected, style
        c = COLORS[style]
        points = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(got))
        parts.append(f'<polyline points="{points}" fill="none" stroke="{c}" stroke-width="1.5"/>')
        parts += [f'<circle cx="{x(i):.1f}" cy="{y(v):.1f}" r="1.6" fill="{c}"/>' for i, v in enumerate(expected)
                  if i > iters - wsd - 2]  # the dots where the styles differ: the decay
        ly = legend_y + 16 * k
        parts.append(f'<line x1="{legend_x}" y1="{ly - 4}" x2="{legend_x + 20}" y2="{ly - 4}" stroke="{c}" '
                     f'stroke-width="1.5"/><text x="{legend_x + 26}" y="{ly}">--lr-wsd-decay-style {style}</text>')
    for j, line in enumerate((f"--lr-warmup-iters {warmup} --train-iters {iters} --lr-wsd-decay-iters {wsd}",
                              "line: megatron_ds; dots: Megatron-LM's formula")):
        parts.append(f'<text x="{legend_x}" y="{legend_y + 16 * (len(STYLES) + j)}">{line}</text>')
    return "\n".join(parts + ["</svg>", ""])


def test_wsd_plot_in_the_docs_is_current():
    assert SVG.read_text() == schedule_svg(), "run: python -m tests.training.test_wsd --write-svg"


if __name__ == "__main__":
    if sys.argv[1:] == ["--write-svg"]:
        SVG.write_text(schedule_svg())
