#!/usr/bin/env python
"""Single-GPU model FLOP utilisation: pretrain_gpt.py against a Hugging Face model + torch.compile
at the same shape, in the same run, with the ratio.

Shapes (bf16, seq 2048, GPT-2 vocabulary 50257): GPT 345M / 1.3B / 2.7B and a Llama-style 1.3B
(RoPE, SwiGLU ffn 5504, RMSNorm, no bias, untied output layer). Both sides are timed per
iteration after warm-up and given the same model-FLOPs count (the GPT family's, families/gpt/gpt_flops.py:
the matmuls the model runs), so the ratio is a ratio of step times; MFU = TFLOP/s / the device's dense
bf16 peak. Ours: the real CLI (pipeline engine, PP 1, DeepSpeed's bf16 optimizer, --mock-data).
Baseline: transformers' GPT2LMHeadModel / LlamaForCausalLM (SDPA attention) in fp32 weights under
bf16 autocast with fused AdamW -- the usual HF recipe -- compiled with torch.compile (or eager).

    python bench/gpu_mfu.py                         # all four shapes, micro batch 4
    python bench/gpu_mfu.py --models gpt-1.3b --micro-batch-size 8
    python bench/gpu_mfu.py --dry-run               # what would run, and each shape's FLOPs
    python bench/gpu_mfu.py --smoke                 # tiny shapes, a few steps, any device (CPU too)
    python bench/gpu_mfu.py --fusions both          # ours with the fused kernels off, then on: the gain

``--fusions off`` runs ours with Megatron-LM's --no-bias-gelu-fusion --no-bias-swiglu-fusion
--no-bias-dropout-fusion --no-rope-fusion and --no-liger-kernel (megatron_ds/model/fusions.py,
liger.py); ``on`` (the default) is what a user gets.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import os
import re
import subprocess
import sys
import time

import torch

from megatron_ds.accelerator import on_cuda

VOCAB = 50257
SHAPES = {  # layers, hidden, heads, ffn (None: 4h, GeLU), llama-style
    "gpt-345m": (24, 1024, 16, None, False),
    "gpt-1.3b": (24, 2048, 16, None, False),
    "gpt-2.7b": (32, 2560, 32, None, False),
    "llama-1.3b": (24, 2048, 16, 5504, True),
}
SMOKE_SHAPES = {"gpt-tiny": (2, 64, 4, None, False), "llama-tiny": (2, 64, 4, 176, True)}
LLAMA_FLAGS = ("--use-rotary-position-embeddings --swiglu --normalization rmsnorm --disable-bias-linear "
               "--untie-embeddings-and-output-weights").split()
FUSIONS_OFF = ("--no-bias-gelu-fusion --no-bias-swiglu-fusion --no-bias-dropout-fusion --no-rope-fusion "
               "--no-liger-kernel").split()
# dense bf16 tensor-core peaks, TFLOP/s (vendor datasheets)
PEAKS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "V100": 125.0}


def device_peak() -> tuple[str, float]:
    if not on_cuda():
        return "cpu", float("nan")
    name = torch.cuda.get_device_name()
    return name, next((peak for key, peak in PEAKS.items() if key in name), float("nan"))


def our_argv(shape, seq: int, micro: int, iters: int, recompute: bool, precision: str,
             fusions: bool = True) -> list[str]:
    layers, hidden, heads, ffn, llama = shape
    argv = (f"--num-layers {layers} --hidden-size {hidden} --num-attention-heads {heads} --seq-length {seq} "
            f"--max-position-embeddings {seq} --micro-batch-size {micro} --global-batch-size {micro} "
            f"--train-iters {iters} --lr 1e-4 --mock-data --vocab-size {VOCAB} --log-interval 1 "
            f"--eval-iters 0 --eval-interval 0 --num-workers 2 --hidden-dropout 0 --attention-dropout 0").split()
    argv += [f"--{precision}"] if precision != "fp32" else []
    if llama:
        argv += LLAMA_FLAGS + ["--ffn-hidden-size", str(ffn)]
    if recompute:
        argv.append("--checkpoint-activations")
    return argv + ([] if fusions else FUSIONS_OFF)


def model_flops(argv: list[str], micro: int, vocab: int | None = None) -> float:
    """Model FLOPs of one iteration of this shape (vocab: the output layer's width; default ours,
    i.e. padded)."""
    from megatron_ds.config import parse_args, resolve
    from megatron_ds.families import get_family
    from megatron_ds.families.gpt.gpt_flops import model_flops_per_iteration

    cfg, _ = parse_args(argv)
    layout = resolve(cfg, world_size=1, vocab_size=VOCAB, family=get_family("gpt"), device_type="cpu").layout
    return model_flops_per_iteration(layout.model, micro, vocab or layout.padded_vocab_size,
                                     layout.recompute == "full")


def run_ours(argv: list[str]) -> tuple[float, float]:
    """(seconds per iteration over the second half of the run, peak memory GB) from the log; NaNs on a
    rank of a multi-process run other than the last, which prints the iteration lines (as Megatron's
    ``print_rank_last``)."""
    from megatron_ds.families import main

    _reset_memory()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(argv)
    if rc != 0:
        raise SystemExit(f"pretrain_gpt.py failed (exit {rc})\n{out.getvalue()[-3000:]}")
    ms = [float(x) for x in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", out.getvalue())]
    mem = [float(x) for x in re.findall(r"peak memory \(GB\): ([0-9.]+)", out.getvalue())]
    if not ms and int(os.environ.get("RANK", "0")) != int(os.environ.get("WORLD_SIZE", "1")) - 1:
        return float("nan"), float("nan")
    steady = ms[len(ms) // 2:]  # the first iterations include allocator and kernel warm-up
    return sum(steady) / len(steady) / 1000.0, max(mem)


def build_hf_model(shape, seq: int, device: torch.device):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    layers, hidden, heads, ffn, llama = shape
    if llama:
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                             num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=seq,
                             rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False, mlp_bias=False)
        cls = LlamaForCausalLM
    else:
        config = GPT2Config(vocab_size=VOCAB, n_positions=seq, n_embd=hidden, n_layer=layers, n_head=heads,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        cls = GPT2LMHeadModel
    config._attn_implementation = "sdpa"
    with torch.device(device):
        return cls(config)


def run_hf(shape, seq: int, micro: int, iters: int, compile_model: bool, precision: str) -> tuple[float, float]:
    """(seconds per iteration after warm-up, peak memory GB) of the HF baseline."""
    device = torch.device("cuda" if on_cuda() else "cpu")
    _reset_memory()
    model = build_hf_model(shape, seq, device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    step_model = torch.compile(model) if compile_model else model
    gen = torch.Generator(device=device).manual_seed(0)
    tokens = torch.randint(0, VOCAB, (micro, seq), device=device, generator=gen)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)

    def step():
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = step_model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    warmup = max(2, iters // 2)
    for _ in range(warmup):  # compilation and allocator warm-up
        step()
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters - warmup):
        step()
    _sync(device)
    seconds = (time.perf_counter() - start) / max(1, iters - warmup)
    mem = torch.cuda.max_memory_allocated() / 2 ** 30 if device.type == "cuda" else float("nan")
    del model, step_model, optimizer
    return seconds, mem


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _reset_memory():
    gc.collect()
    if on_cuda():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES) + list(SMOKE_SHAPES))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--checkpoint-activations", action="store_true")
    p.add_argument("--baseline", choices=("compile", "eager", "none"), default="compile")
    p.add_argument("--fusions", choices=("on", "off", "both"), default="on",
                   help="ours with the fused kernels (compiled bias-GeLU/SwiGLU/dropout-add/RoPE, liger's "
                        "linear + cross entropy) on, off, or both one after the other")
    p.add_argument("--dry-run", action="store_true", help="print each shape's command and FLOPs; run nothing")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes, seq 64, 4 steps, eager baseline unless --baseline given: a quick "
                        "check that both sides run (any device)")
    p.add_argument("--worker", choices=("ours", "hf"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        explicit = argv is not None and "--baseline" in argv or argv is None and "--baseline" in sys.argv
        args.models = [m for m in args.models if m in SMOKE_SHAPES] or list(SMOKE_SHAPES)
        args.seq_length, args.iters, args.micro_batch_size = 64, 4, 2
        args.baseline = args.baseline if explicit else "eager"
    return args


def _measure(side: str, model: str, args, fusions: str = "on") -> tuple[float, float]:
    """One side of one shape in a fresh process: nothing (GPU memory, compile caches, DeepSpeed
    state) carries over from the other side or the previous shape."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", side, "--models", model, "--iters", str(args.iters),
           "--micro-batch-size", str(args.micro_batch_size), "--seq-length", str(args.seq_length),
           "--baseline", args.baseline, "--fusions", fusions] + (["--checkpoint-activations"]
                                                                   if args.checkpoint_activations else [])
    # a port of our own: 29500 (the single-process default) may be taken by another job on the node
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    results = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not results:
        raise SystemExit(f"{side} {model} failed (exit {proc.returncode})\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    result = json.loads(results[-1])
    return result["seconds"], result["memory_gb"]


def _free_port() -> int:
    import socket  # noqa: PLC0415

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(args, shape, precision) -> int:
    if args.worker == "ours":
        argv = our_argv(shape, args.seq_length, args.micro_batch_size, args.iters, args.checkpoint_activations,
                        precision, fusions=args.fusions != "off")
        seconds, mem = run_ours(argv)
    else:
        seconds, mem = run_hf(shape, args.seq_length, args.micro_batch_size, args.iters,
                              args.baseline == "compile", precision)
    print(json.dumps({"seconds": seconds, "memory_gb": mem}), flush=True)
    return 0


def main(argv=None) -> int:
    args = parse(argv)
    shapes = {**SHAPES, **SMOKE_SHAPES}
    cuda = on_cuda()
    precision = "bf16"  # every shape of the goal is bf16 (CPU smoke runs too)
    if args.worker:
        return _worker(args, shapes[args.models[0]], precision)
    if not (cuda or args.dry_run or args.smoke):
        print("bench/gpu_mfu.py needs a CUDA GPU (or --dry-run / --smoke); none found", file=sys.stderr)
        return 2
    name, peak = device_peak()
    print(f"device: {name} (bf16 peak {peak} TFLOP/s) | seq {args.seq_length} | micro batch "
          f"{args.micro_batch_size} | {args.iters} iterations | baseline: HF + {args.baseline} | "
          f"fusions: {args.fusions}")
    for model in args.models:
        shape = shapes[model]
        argv = our_argv(shape, args.seq_length, args.micro_batch_size, args.iters, args.checkpoint_activations,
                        precision)
        ours_flops = model_flops(argv, args.micro_batch_size)
        hf_flops = model_flops(argv, args.micro_batch_size, vocab=VOCAB)  # HF does not pad the vocabulary
        if args.dry_run:
            print(f"{model}: {ours_flops / 1e12:.2f} TFLOP per iteration | pretrain_gpt.py {' '.join(argv)}"
                  + (f" (fusions off: + {' '.join(FUSIONS_OFF)})" if args.fusions != "on" else ""))
            continue
        if args.fusions == "both":
            off_sec, off_mem = _measure("ours", model, args, "off")
            print(f"{model} | ours, fusions off {_rate(ours_flops, off_sec, peak)} | {off_mem:.1f} GB", flush=True)
        fusions = "off" if args.fusions == "off" else "on"
        sec, mem = _measure("ours", model, args, fusions)
        row = f"{model} | ours, fusions {fusions} {_rate(ours_flops, sec, peak)} | {mem:.1f} GB"
        if args.fusions == "both":
            row += f" | fusion gain {off_sec / sec:.2f}x"
        if args.baseline != "none":
            hf_sec, hf_mem = _measure("hf", model, args)
            row += (f" || HF + {args.baseline} {_rate(hf_flops, hf_sec, peak)} | {hf_mem:.1f} GB"
                    f" || ratio {(ours_flops / sec) / (hf_flops / hf_sec):.2f}x")
        print(row, flush=True)
    return 0


def _rate(flops: float, seconds: float, peak: float) -> str:
    tflops = flops / seconds / 1e12
    return f"{seconds * 1000:.1f} ms/it {tflops:.1f} TFLOP/s MFU {100 * tflops / peak:.1f}%"


if __name__ == "__main__":
    sys.exit(main())
