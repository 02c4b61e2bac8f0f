#!/usr/bin/env python
"""Single-GPU model FLOP utilisation of pretrain_gpt.py: GPT 345M and 1.3B, bf16, seq 2048.

TFLOP/s uses DESIGN.md's model-FLOPs formula (the iteration line's "TFLOP/s per GPU");
MFU = that / the device's dense bf16 peak. Needs a CUDA GPU (and DeepSpeed installed there).

    python bench/gpu_mfu.py [--models 345m 1.3b] [--iters 20] [--micro-batch-size 4]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODELS = {  # (layers, hidden, heads): GPT-3 paper shapes, GPT-2 vocabulary
    "345m": (24, 1024, 16),
    "1.3b": (24, 2048, 16),
}
# dense bf16 tensor-core peaks, TFLOP/s (vendor datasheets)
PEAKS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "V100": 125.0}


def device_peak() -> tuple[str, float]:
    name = torch.cuda.get_device_name()
    for key, peak in PEAKS.items():
        if key in name:
            return name, peak
    return name, float("nan")


def run(model: str, iters: int, micro: int, recompute: bool) -> tuple[float, float]:
    from megatron_ds.training.pretrain import main

    layers, hidden, heads = MODELS[model]
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()  # models run one after another in this process
    argv = (f"--num-layers {layers} --hidden-size {hidden} --num-attention-heads {heads} --seq-length 2048 "
            f"--max-position-embeddings 2048 --micro-batch-size {micro} --global-batch-size {micro} "
            f"--train-iters {iters} --lr 1e-4 --mock-data --vocab-size 50257 --bf16 --log-interval 1 "
            f"--eval-iters 0 --eval-interval 0 --num-workers 2 --hidden-dropout 0 --attention-dropout 0").split()
    if recompute:
        argv.append("--checkpoint-activations")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(argv)
    if rc != 0:
        raise SystemExit(f"{model}: pretrain_gpt.py failed (exit {rc})\n{out.getvalue()}")
    tflops = [float(x) for x in re.findall(r"TFLOP/s per GPU: ([0-9.]+)", out.getvalue())]
    mem = [float(x) for x in re.findall(r"peak memory \(GB\): ([0-9.]+)", out.getvalue())]
    steady = tflops[len(tflops) // 2:]  # the first iterations include allocator and kernel warm-up
    return sum(steady) / len(steady), max(mem)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--checkpoint-activations", action="store_true")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/gpu_mfu.py needs a CUDA GPU; none found", file=sys.stderr)
        return 2
    name, peak = device_peak()
    for model in args.models:
        tflops, mem = run(model, args.iters, args.micro_batch_size, args.checkpoint_activations)
        print(f"{name} | GPT {model} | bf16 seq 2048 micro {args.micro_batch_size} | {tflops:.1f} TFLOP/s | "
              f"MFU {100 * tflops / peak:.1f}% | peak memory {mem:.1f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
