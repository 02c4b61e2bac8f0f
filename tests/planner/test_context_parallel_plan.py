"""Issue 46: the planner enumerates context parallelism (--context-parallel-size) with its activation saving (the
memory estimate's, config/memory.py) and its ring's cost (planner/time_model.py). Pure arithmetic, ~5 s."""
from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import pytest

from megatron_ds.config.memory import estimate_memory
from megatron_ds.families import get_family
from megatron_ds.planner import plan_cli
from megatron_ds.planner import search as planner
from megatron_ds.planner.plan_cli import evaluate_layout as one_layout
from megatron_ds.planner.time_model import (LATENCY_S, LINK_EFF, context_parallel_seconds, cp_attention_share,
                                            data_parallel_seconds, find_gpu, make_cluster)


def evaluate_layout(argv, **layout):
    """A GPT layout evaluated (the planner takes its model family from the caller)."""
    return one_layout(argv, family=get_family("gpt"), **layout)

ROOT = Path(__file__).resolve().parents[2]
# a 7B-shaped GPT at 32k tokens on 4 H100 nodes: the sequence is what fills the memory
LONG = ("--gpu-type h100 --gpus 32 --num-layers 32 --hidden-size 4096 --num-attention-heads 32 --seq-length 32768 "
        "--max-position-embeddings 32768 --global-batch-size 64 --bf16").split()


def test_cp_attention_share_counts_the_visible_blocks():
    """Each rank's share of the s x s scores, against an enumeration of the 2 CP chunks' (query, key) blocks the
    causal mask leaves (rank r holds chunks r and 2 CP - 1 - r)."""
    for cp in (2, 4, 8):
        chunks = 2 * cp
        for r in range(cp):
            blocks = sum(k <= q for q in (r, chunks - 1 - r) for k in range(chunks))
            assert blocks / chunks ** 2 == pytest.approx(cp_attention_share(cp, causal=True))
        assert cp_attention_share(cp, causal=False) == 1 / cp


def test_planner_enumerates_context_parallelism():
    with contextlib.chdir(ROOT):
        request, _, _ = plan_cli.request_of(LONG + ["--plan-micro-batch", "1", "--plan-recompute", "none"],
                                            get_family("gpt"), "plan.py")
        found = planner.candidates(request)
    cps = {c.knobs.cp for c in found}
    assert {2, 4, 8} <= cps and all(c.layout.cp == c.knobs.cp for c in found)
    assert all(c.knobs.sp == 1 for c in found if c.knobs.cp > 1)  # Ulysses and CP split the same sequence
    assert any(c.knobs.zbh1 for c in found if c.knobs.cp > 1)  # ZB-H1 runs with CP
    assert "--context-parallel-size" in planner.flags_of(request, next(c.knobs for c in found if c.knobs.cp > 1))


@pytest.fixture(scope="module")
def cp_layouts():
    with contextlib.chdir(ROOT):
        return {cp: evaluate_layout(LONG, tp=4, pp=1, mb=1, zero=1, seq_par=True, cp=cp) for cp in (1, 2)}


def test_context_parallelism_saves_activations(cp_layouts):
    """CP 2 halves each rank's tokens: the estimate's activations halve; weights, gradients and (ZeRO 1 over the
    same DP x CP = 8 ranks) optimizer states stay."""
    one, two = (dict(estimate_memory(cp_layouts[c].layout).terms) for c in (1, 2))
    assert two["activations"] == pytest.approx(one["activations"] / 2)
    for term in ("weights", "gradients", "optimizer states"):
        assert two[term] == one[term]
    assert cp_layouts[2].candidate.memory.total < cp_layouts[1].candidate.memory.total


def test_context_parallel_ring_and_reduction(cp_layouts):
    ev = cp_layouts[2]
    lay, gpu = ev.layout, ev.gpu
    # this rank's K and V (32 heads / TP 4, 128 channels, 16-bit) travel CP - 1 hops; nothing to hide behind
    kv = 2 * 2 * 1 * 32768 / 2 * (32 / 4) * 128
    hop = kv / (gpu.nvlink_gbs * 1e9 * LINK_EFF) + LATENCY_S
    assert context_parallel_seconds(lay, gpu, 0.0, 8, 50.0) == pytest.approx((hop, 2 * hop))
    # TP 4 x CP 4 = 16 ranks leave the node: the GPU's share of the network carries the hops
    wide = dataclasses.replace(lay, cp=4)
    hop4 = 2 * 2 * 32768 / 4 * 8 * 128 / (50.0 * 1e9 * LINK_EFF) + LATENCY_S
    assert context_parallel_seconds(wide, gpu, 0.0, 8, 50.0)[0] == pytest.approx(3 * hop4)
    # a long enough attention hides the forward ring
    assert context_parallel_seconds(lay, gpu, 1.0, 8, 50.0) == (0.0, 0.0)
    # the gradients reduce over DP x CP (parallel/groups.py): as DP 8 without CP
    cluster = make_cluster(gpu="h100", gpus=32, resource=None, nodes=None)
    flat = dataclasses.replace(lay, cp=1, dp=lay.dp * 2)
    assert data_parallel_seconds(lay, cluster, 10**9, 0.0) == pytest.approx(data_parallel_seconds(flat, cluster, 10**9,
                                                                                                   0.0))
    assert find_gpu("h100") == gpu
