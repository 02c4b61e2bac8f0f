"""The parallelism planner (planner/search.py, planner/time_model.py, tools/plan.py).

Its time model against measured throughput: this project's own on an H200 (bench/RESULTS.md) and
Megatron-LM's published runs (transcribed below with their source); its plans against --dry-run
(every sampled printed layout resolves and fits there, with the same memory estimate) and against
the ABCI job scripts' own DRY_RUN (the written script asks for the planned layout).
"""
from __future__ import annotations

import contextlib
import importlib.util
import io
import re
from pathlib import Path

import pytest

from megatron_ds.config.memory import estimate_memory
from megatron_ds.families import get_family, main as pretrain_main
from megatron_ds.parallel.schedules import pipeline_schedule, simulate_step_time, zbh1_schedule
from megatron_ds.planner import plan_cli
from megatron_ds.planner.one_layout import EXPECTED_ERROR, regime
from megatron_ds.planner import search as planner
from megatron_ds.planner.job_script import write_job_script
from megatron_ds.planner.time_model import gemm_seconds, layer_forward, make_cluster, pipeline_time, zbh1_time

ROOT = Path(__file__).resolve().parents[2]
GPT = get_family("gpt")


def _plan(argv):
    request, flags, opts = plan_cli.request_of(argv, GPT, "plan.py")
    return request, flags, opts, planner.plan(request)


def test_h200_measurements_reproduced():
    """bench/RESULTS.md, `make gpu-report` with `--compile-layers` (the default on CUDA): GPT 1.3B
    451.5 and Llama-style 1.3B 402.9 TFLOP/s on one H200 (bf16, seq 2048, micro batch 4, dropout 0).
    The model has the Llama-style run 12% fast: it counts RoPE and RMSNorm as the same memory-bound
    passes as the GPT's bias and LayerNorm, which the measured step does not (docs/planner.md)."""
    base = ("--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 --micro-batch-size 4 "
            "--global-batch-size 4 --bf16 --hidden-dropout 0 --attention-dropout 0 --gpu-type h200 --gpus 1 "
            "--deepspeed_config ds_configs/zero0_bf16.json").split()
    llama = ("--use-rotary-position-embeddings --swiglu --normalization rmsnorm --disable-bias-linear "
             "--untie-embeddings-and-output-weights --ffn-hidden-size 5504").split()
    for extra, measured, within in (([], 451.5, 0.05), (llama, 402.9, 0.15)):
        request, flags, _, _ = _plan_request(base + extra)
        cand, _ = plan_cli.your_layout(request, flags)
        assert cand.time.tflops_per_gpu == pytest.approx(measured, rel=within)


def _plan_request(argv):
    with contextlib.chdir(ROOT):
        request, flags, opts = plan_cli.request_of(argv, GPT, "plan.py")
    return request, flags, opts, None


