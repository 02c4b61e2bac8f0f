"""bench/gpu_report.py: the kernel families and trace reading on known names, the budget skipping what
does not fit, and (slow) the whole --smoke report on the CPU with every section present."""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SECTIONS = ("# GPU report", "- device: ", "- versions: torch ", "deepspeed ", "liger-kernel ", "transformers ",
            "- date: ", "; commit: ", "## Throughput and memory", "## Kernel time: gpt-tiny",
            "## Kernel time: llama-tiny", "## Context parallel attention", "## gpu tests", "## Time spent")


@pytest.fixture
def report(bench):
    """The module as `python bench/gpu_report.py` sees it: bench/ first on the path."""
    return bench("gpu_report")


def test_kernel_families_of_names_a_gpu_profile_shows(report):
    """Kernel names as an H100 profile of our GPT/Llama runs lists them (cuBLAS/nvjet, cuDNN and
    flash attention, ATen's copy/fill/cat and elementwise templates, apex-free norms, fused Adam)."""
    cases = {
        "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNN": "matmul",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "matmul",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128": "attention",
        "fmha_cutlassF_bf16_aligned_64x64_rf_sm80": "attention",
        "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)>":
            "copies",
        "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<c10::BFloat16> >": "copies",
        "void at::native::(anonymous namespace)::CatArrayBatchedCopy<float, unsigned int, 4>": "copies",
        "Memcpy DtoD (Device -> Device)": "copies",
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16> >":
            "other elementwise",
        "triton_poi_fused_add_gelu_0": "other elementwise",
        "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float>": "norms",
        "void at::native::multi_tensor_apply_kernel<at::native::FusedAdamMathFunctor<float, 4> >": "optimizer",
        "ncclDevKernel_AllReduce_Sum_bf16_RING_LL": "communication",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float> >": "other",
    }
    for name, family in cases.items():
        assert report.family_of(name).startswith(family), (name, report.family_of(name))


def _trace(path: Path, events: list[dict]) -> None:
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)


def test_kernel_times_from_a_trace(report, tmp_path):
    _trace(tmp_path / "host.123.pt.trace.json.gz", [
        {"cat": "cpu_op", "name": "aten::mm", "dur": 900.0},
        {"cat": "kernel", "name": "nvjet_a", "dur": 300.0}, {"cat": "kernel", "name": "nvjet_a", "dur": 100.0},
        {"cat": "gpu_memcpy", "name": "Memcpy HtoD", "dur": 50.0}, {"cat": "gpu_memset", "name": "Memset", "dur": 10.0},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "dur": 5.0}])
    times = report.kernel_times(str(tmp_path))
    assert times == {"gpu": True, "by_name": {"nvjet_a": [2, 400.0], "Memcpy HtoD": [1, 50.0], "Memset": [1, 10.0]}}
    lines = report.profile_tables({"kernels": times, "steps": 2})
    assert lines[0] == "kernel time per step: 0.2 ms over 2 steps"
    assert "| matmul (gemm / cutlass / nvjet) | 0.20 | 87.0% |" in lines
    assert "| copies / casts | 0.03 | 13.0% |" in lines
    cpu_only = tmp_path / "cpu"
    cpu_only.mkdir()
    _trace(cpu_only / "host.1.pt.trace.json.gz", [{"cat": "cpu_op", "name": "aten::mm", "dur": 900.0},
                                                  {"cat": "python_function", "name": "x", "dur": 1.0}])
    assert report.kernel_times(str(cpu_only)) == {"gpu": False, "by_name": {"aten::mm": [1, 900.0]}}


def test_the_budget_skips_what_would_not_fit(report):
    items = [report.Item("ours", "gpt", "a", status="ok", wall_s=30.0),
             report.Item("ours", "gpt", "b", status="failed", wall_s=50.0)]
    assert report.estimate_s("ours", items, report.FIRST_GUESS) == 40.0  # what ran, failures included
    assert report.estimate_s("hf", items, report.FIRST_GUESS) == report.FIRST_GUESS["hf"]
    assert report.estimate_s("profile", items, report.FIRST_GUESS) == pytest.approx(1.3 * 30.0)


