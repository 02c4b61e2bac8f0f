"""The time model against published A100 runs, row by row, each with its source (paper, table, row).

Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM" (SC21):
Table 1 is Megatron-LM's README table (tests/planner/test_planner.py, MEGATRON_TABLE), Table 2 (ZeRO-3 against
tensor + pipeline + data parallelism, PTD-P) below. Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models" (arXiv 2205.05198): Table 3's configurations, Table 4's per-layer times, Table 5's
iteration times and section 6.3's 8-way data parallel 530B run. All on Selene's DGX A100 80 GB nodes (8 GPUs, 8 x
HDR 200 Gb/s), seq 2048, GPT-2's vocabulary (51,200 padded), attention as unfused kernels (scores in memory);
SC21's Megatron (2021) waits for the backward TP all-reduces, Korthikanti et al.'s (2022) overlaps them with the
weight-gradient GEMMs (--async-tensor-model-parallel-allreduce). Every row must be within the regime's
``EXPECTED_ERROR`` (planner/one_layout.py), which docs/planner.md prints; pure arithmetic, ~5 s in all.
"""
from __future__ import annotations

import dataclasses
import functools
import re

import pytest

from megatron_ds.errors import ConfigError
from megatron_ds.families import get_family
from megatron_ds.planner.one_layout import EXPECTED_ERROR, error_text, parse_layout, regime, tie_groups
from megatron_ds.planner.plan_cli import evaluate_layout as one_layout
from megatron_ds.planner.time_model import stage_times


def evaluate_layout(argv, **layout):
    """A GPT layout evaluated (the planner takes its model family from the caller)."""
    return one_layout(argv, family=get_family("gpt"), **layout)

SHAPES = {"22B": (48, 6144, 64), "175B": (96, 12288, 96), "530B": (105, 20480, 128), "1T": (128, 25600, 160)}
ASYNC_TP = "--async-tensor-model-parallel-allreduce"


def argv(model: str, gpus: int, batch: int, *extra: str) -> list[str]:
    layers, hidden, heads = SHAPES[model]
    return [*f"--gpu-type a100-80 --gpus {gpus} --num-layers {layers} --hidden-size {hidden} --num-attention-heads "
            f"{heads} --seq-length 2048 --max-position-embeddings 2048 --global-batch-size {batch} --fp16 "
            "--unfused-attention".split(), *extra]


def megatron_model_flops(model: str, batch: int) -> float:
    """Model FLOPs of an iteration as Korthikanti et al. count them for MFU (their section 6.3, without recompute):
    72 B s l h^2 (1 + s / 6h + V / 12 l h), computed here apart from the family's count."""
    layers, h, _ = SHAPES[model]
    s, v = 2048, 51200
    return 72 * batch * s * layers * h * h * (1 + s / (6 * h) + v / (12 * layers * h))


# SC21 Table 2 (section 5.2): (model, GPUs, global batch, micro batch, TFLOP/s per GPU); ZeRO-3 without model
# parallelism, and PTD-P at model-parallel size 96 (TP 8 x PP 12) for 175B and 280 (TP 8 x PP 35) for 530B, micro
# batch 1, all with activation recompute. The 530B ZeRO-3 run did not fit 560 GPUs at micro batch 4, so it ran on
# 640 GPUs at global batch 2560 (the table's starred row); the other 530B runs at 2240.
ZERO3 = [("175B", 384, 1536, 4, 144), ("175B", 768, 1536, 2, 88), ("175B", 1536, 1536, 1, 44),
         ("530B", 640, 2560, 4, 138), ("530B", 1120, 2240, 2, 98), ("530B", 2240, 2240, 1, 48)]
PTDP = [("175B", 384, 1536, 153), ("175B", 768, 1536, 149), ("175B", 1536, 1536, 141),
        ("530B", 560, 2240, 171), ("530B", 1120, 2240, 167), ("530B", 2240, 2240, 159)]
PTDP_LAYOUT = {"175B": (8, 12), "530B": (8, 35)}


@functools.cache
def zero3(model, gpus, batch, mb):
    return evaluate_layout(argv(model, gpus, batch), tp=1, pp=1, mb=mb, zero=3, recompute="full")


@functools.cache
def ptdp(model, gpus, batch):
    """The PTD-P run's fastest interleaving (the table does not give it; section 5.1: SC21's runs use the interleaved
    schedule with the scatter/gather optimization), as the Table 1 test takes each layout's fastest variant."""
    tp, pp = PTDP_LAYOUT[model]
    per_rank = SHAPES[model][0] // pp
    return max((evaluate_layout(argv(model, gpus, batch), tp=tp, pp=pp, mb=1, zero=0, recompute="full", v=v)
                for v in (1, 2, 3, 4) if per_rank % v == 0), key=lambda ev: ev.time.tflops_per_gpu)


@pytest.mark.parametrize("row", ZERO3, ids=lambda r: f"{r[0]}-{r[1]}")
def test_sc21_table2_zero3(row):
    model, gpus, batch, mb, measured = row
    ev = zero3(model, gpus, batch, mb)
    assert regime(ev.layout) == "zero-3"
    assert ev.time.tflops_per_gpu == pytest.approx(measured, rel=EXPECTED_ERROR["zero-3"])


