#!/usr/bin/env python
"""A small mixture-of-experts GPT against the dense GPT of the same active size, on 2 CPU processes.

Both run pretrain_gpt.py through torchrun on real text (the quickstart's corpus of standard-library
docstrings and its byte-level BPE, made offline), fp32, 2 processes (DP 2). The MoE model has 8
experts on every second layer (Megatron-DeepSpeed's default --expert-interval 2), top-1 gating and
expert parallel size 2 (4 experts per process, tokens exchanged by all-to-all); the dense model is
the same shape without experts, so both compute the same MLP per token. Prints, for each, the
steady-state tokens/s (the mean time per iteration after the warm-up) and the mean lm loss of the
first and the last 10 iterations (the MoE line also its moe loss and dropped fraction).

    python bench/moe.py [--iters 60] [--warmup 10] [--workdir DIR]
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import os
import re
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SHAPE = dict(layers=4, hidden=256, heads=4, seq=128, micro=4, global_batch=16, vocab=2048)
MOE = "--num-experts 8 --topk 1 --moe-expert-parallel-size 2 --moe-loss-coeff 0.01"


def prepare(workdir: str):
    from megatron_ds.cli.quickstart import run_tool
    from megatron_ds.families.gpt.gpt_quickstart import PRESETS, prepare_data

    preset = dataclasses.replace(PRESETS["cpu"], corpus_mb=2.0, vocab=SHAPE["vocab"])
    os.makedirs(workdir, exist_ok=True)
    with contextlib.redirect_stdout(io.StringIO()):
        prefix, vocab, merges, _, _ = prepare_data(run_tool, workdir, preset, workers=2)
    return prefix, vocab, merges


def train(data, iters: int, extra: str) -> str:
    prefix, vocab, merges = data
    s = SHAPE
    argv = (f"--num-layers {s['layers']} --hidden-size {s['hidden']} --num-attention-heads {s['heads']} "
            f"--seq-length {s['seq']} --max-position-embeddings {s['seq']} --micro-batch-size {s['micro']} "
            f"--global-batch-size {s['global_batch']} --train-iters {iters} --lr 2e-3 --lr-decay-style cosine "
            f"--lr-warmup-iters 5 --data-path {prefix} --vocab-file {vocab} --merge-file {merges} --split 100,0,0 "
            f"--log-interval 1 --eval-iters 0 --eval-interval 0 --num-workers 0 --seed 1234 {extra}").split()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29611",
           os.path.join(REPO, "pretrain_gpt.py"), *argv]
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    if done.returncode != 0:
        raise SystemExit(f"pretrain_gpt.py failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n"
                         f"{done.stderr[-3000:]}")
    return done.stdout


def summary(stdout: str, warmup: int) -> dict:
    def field(name):
        return [float(v) for v in re.findall(rf"\| {re.escape(name)}: ([0-9.eE+-]+) \|", stdout)]

    times = [float(v) for v in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", stdout)]
    steady = times[warmup:]
    lm = field("lm loss")
    out = dict(tokens_per_s=SHAPE["global_batch"] * SHAPE["seq"] / (sum(steady) / len(steady) / 1000.0),
               first=sum(lm[:10]) / 10, last=sum(lm[-10:]) / 10)
    for name in ("moe loss", "moe drop fraction"):
        values = field(name)
        if values:
            out[name] = sum(values[-10:]) / 10
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--workdir", default=None, help="where the corpus and tokenizer go (default: a temporary one)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        data = prepare(args.workdir or tmp)
        results = {name: summary(train(data, args.iters, extra), args.warmup)
                   for name, extra in (("moe", MOE), ("dense", ""))}
    for name, r in results.items():
        extra = "".join(f", {k} {v:.4f}" for k, v in r.items() if k.startswith("moe"))
        print(f"{name:5s}: {r['tokens_per_s']:8.0f} tokens/s (2 processes), lm loss {r['first']:.3f} (first 10) -> "
              f"{r['last']:.3f} (last 10){extra}")
    print(f"moe / dense throughput: {results['moe']['tokens_per_s'] / results['dense']['tokens_per_s']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