def test_fp8_runs_beside_bf16_at_a_shape_where_it_pays(report):
    items = report.plan(["gpt-1.3b", "llama-1.3b"], 4, "HF")
    fp8 = [(i.model, i.label, i.flags) for i in items if i.model in report.FP8_SHAPES]
    assert fp8 == [("llama-h4096", "default (bf16)", ()), ("llama-h4096", report.FP8_LABEL, ("--fp8-hybrid",))]
    assert report.FP8_SHAPES["llama-h4096"][1] >= 4096
    args = report.parse(["--out", "x"])
    argv = report.our_run_argv(args, items[[i.label for i in items].index(report.FP8_LABEL)])
    assert "--bf16" in argv and argv[-1] == "--fp8-hybrid" and argv[argv.index("--hidden-size") + 1] == "4096"
    smoke = report.plan(["gpt-tiny", "llama-tiny"], 2, "HF", smoke=True)
    assert [(i.model, i.flags) for i in smoke if i.label == report.FP8_LABEL] == [("gpt-tiny", ("--fp8-hybrid",))]


TP_ROWS = ("TP 2, synchronous TP collectives (default)",
           "TP 2, overlapped backward (--async-tensor-model-parallel-allreduce)",
           "TP 2 + sequence parallel, overlapped (--sequence-parallel --async-tensor-model-parallel-allreduce)")


def _gpus(monkeypatch, n):
    monkeypatch.setattr("torch.cuda.is_available", lambda: n > 0)
    monkeypatch.setattr("torch.cuda.device_count", lambda: n)


@pytest.mark.parametrize("n", [0, 1])
def test_tp_rows_say_they_need_two_gpus(report, monkeypatch, n):
    _gpus(monkeypatch, n)
    items = report.plan(["gpt-1.3b", "llama-1.3b"], 4, "HF")
    labels = [i.label for i in items]
    tp = [i for i in items if i.label in TP_ROWS]
    assert [i.label for i in tp] == list(TP_ROWS) and {i.model for i in tp} == {"gpt-1.3b"}
    # after the FP8 rows, before the refinements
    assert labels.index(report.FP8_LABEL) < labels.index(TP_ROWS[0]) and labels.index(TP_ROWS[2]) < labels.index(
        "micro batch 8")
    assert {(i.status, i.note) for i in tp} == {("not available", f"needs 2 GPUs; this machine has {n}")}
    row = report.throughput_rows(report.parse(["--out", "x"]), {"peak": 989.0, "gpu_bytes": None}, tp)[2]
    assert row == f"| gpt-1.3b | {TP_ROWS[0]} | not available: needs 2 GPUs; this machine has {n} | | | | | | |"


def test_fusion_rows_measure_gradient_accumulation_fusion_both_ways(report, monkeypatch):
    """ZeRO 1 with fp32 accumulation (where DeepSpeed keeps the fp32 gradients) without and with the flag,
    after the TP rows; --smoke skips them."""
    _gpus(monkeypatch, 1)
    items = report.plan(["gpt-1.3b", "llama-1.3b"], 4, "HF")
    labels = [i.label for i in items]
    rows = [i for i in items if i.label.startswith("ZeRO 1, fp32 gradients")]
    assert len(rows) == 2 and {i.model for i in rows} == {"gpt-1.3b"}
    assert labels.index(TP_ROWS[2]) < labels.index(rows[0].label) < labels.index("micro batch 8")
    plain, fused = (i.flags for i in rows)
    assert fused == (*plain, "--gradient-accumulation-fusion") and plain[1].endswith("ds_configs/zero1_bf16.json")
    assert os.path.exists(plain[1]) and len(plain) == 2
    smoke = [i for i in report.plan(["gpt-tiny", "llama-tiny"], 1, "HF", smoke=True)
             if i.label.startswith("ZeRO 1, fp32 gradients")]
    assert [i.status for i in smoke] == ["skipped", "skipped"]


def test_tp_rows_on_two_gpus_run_eager_layers_and_count_per_gpu(report, monkeypatch):
    """The three rows differ by the overlap flags alone; a row's TFLOP/s is per GPU: at the same step
    time, half the one-GPU default's (the same model FLOPs over two GPUs' time)."""
    _gpus(monkeypatch, 2)
    tp = [i for i in report.plan(["gpt-1.3b", "llama-1.3b"], 4, "HF") if i.label in TP_ROWS]
    assert [i.status for i in tp] == ["not reached"] * 3 and {i.gpus for i in tp} == {2}
    base = ("--tensor-model-parallel-size", "2", report.regional_compile_flag())
    assert base[2] == "--no-compile-layers"
    assert [i.flags for i in tp] == [base, (*base, report.ASYNC_TP), (*base, "--sequence-parallel", report.ASYNC_TP)]
    args = report.parse(["--out", "x"])
    one = report.Item("ours", "gpt-1.3b", "default", status="ok", result={"seconds": 0.2, "memory_gib": 30.0})
    tp[1].status, tp[1].result = "ok", {"seconds": 0.2, "memory_gib": 20.0}
    lines = report.throughput_rows(args, {"peak": 989.0, "gpu_bytes": 80e9}, [one, tp[1]])[2:]
    rows = [r.split("|")[3:7] for r in lines]
    (ms1, tf1, mfu1, _), (ms2, tf2, mfu2, vs_hf) = [[c.strip() for c in r] for r in rows]
    assert ms1 == ms2 == "200.0" and vs_hf == "-"
    assert float(tf2) == pytest.approx(float(tf1) / 2, abs=0.06)
    b, s, l, h, v = 4, 2048, 24, 2048, 50304  # Megatron's closed form of GPT 1.3B (vocabulary padded for TP 1)
    closed = 72 * b * s * l * h ** 2 * (1 + s / (6 * h) + v / (12 * l * h))
    assert float(tf2) == pytest.approx(closed / 0.2 / 2 / 1e12, abs=0.06)
    assert float(mfu2.rstrip("%")) == pytest.approx(float(mfu1.rstrip("%")) / 2, abs=0.06)