@pytest.mark.parametrize("row", PTDP, ids=lambda r: f"{r[0]}-{r[1]}")
def test_sc21_table2_ptdp(row):
    model, gpus, batch, measured = row
    ev = ptdp(model, gpus, batch)
    assert regime(ev.layout) == "ptd-p"
    assert ev.time.tflops_per_gpu == pytest.approx(measured, rel=EXPECTED_ERROR["ptd-p"])


def test_sc21_table2_ptdp_ahead_of_zero3():
    """Wherever the paper measured PTD-P ahead of ZeRO-3 (every GPU count of both models), so does the model."""
    ptdp_rows = {(m, g): row for m, g, *row in PTDP}
    for model, gpus, batch, mb, _ in ZERO3:
        near = min((g for m, g in ptdp_rows if m == model), key=lambda g: abs(g - gpus))  # 640 against 560
        assert ptdp(model, near, ptdp_rows[(model, near)][0]).time.tflops_per_gpu > zero3(
            model, gpus, batch, mb).time.tflops_per_gpu


# Korthikanti et al. Table 3: (model, TP, PP, GPUs, global batch, micro batch); section 6: the 175B and 530B runs
# use the interleaved schedule with three model chunks per rank; Table 5: iteration seconds with full recompute (no
# sequence parallelism) and with selective recompute + sequence parallelism.
KORTHIKANTI = [("22B", 8, 1, 8, 4, 4, 1.42, 1.10), ("175B", 8, 8, 64, 64, 1, 18.13, 13.75),
               ("530B", 8, 35, 280, 280, 1, 49.05, 37.83), ("1T", 8, 64, 512, 512, 1, 94.42, 71.49)]
CHUNKS = {"175B": 3, "530B": 3}


@functools.cache
def korthikanti(model, tp, pp, gpus, batch, mb, recompute):
    return evaluate_layout(argv(model, gpus, batch, ASYNC_TP), tp=tp, pp=pp, mb=mb, zero=0, recompute=recompute,
                           seq_par=recompute == "selective", v=CHUNKS.get(model, 1))


@pytest.mark.parametrize("row", KORTHIKANTI, ids=lambda r: r[0])
def test_korthikanti_table5(row):
    model, tp, pp, gpus, batch, mb, full_s, selective_s = row
    for recompute, measured in (("full", full_s), ("selective", selective_s)):
        ev = korthikanti(model, tp, pp, gpus, batch, mb, recompute)
        assert ev.time.step_s == pytest.approx(measured, rel=EXPECTED_ERROR[regime(ev.layout)])
        # the MFU the paper prints for the selective runs (41.5 / 51.4 / 56.0 / 56.3%) is this FLOP count's
        if recompute == "selective":
            mfu = megatron_model_flops(model, batch) / measured / gpus / 312e12
            assert mfu == pytest.approx({"22B": 0.415, "175B": 0.514, "530B": 0.560, "1T": 0.563}[model], abs=0.002)


SECTION_6_3 = (("selective", 39.15), ("full", megatron_model_flops("530B", 2240) / 0.421 / 2240 / 312e12))


def test_korthikanti_section_6_3_data_parallel():
    """530B on 2,240 GPUs (8-way data parallelism, the batch per model instance kept): 39.15 s per iteration with
    selective recompute + SP against Table 5's 37.83 on 280 GPUs (section 6.3, gradients all-reduced after the
    backward, not overlapped), and 42.1% MFU with full recompute (the abstract)."""
    for recompute, measured in SECTION_6_3:
        ev = korthikanti("530B", 8, 35, 2240, 2240, 1, recompute)
        assert ev.time.step_s == pytest.approx(measured, rel=EXPECTED_ERROR[regime(ev.layout)])
    # the data parallel reduction's share: 1.32 of 39.15 s measured
    assert 0.01 <= ev.time.dp_comm_s / ev.time.step_s <= 0.05


# Korthikanti et al. Table 4: one transformer layer of the 22B model (TP 8, micro batch 4), forward and backward ms.
TABLE4 = [("baseline, no recompute", None, False, 7.7, 11.9), ("sequence parallelism", None, True, 7.2, 11.8),
          ("full recompute", "full", False, 7.7, 19.5), ("selective recompute", "selective", False, 7.7, 13.2),
          ("selective recompute + sequence parallelism", "selective", True, 7.2, 13.1)]


@functools.cache
def table4_layer(recompute, seq_par):
    """(forward ms, backward + recompute ms) of one 22B layer."""
    ev = evaluate_layout(argv("22B", 8, 4, ASYNC_TP), tp=8, pp=1, mb=4, recompute=recompute, seq_par=seq_par)
    cache: dict = {}  # stage_times leaves one layer's (forward, backward, recompute) under its expert count, 1
    stage_times(ev.layout, ev.gpu, ev.layout.stages[0], flash=False, layer_cache=cache)
    f, b, r = cache[1]
    return 1e3 * f.total, 1e3 * (b.total + r.total)


