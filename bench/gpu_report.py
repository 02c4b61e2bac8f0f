#!/usr/bin/env python
"""One GPU session's report, in one markdown file: throughput and memory of GPT 1.3B and a
Llama-style 1.3B (ours in the default configuration and its variants, next to Hugging Face +
torch.compile at the same shape), where an iteration spends its kernel time, and the `gpu` tests.

    make gpu-report                                   # PYTHON with the requirements installed (Makefile)
    python bench/gpu_report.py --budget-s 420 --out report.md
    python bench/gpu_report.py --smoke                # tiny shapes on the CPU: every section, end to end

The pieces are bench/gpu_mfu.py's (the shapes, our command line, the HF baseline, the FLOPs count);
each measurement runs in a fresh process with its own timeout, so a hung or failing variant becomes a
"failed" row with its last lines and the report goes on. The report file is rewritten after every
item: a killed session still leaves what was measured.

Order of work (most value per second first; ``--budget-s`` skips what would not fit, estimating each
item from the items of its kind that already ran, so a smaller item after a skipped one still runs):
1. GPT and Llama in the default configuration, each with its HF baseline: the headline ratio;
2. GPT and Llama with regional compilation turned off (``--no-compile-layers``; on a CPU, turned on):
   the default on CUDA since one H200 run measured it 9% faster, checked again every report; --smoke skips
   them;
3. the kernel-time profile of the Llama-style default: where the time goes (families, top kernels);
4. the `gpu` tests (pytest -n 8, ~3 minutes): correctness on the device, before refinements;
5. FP8 (``--fp8-hybrid``, off by default until measured) beside bf16 at a Llama shape where FP8 pays
   (hidden 4096: at hidden 2048 the casts cost about what the faster GEMMs save); --smoke skips it
   (tests/training/test_fp8.py runs FP8 emulated on the CPU);
6. GPT at tensor parallel size 2 (two processes on two GPUs, launched by torchrun; on a machine with
   fewer GPUs the rows say so): the TP collectives after the GEMMs (the default), overlapped with the
   weight-gradient GEMM (``--async-tensor-model-parallel-allreduce``, off by default until measured)
   and overlapped under ``--sequence-parallel``; the layers run eagerly in all three on CUDA (a compiled
   layer keeps its collectives synchronous), so the rows differ by the overlap alone. --smoke runs the
   sequence-parallel one on the tiny GPT with 2 gloo processes on the CPU;
7. context parallelism: its attention blocks with each ``--cp-block-kernel`` (math, the default, and flash, off
   until measured) against SDPA's flash kernel at sequence 8192 on one GPU (bench/cp_attention.py), and the GPT
   at ``--context-parallel-size 2`` on two GPUs with each kernel (not available with fewer); --smoke runs the
   first at 256 tokens on the CPU;
8. gradient accumulation fusion (``--gradient-accumulation-fusion``, off by default until measured) on
   the GPT: ZeRO 1 with fp32 gradient accumulation (``ds_configs/zero1_bf16.json``, where DeepSpeed keeps
   the fp32 gradients the fusion adds into) without and with it; --smoke skips them
   (tests/training/test_grad_accum_fusion.py runs the flags);
9. mixture of experts on one GPU, a Llama-style MoE (8 experts of 1376, top-2, every layer): DeepSpeed-MoE,
   Megatron-LM's layer with a GEMM per expert, and with ``--moe-grouped-gemm`` (off by default until measured):
   which layer Megatron-LM-style flags should build, and whether the grouped kernel pays; --smoke skips them
   (bench/moe.py compares the layers, tests/model/test_mlm_moe.py runs the flag);
10. GPT with micro batch 8, the plain engine (``--no-pipeline-parallel``), liger-kernel's fused loss
   forced on (``--liger-kernel``: whether its default, off at this shape, holds) and the compiled
   elementwise fusions off (what they buy); then the same variants of Llama and the GPT's profile:
   refinements, run as far as the budget goes.

--smoke (the suite's end-to-end test of this script, tiny shapes on the CPU) runs one row of each measurement
path: both defaults, the GPT's HF baseline, the profile, the fusions-off variant, the TP 2 and CP rows; the
other variants only change flags that have their own tests.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gzip
import importlib.metadata
import importlib.util
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

import gpu_mfu  # bench/gpu_mfu.py: bench/ is first on the path of `python bench/gpu_report.py`

REPO = Path(__file__).resolve().parents[1]
PROFILE_STEPS = 2  # profiled after warm-up: the last iterations but one
RESULT = "gpu_report result: "  # how a worker's answer line starts (libraries print to stdout too)
# Regional compilation's switch, by the spellings it may carry (detected in pretrain_gpt.py's parser).
REGIONAL_COMPILE_FLAGS = ("--no-compile-layers", "--compile-layers")  # CUDA default first
# Seconds an item of each kind is assumed to take until one has run (an H200: ~10 s of DeepSpeed
# start-up plus compiled fusions for ours, 40-60 s of torch.compile for HF, ~160 s for the tests).
FIRST_GUESS = {"ours": 45.0, "hf": 90.0, "profile": 60.0, "tests": 180.0, "attention": 30.0}
SMOKE_GUESS = {"ours": 40.0, "hf": 30.0, "profile": 45.0, "tests": 0.0, "attention": 10.0}
# Llama-7B's widths (hidden 4096, SwiGLU 11008, 32 heads) at 8 layers: GEMMs large enough for FP8 to pay,
# ~1.9B parameters, which train on one 80 GB GPU at micro batch 4, seq 2048
FP8_SHAPES = {"llama-h4096": (8, 4096, 32, 11008, True)}
FP8_LABEL = "FP8 (--fp8-hybrid)"
TP = 2  # the tensor-parallel rows: one process per GPU
ASYNC_TP = "--async-tensor-model-parallel-allreduce"


@dataclasses.dataclass
class Item:
    kind: str  # ours | hf | profile | tests | attention
    model: str  # a gpu_mfu shape name ("" for the tests)
    label: str
    flags: tuple = ()  # ours: extra pretrain_gpt.py flags
    micro: int | None = None  # None: the run's micro batch (attention: the sequence length)
    gpus: int = 1  # ours: processes (one GPU each) of a tensor-parallel run
    status: str = "not reached"  # not reached | ok | failed | skipped | not available
    note: str = ""
    result: dict = dataclasses.field(default_factory=dict)
    wall_s: float = 0.0
    new_model: bool = False  # ours: the flags change the model (its FLOPs are the flags', no HF baseline)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget-s", type=float, default=480.0, help="wall-clock budget for all the work (s)")
    p.add_argument("--out", default=str(REPO / "bench" / "out" / "gpu-report.md"))
    p.add_argument("--iters", type=int, default=12, help="iterations per run; the last half is timed")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, seq 64, 4 steps, eager HF: any device")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # one measurement, in a child process (JSON)
    args = p.parse_args(argv)
    args.models = list(gpu_mfu.SMOKE_SHAPES) if args.smoke else ["gpt-1.3b", "llama-1.3b"]
    args.seq, args.micro = (64, 2) if args.smoke else (2048, 4)
    args.iters = 4 if args.smoke else args.iters
    return args


def regional_compile_flag() -> str | None:
    """The regional compilation switch that differs from this device's default, if pretrain_gpt.py has
    it: on CUDA the layers are compiled by default (the variant turns it off), on the CPU eager."""
    from megatron_ds.config import build_parser

    known = {s for action in build_parser()._actions for s in action.option_strings}
    flags = REGIONAL_COMPILE_FLAGS if torch.cuda.is_available() else REGIONAL_COMPILE_FLAGS[::-1]
    return next((flag for flag in flags if flag in known), None)


def variants(model: str, micro: int, rc: str | None) -> dict[str, Item]:
    """Ours with one thing changed from the default: by short name."""
    rc_label = "regional compile off" if rc and rc.startswith("--no-") else "regional compile on"
    return {
        "liger": Item("ours", model, "liger fused loss on (--liger-kernel)", ("--liger-kernel",)),
        "fusions": Item("ours", model, "elementwise fusions off", tuple(gpu_mfu.FUSIONS_OFF)),
        "rc": Item("ours", model, rc_label, (rc,) if rc else (), status="not reached" if rc else "not available",
                   note="" if rc else f"pretrain_gpt.py has no {' / '.join(REGIONAL_COMPILE_FLAGS)}"),
        "micro": Item("ours", model, f"micro batch {2 * micro}", micro=2 * micro),
        "plain": Item("ours", model, "plain engine (--no-pipeline-parallel)", ("--no-pipeline-parallel",)),
    }


def fp8_items(smoke: bool) -> list[Item]:
    """FP8 beside bf16 at the FP8 shape; --smoke: the FP8 variant of the tiny GPT (its default row is bf16)."""
    if smoke:
        return [Item("ours", "gpt-tiny", FP8_LABEL, ("--fp8-hybrid",))]
    model = next(iter(FP8_SHAPES))
    return [Item("ours", model, "default (bf16)"), Item("ours", model, FP8_LABEL, ("--fp8-hybrid",))]


def tp_items(model: str, smoke: bool, rc: str | None) -> list[Item]:
    """GPT at TP 2: collectives after the GEMMs, overlapped, overlapped with sequence parallelism. On CUDA
    with regional compilation turned off (``rc``): dynamo keeps a compiled layer's collectives synchronous
    (parallel/async_comm.py), so a compiled run would measure no overlap. Not available with fewer than
    2 GPUs, except --smoke on the CPU (gloo), which runs the last row (two rows would add ~40 s to the
    smoke test on a 2-core machine)."""
    eager = (rc,) if rc and rc.startswith("--no-") else ()
    tp = ("--tensor-model-parallel-size", str(TP), *eager)
    items = [Item("ours", model, f"TP {TP}, synchronous TP collectives (default)", tp, gpus=TP),
             Item("ours", model, f"TP {TP}, overlapped backward ({ASYNC_TP})", (*tp, ASYNC_TP), gpus=TP),
             Item("ours", model, f"TP {TP} + sequence parallel, overlapped (--sequence-parallel {ASYNC_TP})",
                  (*tp, "--sequence-parallel", ASYNC_TP), gpus=TP)]
    cuda = torch.cuda.is_available()
    have = torch.cuda.device_count() if cuda else 0
    if have < TP and not (smoke and not cuda):
        for item in items:
            item.status, item.note = "not available", f"needs {TP} GPUs; this machine has {have}"
    elif smoke:  # one row runs the whole path (launch, read-back, row); the one with the most flags
        for item in items[:2]:
            item.status, item.note = "skipped", f"--smoke runs one TP {TP} row, the sequence-parallel one"
    return items


FUSION_FLAG = "--gradient-accumulation-fusion"


def fusion_items(model: str, smoke: bool) -> list[Item]:
    """The GPT with DeepSpeed's fp32 gradients (ZeRO 1, fp32 accumulation), the weight gradients added in
    from bf16 ``.grad``s (DeepSpeed's way) and fused into the weight-gradient GEMMs."""
    zero1 = ("--deepspeed_config", str(REPO / "ds_configs" / "zero1_bf16.json"))
    items = [Item("ours", model, "ZeRO 1, fp32 gradients", zero1),
             Item("ours", model, f"ZeRO 1, fp32 gradients, {FUSION_FLAG}", (*zero1, FUSION_FLAG))]
    if smoke:
        for item in items:
            item.status, item.note = "skipped", "--smoke leaves the fusion to tests/training/test_grad_accum_fusion.py"
    return items


# A Llama-style MoE of the 1.3B's attention: 8 experts of a quarter of its SwiGLU width (5504) on every layer, top-2
# (half the dense MLP's FLOPs per token, ~2.3B parameters): Mixtral's routing at a size one GPU trains
MOE_EXPERTS = ("--ffn-hidden-size", "1376", "--num-experts", "8")
MOE_ROWS = {"DeepSpeed-MoE, top-2, capacity factor 1": ("--topk", "2", "--expert-interval", "1",
                                                       "--create-moe-param-group"),
            "Megatron-LM MoE, top-2 dropless, a GEMM per expert": ("--moe-router-topk", "2"),
            "Megatron-LM MoE, top-2 dropless, --moe-grouped-gemm": ("--moe-router-topk", "2", "--moe-grouped-gemm")}


def moe_items(model: str, smoke: bool) -> list[Item]:
    """The MoE layers on one GPU: DeepSpeed-MoE against Megatron-LM's layer (which one Megatron-LM-style flags
    should build by default), and that layer's experts as one grouped GEMM against one GEMM per expert
    (--moe-grouped-gemm, off by default until measured). --smoke leaves them to bench/moe.py and the tests."""
    items = [Item("ours", model, label, (*MOE_EXPERTS, *flags), new_model=True) for label, flags in MOE_ROWS.items()]
    if smoke:
        for item in items:
            item.status, item.note = "skipped", "--smoke leaves MoE to bench/moe.py and tests/model/test_mlm_moe.py"
    return items


CP = 2  # the context parallel row: one process per GPU
CP_SEQ = {"cuda": 8192, "smoke": 256}  # the attention row's length: CUDA, --smoke on the CPU


def cp_items(model: str, smoke: bool) -> list[Item]:
    """Context parallelism: its attention blocks against SDPA on one GPU at one length (bench/cp_attention.py;
    --smoke: a short one on the CPU), and the GPT at CP 2 on two GPUs (not available with fewer; --smoke
    leaves it to tests/training/test_context_parallel.py)."""
    seq = CP_SEQ["smoke" if smoke else "cuda"]
    cp = ("--context-parallel-size", str(CP))
    items = [Item("attention", "", f"context parallel blocks against SDPA, seq {seq}", micro=seq),
             Item("ours", model, f"CP {CP} (--context-parallel-size {CP})", cp, gpus=CP),
             Item("ours", model, f"CP {CP}, --cp-block-kernel flash", (*cp, "--cp-block-kernel", "flash"), gpus=CP)]
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items[1:]:
        if smoke:
            item.status, item.note = "skipped", "--smoke leaves CP to tests/training/test_context_parallel.py"
        elif have < CP:
            item.status, item.note = "not available", f"needs {CP} GPUs; this machine has {have}"
    return items


def plan(models: list[str], micro: int, hf_label: str, smoke: bool = False) -> list[Item]:
    """The work in the order of the module docstring; --smoke runs the variants on GPT only."""
    gpt, llama = models
    rc = regional_compile_flag()
    g, m = variants(gpt, micro, rc), variants(llama, micro, rc)
    head = [Item("ours", gpt, "default"), Item("hf", gpt, hf_label), Item("ours", llama, "default"),
            Item("hf", llama, hf_label)]
    # the Llama-style profile first: its gap to HF is the open question (the GPT's default was
    # profiled on 2026-11-26, bench/RESULTS.md); --smoke profiles the GPT instead
    profiles = [Item("profile", gpt, "kernel time, default"), Item("profile", llama, "kernel time, default")]
    first = [g["rc"], m["rc"], profiles[0 if smoke else 1], Item("tests", "", "gpu tests")]
    later = [g["micro"], g["plain"], g["liger"], g["fusions"]]
    llama_rows = [m["micro"], m["plain"], m["liger"], m["fusions"], profiles[1 if smoke else 0]]
    if smoke:
        for item in [m["rc"], *llama_rows]:
            if item.status == "not reached":
                item.status, item.note = "skipped", "--smoke runs the variants and the profile on GPT only"
    fp8 = fp8_items(smoke)
    if smoke:
        # flag variants whose measurement path "elementwise fusions off" runs too, and the Llama's HF row (the GPT's
        # runs that path): on the CPU they cost about 70 s of the smoke test (regional compilation alone 25 s), and
        # their flags have their own tests (tests/model/test_compile_layers.py, tests/training/test_fp8.py, ...)
        for item in [g["rc"], g["micro"], g["plain"], g["liger"], head[3], *fp8]:
            if item.status == "not reached":
                item.status = "skipped"
                item.note = "--smoke leaves this row's path to the others and its flags to their tests"
    return (head + first + fp8 + tp_items(gpt, smoke, rc) + cp_items(gpt, smoke) + fusion_items(gpt, smoke)
            + moe_items(llama, smoke) + later + llama_rows)


# --------------------------------------------------------------------------- measurements (children)

def our_run_argv(args, item: Item) -> list[str]:
    shape = {**gpu_mfu.SHAPES, **gpu_mfu.SMOKE_SHAPES, **FP8_SHAPES}[item.model]
    return gpu_mfu.our_argv(shape, args.seq, item.micro or args.micro, args.iters, False, "bf16") + list(item.flags)


def worker(spec: dict) -> dict | None:
    """One measurement in this (fresh) process; what the parent reads back (None: a rank that has none)."""
    if spec["kind"] == "hf":
        shape = {**gpu_mfu.SHAPES, **gpu_mfu.SMOKE_SHAPES}[spec["model"]]
        seconds, mem = gpu_mfu.run_hf(shape, spec["seq"], spec["micro"], spec["iters"], spec["compile"], "bf16")
        return {"seconds": seconds, "memory_gib": mem}
    if spec["kind"] == "attention":
        import cp_attention  # bench/cp_attention.py, beside this script

        cuda = torch.cuda.is_available() and not spec["smoke"]
        return cp_attention.measure(spec["micro"], device="cuda" if cuda else "cpu", heads=16 if cuda else 2,
                                    iters=5 if cuda else 2, warmup=2 if cuda else 1)
    if spec["kind"] == "ours":
        seconds, mem = gpu_mfu.run_ours(spec["argv"])
        # a TP run's ranks but the last print no iteration lines (NaNs): the last one answers
        return None if math.isnan(seconds) else {"seconds": seconds, "memory_gib": mem}
    last = spec["iters"] - 1  # the final iteration may be followed by shutdown work: profile the two before
    first = last - PROFILE_STEPS + 1
    with tempfile.TemporaryDirectory(prefix="gpu_report_trace_") as trace_dir:
        # the package's own --profile (training/profiler.py): a torch.profiler trace of those steps
        gpu_mfu.run_ours(spec["argv"] + ["--profile", "pt", "--profile_steps", f"{first},{last}",
                                         "--tensorboard-dir", trace_dir])
        return {"kernels": kernel_times(trace_dir), "steps": PROFILE_STEPS}


def kernel_times(trace_dir: str) -> dict:
    """{name: [calls, microseconds]} of the GPU kernels, copies and memsets in the traces; a CPU run
    has none, so there its aten operators' (inclusive, overlapping) times stand in."""
    events = []
    for path in Path(trace_dir).rglob("*.pt.trace.json*"):
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt") as f:
            events += json.load(f).get("traceEvents", [])
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    chosen = gpu or [e for e in events if e.get("cat") == "cpu_op" and str(e.get("name", "")).startswith("aten::")]
    out: dict = {}
    for e in chosen:
        calls_us = out.setdefault(e["name"], [0, 0.0])
        calls_us[0] += 1
        calls_us[1] += float(e.get("dur", 0.0))
    return {"gpu": bool(gpu), "by_name": out}


def measure(args, item: Item, timeout: float) -> None:
    """Run ``item`` in a fresh process with ``timeout``; fills its status, result and wall time."""
    spec = {"kind": item.kind, "model": item.model, "seq": args.seq, "micro": item.micro or args.micro,
            "iters": args.iters, "compile": not args.smoke, "smoke": args.smoke}
    if item.kind in ("ours", "profile"):
        spec["argv"] = our_run_argv(args, item)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    # a port of our own: 29500 (the single-process default) may still be held by the previous run
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(gpu_mfu._free_port()))
    if item.gpus > 1:
        cmd, env = tp_launch(cmd, item.gpus, env)
    start = time.perf_counter()
    code, out, err = run_bounded(cmd, timeout, env=env)
    item.wall_s = time.perf_counter() - start
    results = [line[len(RESULT):] for line in out.splitlines() if line.startswith(RESULT)]
    if code != 0 or not results:
        why = f"timed out after {timeout:.0f} s" if code is None else f"exit {code}"
        item.status, item.note = "failed", why + "\n" + _tail(out, err)
        return
    item.status, item.result = "ok", json.loads(results[-1])