# Megatron-LM's README (its 2021-22 revisions, "Training Speed and Scalability"; the same runs as
# Narayanan et al., SC21, Table 1): GPT models, seq 2048, vocabulary 51,200, on Selene's DGX A100
# 80 GB nodes (8 GPUs, 8 x HDR InfiniBand 200 Gb/s); planned with the software of those runs: fp16,
# full activation recompute, no ZeRO, no ZB-H1, sequence parallelism or uneven stages (later work), the attention
# of the time (scores in memory): (billions, heads, hidden, layers, TP, PP, GPUs, batch,
# achieved TFLOP/s per GPU).
MEGATRON_TABLE = [(1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
                  (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18, 48, 6144, 40, 8, 1, 256, 1024, 135),
                  (39, 64, 8192, 48, 8, 2, 512, 1536, 138), (76, 80, 10240, 60, 8, 4, 1024, 1792, 140),
                  (145, 96, 12288, 80, 8, 8, 1536, 2304, 148), (310, 128, 16384, 96, 8, 16, 1920, 2160, 155),
                  (530, 128, 20480, 105, 8, 35, 2520, 2520, 163), (1000, 160, 25600, 128, 8, 64, 3072, 3072, 163)]


@pytest.mark.parametrize("row", MEGATRON_TABLE, ids=lambda r: f"{r[0]}B")
def test_megatron_published_runs(row):
    """Each published layout's fastest variant (micro batch, chunks; SC21 section 5.1: interleaved with scatter/gather)
    within 5%, inside the PTD-P regime's expected error. Where
    it ranks is not asserted: the published layouts were chosen by heuristics, not searched (SC21 says so), and the
    alternatives the model prefers are mostly ties within that error (``evaluate.tie_groups``)."""
    size, heads, hidden, layers, tp, pp, gpus, batch, achieved = row
    argv = (f"--gpu-type a100-80 --gpus {gpus} --num-layers {layers} --hidden-size {hidden} "
            f"--num-attention-heads {heads} --seq-length 2048 --max-position-embeddings 2048 "
            f"--global-batch-size {batch} --fp16 --plan-zero 0 --plan-recompute full --unfused-attention "
            "--plan-without zbh1,sequence-parallel,ulysses,uneven-stages,context-parallel").split()
    _, _, _, result = _plan(argv)
    published = next(c for c in result.ranked if (c.knobs.tp, c.knobs.pp) == (tp, pp))
    assert regime(published.layout) == "ptd-p"
    assert published.time.tflops_per_gpu == pytest.approx(achieved, rel=EXPECTED_ERROR["ptd-p"])
    assert published.time.tflops_per_gpu == pytest.approx(achieved, rel=0.05)  # issue 45's bound for this table
    assert result.seconds < 60  # the 1T, 3,072-GPU question included (~4 s on a laptop core)


def test_pipeline_closed_forms_are_the_schedule_simulation():
    """``pipeline_time`` (1F1B) and ``zbh1_time`` against the step lists ``simulate_step_time`` runs."""
    for pp, m in ((4, 8), (8, 3), (2, 16), (8, 32)):
        simulated = simulate_step_time([pipeline_schedule(pp, r, m) for r in range(pp)], f=1.0, b=2.0, w=0.0)
        assert pipeline_time([3.0] * pp, m, 1) == pytest.approx(simulated)
        for f, b, w in ((1.0, 1.0, 1.0), (1.0, 1.2, 0.8), (1.0, 2.0, 1.0)) if m >= pp else ():
            zb = simulate_step_time([zbh1_schedule(pp, r, m, exact=False) for r in range(pp)], f=f, b=b, w=w)
            assert zbh1_time([f + b + w] * pp, [f + b - w] * pp, m) == pytest.approx(zb)


MOE_PLAN = ("--gpu-type h100 --gpus 16 --num-layers 8 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 "
            "--global-batch-size 64 --bf16 --num-experts 8 --plan-recompute none").split()


def _moe_candidates(extra: list[str]):
    """(request, its candidates) of the MoE GPT of ``MOE_PLAN`` with ``extra``; every EP size is enumerated."""
    with contextlib.chdir(ROOT):
        request, _, _ = plan_cli.request_of(MOE_PLAN + extra, GPT, "plan.py")
        found = planner.candidates(request)
    assert {c.knobs.ep for c in found} == {1, 2, 4, 8}
    assert all(c.layout.ep == c.knobs.ep for c in found)
    return request, found


def test_moe_plan_splits_experts():
    """A mixture-of-experts GPT: layouts with expert parallelism are enumerated and resolve."""
    _, found = _moe_candidates(["--create-moe-param-group", "--plan-micro-batch", "1,2"])
    assert "--moe-expert-parallel-size" in next(c for c in found if c.knobs.ep > 1).knobs.flags()


def test_upstream_moe_plan_splits_experts_by_its_own_flag():
    """An upstream Megatron-LM MoE line (no --deepspeed: --num-experts builds Megatron-LM's layer, top-2): its
    layouts split the experts by --expert-model-parallel-size (DeepSpeed-MoE's flag would be a second MoE layer's,
    refused), and the time model runs each token through top-2 experts, not DeepSpeed-MoE's top-1: the MLP GEMMs
    of the top-2 line take twice those of the same line at top-1."""
    base = ["--plan-micro-batch", "1"]
    request, found = _moe_candidates(base)
    assert all(c.layout.model.moe_router_topk == 2 for c in found)
    wide = next(c for c in found if c.knobs.ep == 2 and c.knobs.tp == 1 and c.knobs.pp == 1)
    assert wide.knobs.flags()[-2:] == ["--expert-model-parallel-size", "2"]
    with contextlib.chdir(ROOT):
        top1_line = plan_cli.request_of(MOE_PLAN + base + ["--moe-router-topk", "1", "--moe-router-pre-softmax"], GPT,
                                        "plan.py")[0]
        top1 = planner.evaluate(top1_line, wide.knobs)
    assert top1.layout.model.moe_router_topk == 1
    gpu = request.cluster.gpu
    two, one = (layer_forward(c.layout, gpu, 8)[0].matmul for c in (wide, top1))
    # one expert MLP of a micro-batch's 1024 tokens: 1024 -> 4096 -> 1024 (GeLU, 4h)
    expert = gemm_seconds(gpu, 1024, 4096, 1024) + gemm_seconds(gpu, 1024, 1024, 4096)
    assert two - one == pytest.approx(expert, rel=1e-9)


@pytest.fixture(scope="module")
def abci_13b():
    """The ABCI tutorial's case: GPT 13B on 8 rt_F nodes (32 x V100 16 GB); the global batch and
    sequence length of GPT-3 13B in Megatron-DeepSpeed's examples_deepspeed size tables (1024 x 2048)."""
    argv = ("--resource rt_F --nodes 8 --model-size 13B --seq-length 2048 --max-position-embeddings 2048 "
            "--global-batch-size 1024 --fp16 --tensor-model-parallel-size 4 --pipeline-model-parallel-size 8 "
            "--micro-batch-size 1 --checkpoint-activations --zero-stage 1").split()
    with contextlib.chdir(ROOT):
        request, flags, opts = plan_cli.request_of(argv, GPT, "plan.py")
        lines, result = plan_cli.report(request, flags, opts, argv)
    return argv, request, lines, result


def test_abci_13b_tutorial_layout(abci_13b):
    _, request, lines, result = abci_13b
    yours = next(line for line in lines if line.startswith("your layout"))
    assert yours.startswith("your layout: TP 4 x PP 8, micro batch 1, recompute full, ZeRO 1:") and " fits;" in yours
    assert (4, 8) in [(c.knobs.tp, c.knobs.pp) for c in result.ranked]
    why = lines[-1]
    assert "is predicted" in why and "faster than TP 4 x PP 8, micro batch 1, recompute full" in why
    assert "recompute +" in why  # the tutorial's layout pays for its recompute


def test_printed_layouts_pass_dry_run(abci_13b, capsys):
    """Three of the printed layouts, each through pretrain_gpt.py --dry-run with its flags: it
    resolves, fits the 16 GB, and its memory estimate is the plan's."""
    argv, request, _, result = abci_13b
    shown = result.ranked[:5]
    base = planner.strip_knobs(argv, planner.KNOB_FLAGS_WITH_VALUE + ("--resource", "--nodes", "--model-size"))
    base += ["--num-layers", "40", "--hidden-size", "5120", "--num-attention-heads", "40"]
    for cand in (shown[0], shown[len(shown) // 2], shown[-1]):
        flags = base + planner.flags_of(request, cand.knobs) + [
            "--dry-run", "--mock-data", "--world-size", "32", "--gpu-memory-gb", "rt_F", "--lr", "1e-4",
            "--train-iters", "10"]
        with contextlib.chdir(ROOT):
            assert pretrain_main(flags, family=GPT) == 0
        out = capsys.readouterr().out
        total = float(re.search(r"^memory per GPU .*; total ([\d.]+) of 16 GB: fits", out, re.M).group(1))
        assert total == pytest.approx(cand.memory.total / 1e9, abs=0.006)


def test_derived_variants_are_what_resolve_gives():
    """The plan resolves one layout per structure and derives the micro batch / recompute variants;
    each derived one (interleaved, ZB-H1, Ulysses, selective recompute among them) has the memory
    estimate and step time the full resolution gives."""
    argv = ("--resource rt_HF --nodes 4 --model-size 13B --seq-length 4096 --max-position-embeddings 4096 "
            "--global-batch-size 256 --bf16 --plan-recompute none,selective").split()
    with contextlib.chdir(ROOT):
        request, _, _ = plan_cli.request_of(argv, GPT, "plan.py")
        found = planner.candidates(request)
    kinds = {}
    for c in found:
        k = c.knobs
        kind = "zb" if k.zbh1 else "v" if k.v > 1 else "ulysses" if k.sp > 1 else "sp" if k.seq_par else "plain"
        if k.mb > 1 and (kind, k.recompute) not in kinds:
            kinds[(kind, k.recompute)] = c
    assert len(kinds) == 10
    for c in kinds.values():
        resolved = planner.evaluate(request, c.knobs)
        assert estimate_memory(c.layout).total == pytest.approx(resolved.memory.total, rel=1e-12)
        assert c.time.step_s == pytest.approx(resolved.time.step_s, rel=1e-12)


def _abci_numbers():
    spec = importlib.util.spec_from_file_location("abci_numbers", ROOT / "scripts" / "abci" / "abci_numbers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_written_job_script_runs_the_plan(tmp_path):
    """The job script for the best layout of a GPT 1.3B on 2 x rt_HF: its DRY_RUN passes the layout."""
    argv = ("--resource rt_HF --nodes 2 --model-size 1.3B --seq-length 2048 --global-batch-size 512 "
            "--bf16 --top 3").split()
    with contextlib.chdir(ROOT):
        request, flags, opts = plan_cli.request_of(argv, GPT, "plan.py")
        best = planner.plan(request).ranked[0]
    script = tmp_path / "plan_gpt.sh"
    write_job_script(str(script), best, request, argv)
    text = script.read_text()
    assert "#PBS -q rt_HF" in text and "#PBS -l select=2:mpiprocs=8" in text
    numbers = _abci_numbers()
    recorded = numbers.dry_run_argv(str(script), {})
    run, budget = numbers.resolved(recorded)
    lay = run.layout
    assert (lay.tp, lay.pp, lay.micro_batch_size, lay.zero_stage, lay.recompute, lay.sequence_parallel,
            lay.world_size) == (best.knobs.tp, best.knobs.pp, best.knobs.mb, best.knobs.zero, best.knobs.recompute,
                                best.knobs.seq_par, 16)
    assert budget == 141e9


def test_grid_engine_script_for_abci2(abci_13b, tmp_path):
    _, request, _, result = abci_13b
    script = tmp_path / "gpt13b.sh"
    write_job_script(str(script), result.ranked[0], request, abci_13b[0])
    text = script.read_text()
    assert "#$ -l rt_F=8" in text and "\nset_job_defaults fp16" in text
    k = result.ranked[0].knobs
    assert f"TP=${{TP:-{k.tp}}}" in text and f"PP=${{PP:-{k.pp}}}" in text
    assert f"ZERO_STAGE=${{ZERO_STAGE:-{k.zero}}}" in text


def test_unknown_flag_is_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        plan_cli.main(["--resource", "rt_HF", "--nodes", "1", "--model-size", "1.3B", "--seq-length", "2048",
                       "--global-batch-size", "8", "--bf16", "--no-such-flag"], family=GPT)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert any("unrecognized arguments: --no-such-flag" in line for line in err)


def test_v100_refuses_bf16():
    with io.StringIO() as err, contextlib.redirect_stderr(err):
        assert plan_cli.main(["--resource", "rt_F", "--nodes", "1", "--model-size", "350M", "--seq-length", "1024",
                              "--global-batch-size", "8", "--bf16"], family=GPT) == 1
        assert "no bf16" in err.getvalue()


def test_cluster_from_a_gpu_count():
    cluster = make_cluster(gpu="a100-80", gpus=64, resource=None, nodes=None)
    assert (cluster.gpus_per_node, cluster.nodes, cluster.world_size) == (8, 8, 64)


def test_bloom_176b_is_planned_on_uneven_stages():
    """BLOOM 176B's shape (70 layers, hidden 14336, 112 heads, vocabulary 250880, seq 2048, global batch 2048)
    on its 384 A100 80 GB: no PP > 2 that fits 8-GPU nodes divides 70 layers, so the plan needs stages of
    unequal layers (BigScience ran TP 4 x PP 12 x DP 8 with --pp-partition-method 'type:transformer|embedding':
    72 "layers" with the embedding and the tied output layer, 6 per stage, 5 transformer layers on the ends)."""
    argv = ("--gpu-type a100-80 --gpus 384 --num-layers 70 --hidden-size 14336 --num-attention-heads 112 "
            "--seq-length 2048 --max-position-embeddings 2048 --global-batch-size 2048 --bf16 --vocab-size 250880 "
            "--plan-recompute full --plan-micro-batch 1,2").split()
    with contextlib.chdir(ROOT):
        request, _, _, result = _plan(argv)
        bloom = planner.evaluate(request, planner.Knobs(4, 12, mb=2, recompute="full",
                                                        partition=planner.UNEVEN_PARTITION))
    assert any(70 % c.knobs.pp for c in result.ranked)
    assert [s.layers[1] - s.layers[0] for s in bloom.layout.stages] == [5] + [6] * 10 + [5]
    assert bloom.memory.total <= 80e9
    assert "'type:transformer|embedding'" in " ".join(plan_cli.shlex.quote(f) for f in planner.flags_of(
        request, bloom.knobs))