@pytest.mark.parametrize("row", TABLE4, ids=lambda r: r[0])
def test_korthikanti_table4_layer(row):
    _, recompute, seq_par, forward_ms, backward_ms = row
    err = EXPECTED_ERROR["no-recompute" if recompute != "full" else "ptd-p"]
    forward, backward = table4_layer(recompute, seq_par)
    assert forward == pytest.approx(forward_ms, rel=err)
    assert backward == pytest.approx(backward_ms, rel=err)


def test_expected_errors_are_the_largest_published():
    """The error each prediction is printed with is the largest error of its regime over these tables (rounded up to
    the next percent or so), not a number picked apart from them; SC21 Table 1 (test_planner.py) stays within 5%."""
    errors: dict = {"ptd-p": [], "no-recompute": [], "zero-3": []}
    for model, gpus, batch, mb, measured in ZERO3:
        errors["zero-3"].append(zero3(model, gpus, batch, mb).time.tflops_per_gpu / measured - 1)
    for model, gpus, batch, measured in PTDP:
        errors["ptd-p"].append(ptdp(model, gpus, batch).time.tflops_per_gpu / measured - 1)
    runs = [(row[:6], recompute, measured) for row in KORTHIKANTI for recompute, measured in zip(
        ("full", "selective"), row[6:])] + [(("530B", 8, 35, 2240, 2240, 1), r, m) for r, m in SECTION_6_3]
    for config, recompute, measured in runs:
        ev = korthikanti(*config, recompute)
        errors[regime(ev.layout)].append(ev.time.step_s / measured - 1)
    for _, recompute, seq_par, forward_ms, backward_ms in TABLE4:
        forward, backward = table4_layer(recompute, seq_par)
        errors["ptd-p" if recompute == "full" else "no-recompute"] += [forward / forward_ms - 1,
                                                                       backward / backward_ms - 1]
    for name, errs in errors.items():
        largest = max(map(abs, errs))
        assert largest <= EXPECTED_ERROR[name] <= largest + 0.015, (name, largest)


def test_layout_breakdown_cli(capsys):
    """tools/plan.py --layout prints one layout's terms; they and the library's add up to the predicted step."""
    from megatron_ds.families import get_family  # noqa: PLC0415
    from megatron_ds.planner import plan_cli  # noqa: PLC0415

    args = argv("175B", 384, 1536)
    assert plan_cli.main(args + ["--layout", "tp=8,pp=12,mb=1,zero=0,recompute=full"], family=get_family("gpt")) == 0
    out = capsys.readouterr().out
    assert "DP 4, 384 micro-batches per step" in out and "expected error +-8% (ptd-p regime" in out
    ev = evaluate_layout(args, tp=8, pp=12, mb=1, zero=0, recompute="full")
    t = ev.time
    # the critical path: every micro-batch's work on the slowest stage, the bubble, then what is exposed after it
    assert sum(ev.terms().values()) == pytest.approx(t.step_s, rel=1e-9)
    for name, seconds in ev.terms().items():
        assert re.search(rf"{re.escape(name)}\s+{seconds:.3f}", out)
    with pytest.raises(ConfigError, match="cannot read 'tq=8'"):
        parse_layout("tq=8")
    with pytest.raises(ConfigError, match="leave DP 4"):
        evaluate_layout(args, tp=8, pp=12, dp=8, recompute="full")


def test_hopper_error_is_unknown_and_ties_group():
    """On H200 no published multi-GPU run was measured: the error is said to be unknown. Predictions within the
    expected error of the group's fastest are one tie group; one beyond it starts the next."""
    ev = evaluate_layout(["--gpu-type", "h200", "--gpus", "64", *argv("175B", 64, 64)[4:]], tp=8, pp=8,
                         recompute="full")
    assert ev.expected_error is None and "unknown on h200 until measured" in error_text(ev.layout, ev.gpu)
    base = ptdp("175B", 384, 1536).candidate
    err = EXPECTED_ERROR["ptd-p"]

    def at(step):
        return dataclasses.replace(base, time=dataclasses.replace(base.time, step_s=step))
    assert tie_groups([at(1.0), at(1.0 + err), at((1 + err) / (1 - err) * 1.01), at(1.3)]) == [1, 1, 2, 2]


def test_efficiency_bounded_by_what_the_gpu_reached():
    """Issue 45's case: a 176B model (BLOOM's shape, GPT layers) on 512 A100 80 GB without recompute. The terms
    alone predict ~59% of peak for TP 8 x PP 2 with SP; no published A100 run passed 57% (Korthikanti et al. Table 5,
    hardware FLOPs), so the step is held to that and the difference shown as its own term."""
    args = ("--gpu-type a100-80 --gpus 512 --num-layers 70 --hidden-size 14336 --num-attention-heads 112 "
            "--seq-length 2048 --max-position-embeddings 2048 --global-batch-size 2048 --bf16").split()
    ev = evaluate_layout(args, tp=8, pp=2, mb=2, seq_par=True)
    t = ev.time
    assert t.mfu == pytest.approx(0.57) and t.bound_s > 0.01 * t.step_s
    assert sum(ev.terms().values()) == pytest.approx(t.step_s, rel=1e-9)