def test_the_llama_profile_comes_before_the_refinements(report):
    """On a GPU the Llama-style default is profiled right after the headline rows (its gap to HF is
    the open question); the GPT's profile waits with the refinements. --smoke profiles the GPT."""
    def order(smoke):
        return [(i.kind, i.model) for i in report.plan(["gpt-1.3b", "llama-1.3b"], 4, "HF", smoke=smoke)]

    gpu, smoke = order(False), order(True)
    assert gpu.index(("profile", "llama-1.3b")) < gpu.index(("tests", "")) < gpu.index(("profile", "gpt-1.3b"))
    assert smoke.index(("profile", "gpt-1.3b")) < smoke.index(("tests", "")) < smoke.index(("profile", "llama-1.3b"))


def test_a_timeout_ends_the_child_and_its_children(report):
    # the child starts without site imports and its child is `sleep`: both are up long before the timeout even
    # on a loaded two-core machine (a Python grandchild once missed a 5 s timeout there)
    spawn = "import subprocess, time; p = subprocess.Popen(['sleep', '60']); print(p.pid, flush=True); time.sleep(60)"
    code, out, _ = report.run_bounded([sys.executable, "-S", "-c", spawn], timeout=8)
    assert code is None
    grandchild = Path(f"/proc/{int(out.split()[0])}/status")
    # gone, or a zombie waiting for whichever process adopted it
    assert not grandchild.exists() or "State:\tZ" in grandchild.read_text()


def test_a_failing_measurement_becomes_a_failed_row_with_its_last_lines(report, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    args = report.parse(["--smoke"])
    item = report.Item("ours", "gpt-tiny", "broken", ("--no-such-flag",))
    report.measure(args, item, timeout=300)
    assert item.status == "failed" and item.note.startswith("exit ") and "--no-such-flag" in item.note
    row = report.throughput_rows(args, {"peak": float("nan"), "gpu_bytes": None}, [item])[-1]
    assert row == "| gpt-tiny | broken | failed (see Failures) | | | | | | |"


def _run_report(tmp_path, *args, timeout):
    out = tmp_path / "report.md"
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_report.py"), "--smoke", "--out", str(out),
                           *args], capture_output=True, text=True, env=env, cwd=REPO, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out.read_text(), proc.stdout


def test_zero_budget_still_writes_every_section(tmp_path):
    text, stdout = _run_report(tmp_path, "--budget-s", "0", timeout=300)
    for section in SECTIONS[:-1]:
        assert section in text, section
    assert "| gpt-tiny | default | skipped: would not fit the budget (~40 s needed, " in text
    assert text in stdout  # printed as written


@pytest.mark.slow
def test_smoke_report_end_to_end(tmp_path):
    """Every measurement of --smoke really runs (a fresh process each, tiny shapes, CPU)."""
    text, _ = _run_report(tmp_path, "--budget-s", "3000", timeout=1800)
    for section in SECTIONS:
        assert section in text, section
    rows = {tuple(c.strip() for c in line.split("|")[1:3]): line for line in text.splitlines()
            if line.startswith("| gpt-tiny |") or line.startswith("| llama-tiny |")}
    for key in [("gpt-tiny", "default"), ("gpt-tiny", "HF + eager"), ("llama-tiny", "default"),
                ("gpt-tiny", "elementwise fusions off"), ("gpt-tiny", TP_ROWS[2])]:
        ms = rows[key].split("|")[3].strip()
        assert float(ms) > 0, rows[key]
    for key in [("gpt-tiny", "micro batch 4"), ("gpt-tiny", "plain engine (--no-pipeline-parallel)"),
                ("gpt-tiny", "liger fused loss on (--liger-kernel)"), ("gpt-tiny", "FP8 (--fp8-hybrid)"),
                ("llama-tiny", "HF + eager")]:
        assert "skipped: --smoke leaves this row's path to the others" in rows[key], rows[key]
    assert "CPU operator (inclusive: nested operators overlap) time per step" in text  # the profile ran
    assert "| matmul (gemm / cutlass / nvjet) |" in text and "Top 15:" in text
    assert "skipped: --smoke or no CUDA device: the gpu-marked tests need a GPU" in text
    assert "--smoke runs the variants and the profile on GPT only" in text
    # the TP 2 row: two gloo processes under torchrun, the last rank's answer read back
    assert "skipped: --smoke runs one TP 2 row, the sequence-parallel one" in rows[("gpt-tiny", TP_ROWS[0])]
    assert " TP 2 and CP 2 rows: one process per GPU (torchrun" in text
    # the context parallel attention row ran (bench/cp_attention.py on the CPU)
    assert "| SDPA ms | math blocks ms | flash blocks ms | math / SDPA | flash / SDPA |" in text


