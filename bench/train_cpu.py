#!/usr/bin/env python
"""CPU training throughput: pretrain_gpt.py vs a plain PyTorch loop over HF transformers' GPT2LMHeadModel.

Same shape (about 20M parameters), same batches (the --mock-data samples), same precision (fp32),
same threads, one process, one run. Prints tokens/s of each and the ratio (target >= 1.0).

    python bench/train_cpu.py [--iters 30] [--warmup 10]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import re
import sys
import time

import torch


SHAPE = dict(layers=8, hidden=256, heads=8, seq=256, vocab=50304, micro=8)


def run_megatron_ds(iters: int, warmup: int) -> float:
    from megatron_ds.families import main

    s = SHAPE
    argv = (f"--num-layers {s['layers']} --hidden-size {s['hidden']} --num-attention-heads {s['heads']} "
            f"--seq-length {s['seq']} --max-position-embeddings {s['seq']} --micro-batch-size {s['micro']} "
            f"--global-batch-size {s['micro']} --train-iters {iters} --lr 1e-4 --lr-decay-style constant "
            f"--mock-data --vocab-size {s['vocab']} --make-vocab-size-divisible-by 128 "
            f"--hidden-dropout 0.1 --attention-dropout 0.1 --log-interval 1 --eval-iters 0 --eval-interval 0 "
            f"--num-workers 0 --seed 1234").split()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(argv)
    if rc != 0:
        raise SystemExit(f"pretrain_gpt.py failed (exit {rc}):\n{out.getvalue()}")
    times = [float(x) for x in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", out.getvalue())]
    steady = times[warmup:]
    return s["micro"] * s["seq"] / (sum(steady) / len(steady) / 1000.0)


def run_hf(iters: int, warmup: int) -> float:
    from transformers import GPT2Config, GPT2LMHeadModel

    from megatron_ds.training.data import MockGPTDataset

    s = SHAPE
    torch.manual_seed(1234)
    config = GPT2Config(n_layer=s["layers"], n_embd=s["hidden"], n_head=s["heads"], n_positions=s["seq"],
                        vocab_size=s["vocab"], resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    model = GPT2LMHeadModel(config)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, foreach=True)
    data = MockGPTDataset(iters * s["micro"], s["seq"], s["vocab"], seed=1234)
    times = []
    for it in range(iters):
        t0 = time.perf_counter()
        batch = torch.stack([torch.from_numpy(data[it * s["micro"] + i]["text"]) for i in range(s["micro"])])
        out = model(input_ids=batch[:, :-1], labels=batch[:, :-1])  # HF shifts labels internally
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    steady = times[warmup:]
    return s["micro"] * s["seq"] / (sum(steady) / len(steady))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10)
    args = p.parse_args(argv)
    threads = torch.get_num_threads()
    ours = run_megatron_ds(args.iters, args.warmup)
    hf = run_hf(args.iters, args.warmup)
    print(f"shape: {SHAPE}, fp32, {threads} threads, {args.iters - args.warmup} timed iterations each")
    print(f"megatron_ds pretrain_gpt.py : {ours:10.1f} tokens/s")
    print(f"HF GPT2LMHeadModel loop     : {hf:10.1f} tokens/s")
    print(f"ratio (ours / HF)           : {ours / hf:10.3f}  (target >= 1.0)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