def tp_launch(cmd: list[str], gpus: int, env: dict) -> tuple[list[str], dict]:
    """``cmd`` as ``gpus`` processes on this node, the way a job is launched (docs/launching.md): torchrun
    (the package's wrapper), LOCAL_RANK i on GPU i, its rendezvous on a free port (--standalone). A
    timeout's SIGKILL reaches torchrun; its workers, in sessions of their own, end when it is gone
    (launch/parent_watch.py)."""
    launcher = [sys.executable, "-m", "megatron_ds.launch.torchrun", "--standalone", f"--nproc-per-node={gpus}"]
    # Megatron's setting for the overlap (parallel/async_comm.py): the collective's kernel is queued ahead
    # of the GEMM's; set for every TP row, so that the rows differ by the flags alone
    return launcher + cmd[1:], dict(env, CUDA_DEVICE_MAX_CONNECTIONS="1")


def run_bounded(cmd: list[str], timeout: float, env=None) -> tuple[int | None, str, str]:
    """(exit status, None on timeout; stdout; stderr) of ``cmd`` run from the repository root. It
    gets a process group of its own, so a timeout ends its children too (data loader and compile
    workers, pytest-xdist's workers) and frees the GPU for the next item."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return None, out, err


def _tail(*streams, lines: int = 25) -> str:
    text = "\n".join(s.decode(errors="replace") if isinstance(s, bytes) else (s or "") for s in streams)
    return "\n".join(text.strip().splitlines()[-lines:])


def run_gpu_tests(item: Item, timeout: float) -> None:
    """The `gpu`-marked tests, 8 at a time (pytest-xdist): the summary line and the failures."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-n", "8", "-p", "no:cacheprovider", "tests"]
    start = time.perf_counter()
    code, out, err = run_bounded(cmd, timeout)
    item.wall_s = time.perf_counter() - start
    lines = out.strip().splitlines()  # pytest's own report: stdout
    summary = next((x for x in reversed(lines) if re.search(r"\d+ (passed|failed|error)", x)), None)
    failures = [x for x in lines if x.startswith(("FAILED ", "ERROR "))]
    item.result = {"summary": summary or "(no summary line)", "failures": failures, "exit": code}
    item.status = "ok" if code == 0 else "failed"
    if code is None:
        item.note = f"timed out after {timeout:.0f} s\n" + _tail(out, err, lines=10)
    elif summary is None:
        item.note = _tail(out, err)