def test_moe_rows_compare_the_layers_and_the_grouped_gemm(report, monkeypatch):
    """Three rows of one Llama-style MoE shape on one GPU, after the fusion rows: DeepSpeed-MoE, Megatron-LM's
    layer with a GEMM per expert and with --moe-grouped-gemm; each line builds the layer its label names (as
    --dry-run resolves it) with top-2 of 8 experts, and its FLOPs are the MoE's, not the dense model's
    (with top-2 of 8 experts of a quarter width, each token's expert FLOPs are half the dense MLP's)."""
    from megatron_ds.config import moe_selection, parse_args, resolve
    from megatron_ds.families import get_family

    _gpus(monkeypatch, 1)
    items = report.plan(["gpt-1.3b", "llama-1.3b"], 4, "HF")
    labels = [i.label for i in items]
    rows = [i for i in items if i.new_model]
    assert [i.label for i in rows] == list(report.MOE_ROWS) and {i.model for i in rows} == {"llama-1.3b"}
    assert labels.index("ZeRO 1, fp32 gradients") < labels.index(rows[0].label) < labels.index("micro batch 8")
    args = type("Args", (), dict(seq=2048, micro=4, iters=10))
    dense = report._flops(args, report.Item("ours", "llama-1.3b", "default"))
    for item, layer in zip(rows, ("DeepSpeed-MoE", "Megatron-LM", "Megatron-LM")):
        cfg, _ = parse_args(report.our_run_argv(args, item))
        m = resolve(cfg, world_size=1, vocab_size=50257, family=get_family("gpt"), device_type="cpu").layout.model
        assert m.num_experts == (8,) and m.ffn_hidden_size == 1376
        assert (m.moe_router_topk if moe_selection.is_mlm_moe(m) else m.topk) == 2
        assert moe_selection.is_mlm_moe(m) == (layer == "Megatron-LM")
        assert m.moe_grouped_gemm == item.label.endswith("--moe-grouped-gemm")
        assert 0.6 < report._flops(args, item) / dense < 0.8
    smoke = [i for i in report.plan(["gpt-tiny", "llama-tiny"], 1, "HF", smoke=True) if i.new_model]
    assert [i.status for i in smoke] == ["skipped"] * 3


@pytest.mark.parametrize("n", [1, 2])
def test_cp_rows_time_the_blocks_on_one_gpu_and_cp2_on_two(report, monkeypatch, n):
    """After the TP rows: the attention blocks against SDPA (one GPU, sequence 8192) and the GPT at CP 2, which
    needs two GPUs; --smoke times the blocks at 256 tokens on the CPU and skips CP 2."""
    _gpus(monkeypatch, n)
    items = report.plan(["gpt-1.3b", "llama-1.3b"], 4, "HF")
    labels = [i.label for i in items]
    attention, cp2, flash = (i for i in items if i.kind == "attention" or "--context-parallel-size" in i.flags)
    assert attention.micro == 8192 and attention.status == "not reached"
    assert cp2.flags == ("--context-parallel-size", "2") and cp2.gpus == 2 and cp2.model == "gpt-1.3b"
    assert flash.flags == (*cp2.flags, "--cp-block-kernel", "flash") and flash.gpus == 2
    assert cp2.status == flash.status == ("not reached" if n == 2 else "not available")
    assert labels.index(TP_ROWS[2]) < labels.index(attention.label) < labels.index("ZeRO 1, fp32 gradients")
    smoke = [i for i in report.plan(["gpt-tiny", "llama-tiny"], 1, "HF", smoke=True)
             if i.kind == "attention" or "--context-parallel-size" in i.flags]
    assert [(i.micro, i.status) for i in smoke] == [(256, "not reached"), (None, "skipped"), (None, "skipped")]