# --------------------------------------------------------------------------- kernel families

# (family, name fragments), first match wins: cuDNN's attention kernels carry "sm90" too, so attention
# is looked for before the matmuls, and copies before the generic elementwise kernels.
FAMILIES = (
    ("communication (nccl)", ("nccl",)),
    ("attention (flash / fmha / sdpa)", ("flash", "fmha", "sdpa", "efficient_attention", "attention")),
    ("matmul (gemm / cutlass / nvjet)", ("gemm", "cutlass", "xmma", "nvjet", "wgmma", "cublas", "aten::mm",
                                         "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear")),
    ("optimizer (adam / multi_tensor)", ("multi_tensor", "adam")),
    ("norms (layer_norm / rms)", ("layer_norm", "layernorm", "rms_norm", "rmsnorm", "_rms")),
    ("copies / casts", ("memcpy", "memset", "copy", "cast", "catarray", "aten::cat", "aten::to", "fill")),
    ("other elementwise", ("elementwise", "vectorized", "unrolled", "triton_poi", "aten::add", "aten::mul")),
)
OTHER = "other"


def family_of(name: str) -> str:
    low = name.lower()
    return next((fam for fam, keys in FAMILIES if any(k in low for k in keys)), OTHER)


def profile_tables(result: dict) -> list[str]:
    """The families table and the top 15 kernels of one profile result."""
    by_name, steps = result["kernels"]["by_name"], result["steps"]
    total = sum(us for _, us in by_name.values()) or 1.0
    fams: dict = {}
    for name, (_, us) in by_name.items():
        fams[family_of(name)] = fams.get(family_of(name), 0.0) + us
    unit = "kernel" if result["kernels"]["gpu"] else "CPU operator (inclusive: nested operators overlap)"
    lines = [f"{unit} time per step: {total / steps / 1000:.1f} ms over {steps} steps", "",
             "| family | ms/step | share |", "|---|---:|---:|"]
    for fam, us in sorted(fams.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {fam} | {us / steps / 1000:.2f} | {100 * us / total:.1f}% |")
    lines += ["", "Top 15:", "", "| kernel | family | calls/step | ms/step | share |", "|---|---|---:|---:|---:|"]
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:15]
    for name, (calls, us) in top:
        short = name if len(name) <= 100 else name[:97] + "..."
        short = short.replace("|", "\\|")
        lines.append(f"| `{short}` | {family_of(name)} | {calls / steps:.0f} | {us / steps / 1000:.2f} | "
                     f"{100 * us / total:.1f}% |")
    return lines


# --------------------------------------------------------------------------- the report

def context(args) -> dict:
    """Device, versions, date and commit for the header."""
    name, peak = gpu_mfu.device_peak()
    gpu_bytes = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
    versions = {"torch": torch.__version__}
    for dist in ("deepspeed", "liger-kernel", "transformers", "triton"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = "not installed"
    return {"device": name, "peak": peak, "gpu_bytes": gpu_bytes, "versions": versions,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "commit": _commit(), "start": time.perf_counter()}


def _commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO,
                              timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=REPO, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown (no git)"
    if head.returncode != 0:
        return "unknown (not a git checkout)"
    return head.stdout.strip() + (" + uncommitted changes" if dirty.stdout.strip() else "")


def estimate_gib(argv: list[str], gpu_bytes, world_size: int = 1) -> tuple[float, float]:
    """--dry-run's per-GPU memory estimate of this command line on ``world_size`` GPUs: (tensors, with the
    runtime reserve), GiB."""
    from megatron_ds.config import parse_args, resolve
    from megatron_ds.config.memory import estimate_memory
    from megatron_ds.families import get_family

    cfg, _ = parse_args(argv)
    layout = resolve(cfg, world_size=world_size, vocab_size=gpu_mfu.VOCAB, family=get_family("gpt"),
                     device_type="cuda", gpu_memory=gpu_bytes).layout
    estimate = estimate_memory(layout)
    reserve = dict(estimate.terms)["runtime reserve"]
    return (estimate.total - reserve) / 2 ** 30, estimate.total / 2 ** 30


def throughput_rows(args, ctx, items: list[Item]) -> list[str]:
    lines = ["| model | configuration | ms/it | TFLOP/s | MFU | vs HF | peak GiB | estimate GiB (+ reserve) "
             "| estimate error |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    hf_rate = {}
    for item in items:
        if item.kind == "hf" and item.status == "ok":
            hf_rate[item.model] = _flops(args, item) / item.result["seconds"]
    for item in items:
        if item.kind in ("ours", "hf"):
            try:
                lines.append(_row(args, ctx, item, hf_rate.get(item.model)))
            except Exception as exc:  # noqa: BLE001 - one row's arithmetic must not lose the report
                lines.append(f"| {item.model} | {item.label} | {item.status}, row not computed "
                             f"({type(exc).__name__}: {exc}) | | | | | | |")
    return lines


def _flops(args, item: Item) -> float:
    """Model FLOPs of one iteration of the item's shape (HF: the unpadded vocabulary, as it runs)."""
    shape_only = our_run_argv(args, item if item.new_model else Item("ours", item.model, "", micro=item.micro))
    return gpu_mfu.model_flops(shape_only, item.micro or args.micro, vocab=gpu_mfu.VOCAB if item.kind == "hf" else None)


def _row(args, ctx, item: Item, hf_rate) -> str:
    head = f"| {item.model} | {item.label} |"
    if item.status != "ok":
        why = {"failed": "failed (see Failures)", "not reached": "not reached (the run was cut off)"}.get(
            item.status, f"{item.status}: {item.note}")
        return head + f" {why} | | | | | | |"
    flops = _flops(args, item)  # a TP run's too: the model's FLOPs, shared by its GPUs
    sec, mem = item.result["seconds"], item.result["memory_gib"]
    rate = flops / sec / item.gpus  # per GPU
    mfu = 100 * rate / 1e12 / ctx["peak"]
    # vs HF: one GPU against one GPU (a TP row's per-GPU rate against HF's whole one would mislead)
    ratio = (f"{rate / hf_rate:.2f}x" if hf_rate and item.kind == "ours" and item.gpus == 1 and not item.new_model
             else "1.00x" if item.kind == "hf" else "-")
    est = "-"
    err = "-"
    if item.kind == "ours":
        tensors, total = estimate_gib(our_run_argv(args, item), ctx["gpu_bytes"], item.gpus)
        est, err = f"{tensors:.1f} ({total:.1f})", f"{100 * (tensors - mem) / mem:+.0f}%" if mem == mem else "-"
    return head + (f" {sec * 1000:.1f} | {rate / 1e12:.1f} | {mfu:.1f}% | {ratio} | {mem:.1f} | {est} | {err} |")


def render(args, ctx, items: list[Item], finished: bool) -> str:
    v = ctx["versions"]
    memory = f", {ctx['gpu_bytes'] / 1e9:.0f} GB" if ctx["gpu_bytes"] else ""
    lines = ["# GPU report", "",
             f"- device: {ctx['device']} (dense bf16 peak {ctx['peak']} TFLOP/s{memory})",
             "- versions: " + ", ".join(f"{k} {val}" for k, val in v.items()) + f", python {sys.version.split()[0]}",
             f"- date: {ctx['date']}; commit: {ctx['commit']}",
             f"- shapes: seq {args.seq}, micro batch {args.micro}, bf16, {args.iters} iterations (the last half "
             f"timed), mock data, one GPU (TP {TP} rows: {TP}); ours: pretrain_gpt.py (pipeline engine, PP 1, "
             "unless said); HF: "
             f"{'eager' if args.smoke else 'torch.compile'}; budget {args.budget_s:.0f} s"
             + ("" if finished else f" (in progress: {time.perf_counter() - ctx['start']:.0f} s so far)"), "",
             "## Throughput and memory", "",
             "MFU against the dense bf16 peak; vs HF: ours' TFLOP/s over the HF baseline's (same model, micro "
             f"batch {args.micro}); peak: torch.cuda.max_memory_allocated (a CPU run: the process's RSS); "
             "estimate: pretrain_gpt.py --dry-run's per-GPU estimate of the same command line without its "
             "runtime reserve (with it), error relative to the peak." + tp_note(items), ""]
    lines += throughput_rows(args, ctx, items)
    for item in (i for i in items if i.kind == "profile"):
        lines += ["", f"## Kernel time: {item.model}, default configuration", ""]
        try:
            lines += profile_tables(item.result) if item.status == "ok" else [_status_line(item)]
        except Exception as exc:  # noqa: BLE001 - an unexpected trace must not lose the report
            lines.append(f"profile not tabulated ({type(exc).__name__}: {exc})")
    lines += attention_section(items)
    tests = next(i for i in items if i.kind == "tests")
    lines += ["", "## gpu tests (python -m pytest -q -m gpu -n 8 tests)", ""]
    if tests.result:
        lines += [f"`{tests.result['summary']}` ({tests.wall_s:.0f} s)"] + [f"- {x}" for x in tests.result["failures"]]
    if tests.status != "ok" or not tests.result:
        lines.append(_status_line(tests))
    failed = [i for i in items if i.status == "failed" and i.note]
    if failed:
        lines += ["", "## Failures", ""]
        for item in failed:
            lines += [f"{item.model} {item.label}:", "", "```", item.note, "```", ""]
    lines += ["", "## Time spent", "", "| item | status | seconds |", "|---|---|---:|"]
    lines += [f"| {i.model} {i.label} | {i.status} | {i.wall_s:.0f} |" for i in items if i.status in ("ok", "failed")]
    return "\n".join(lines) + "\n"


def attention_section(items: list[Item]) -> list[str]:
    """The context parallel attention row: the blocks' forward + backward against SDPA's at one length."""
    lines = []
    for item in (i for i in items if i.kind == "attention"):
        lines += ["", f"## Context parallel attention: {item.label}", "",
                  "bench/cp_attention.py: one process runs a whole causal sequence as context parallelism's blocks "
                  "(CP 1) with each --cp-block-kernel (math: the explicit fp32 path, the default; flash: torch's "
                  "flash operator) and as SDPA (flash attention on CUDA), forward + backward, median ms; GiB: "
                  "CUDA's peak above the inputs. flash below math on a GPU is the measurement that would make "
                  "flash the default.", ""]
        if item.status == "ok":
            import cp_attention  # bench/cp_attention.py, beside this script

            lines += ["| SDPA ms | math blocks ms | flash blocks ms | math / SDPA | flash / SDPA | SDPA GiB | math GiB "
                      "| flash GiB |", "|---:|---:|---:|---:|---:|---:|---:|---:|",
                      f"| {cp_attention.table_cells(item.result)} |"]
        else:
            lines.append(_status_line(item))
    return lines


def tp_note(items: list[Item]) -> str:
    """What the TP rows' columns mean, after the throughput section's explanation."""
    tp = [i for i in items if i.gpus > 1]
    if not tp:
        return ""
    eager = any(REGIONAL_COMPILE_FLAGS[0] in i.flags for i in tp)
    return (f" TP {TP} and CP {CP} rows: one process per GPU (torchrun, CUDA_DEVICE_MAX_CONNECTIONS=1), "
            + (f"layers eager ({REGIONAL_COMPILE_FLAGS[0]}: a compiled layer's collectives stay synchronous), "
               if eager else "")
            + "TFLOP/s and MFU per GPU (the same model FLOPs as the other rows over the GPUs' time), "
            "peak and estimate of the last rank.")


def _status_line(item: Item) -> str:
    if item.status == "not reached":
        return "not reached (the run was cut off)"
    first = item.note.splitlines()[0] if item.note else ""
    return f"{item.status}" + (f": {first}" if first else "") + (" (see Failures)" if item.status == "failed" else "")


def write(path: str, text: str) -> None:
    """Replace the report in one step: a reader (or a kill) never sees half a file."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def estimate_s(kind: str, items: list[Item], guesses: dict) -> float:
    """Seconds the next item of ``kind`` should take: the mean of those already run, else a first
    guess (a profile: one of ours' runs plus a third for the trace)."""
    done = [i.wall_s for i in items if i.kind == kind and i.status in ("ok", "failed")]
    if done:
        return sum(done) / len(done)
    ours = [i.wall_s for i in items if i.kind == "ours" and i.status == "ok"]
    if kind == "profile" and ours:
        return 1.3 * sum(ours) / len(ours)
    return guesses[kind]


def run_item(args, item: Item, remaining: float, est: float) -> None:
    # room for a first run's cold caches (inductor, Triton) and a slow start, without letting one hung
    # item eat the whole budget
    timeout = min(remaining, max(2.5 * est, est + 90))
    if item.kind == "tests":
        if args.smoke or not torch.cuda.is_available():
            item.status, item.note = "skipped", "--smoke or no CUDA device: the gpu-marked tests need a GPU"
        elif importlib.util.find_spec("xdist") is None:
            item.status, item.note = "skipped", "pytest-xdist is not installed (pip install pytest-xdist)"
        else:
            run_gpu_tests(item, timeout)
        return
    measure(args, item, timeout)


def main(argv=None) -> int:
    args = parse(argv)
    if args.worker:
        result = worker(json.loads(args.worker))
        if result is not None:
            print(RESULT + json.dumps(result), flush=True)
        return 0
    if not (torch.cuda.is_available() or args.smoke):
        print("bench/gpu_report.py needs a CUDA GPU (or --smoke); none found", file=sys.stderr)
        return 2
    ctx = context(args)
    items = plan(args.models, args.micro, "HF + eager" if args.smoke else "HF + torch.compile", args.smoke)
    guesses = SMOKE_GUESS if args.smoke else FIRST_GUESS
    write(args.out, render(args, ctx, items, finished=False))
    for item in items:
        if item.status != "not reached":
            continue
        elapsed = time.perf_counter() - ctx["start"]
        est = estimate_s(item.kind, items, guesses)
        if elapsed + est > args.budget_s:
            item.status = "skipped"
            item.note = f"would not fit the budget (~{est:.0f} s needed, {args.budget_s - elapsed:.0f} s left)"
        else:
            try:
                run_item(args, item, args.budget_s - elapsed, est)
            except Exception:  # noqa: BLE001 - the next items and the report go on
                item.status, item.note = "failed", traceback.format_exc(limit=5)
        print(f"[{time.perf_counter() - ctx['start']:.0f} s] {item.model} {item.label}: {item.status} "
              f"({item.wall_s:.0f} s)", flush=True)
        write(args.out, render(args, ctx, items, finished=False))
    report = render(args, ctx, items, finished=True)
    write(args.out, report)
    print(report)
    print(f"report written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
