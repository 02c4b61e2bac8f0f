#!/usr/bin/env python
"""Context parallelism's attention blocks against plain SDPA at the same length, one device.

    python bench/cp_attention.py                         # CPU, fp32, short sequences (a minute)
    python bench/cp_attention.py --device cuda --seq 8192 16384    # one GPU, bf16

Each rank of a context parallel run computes its attention as blocks (parallel/context_parallel.py: per pair of
a query chunk and a visible key chunk, merged with the online softmax), each block run by --cp-block-kernel's
kernel (parallel/attention_blocks.py): ``math`` (the explicit path, scores, log-sum-exp, softmax and product in
fp32; the default) or ``flash`` (torch's flash attention operator, returning the log-sum-exp). Here one process
runs those blocks over a whole sequence (CP 1: its two chunks, no exchange: the kernels alone) with each kernel,
and torch's SDPA over the same causal sequence (flash attention on CUDA), forward and backward, and prints for
each the median milliseconds and, on CUDA, the peak memory the call added. Whether ``flash`` beats ``math`` on a
GPU decides --cp-block-kernel's default; the GPU report (bench/gpu_report.py) runs this at one length.
"""
from __future__ import annotations

import argparse
import socket
import statistics
import sys
import time


def _one_process_group() -> None:
    """A world of one (gloo), which ``ContextParallel`` reads its rank and neighbours from."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def measure(seq: int, *, heads: int = 16, head_dim: int = 128, batch: int = 1, device: str = "cpu",
            iters: int = 5, warmup: int = 2) -> dict:
    """{"sdpa_ms", "blocks_ms", "flash_ms", "sdpa_gib", "blocks_gib", "flash_gib"} of forward + backward at
    ``seq`` ("blocks": the math kernel's, "flash": the flash kernel's; GiB: CUDA's peak memory above what was
    allocated before the call; NaN elsewhere)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from megatron_ds.parallel.context_parallel import ContextParallel

    _one_process_group()
    cuda = device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype, generator=gen, requires_grad=True)
               for _ in range(3))
    grad = torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype, generator=gen)
    math_cp, flash_cp = (ContextParallel(dist.group.WORLD, "p2p", kernel) for kernel in ("math", "flash"))
    runs = {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            "blocks": lambda: math_cp.attention(q, k, v), "flash": lambda: flash_cp.attention(q, k, v)}
    out = {}
    for name, call in runs.items():
        times = []
        for i in range(warmup + iters):
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
            start = time.perf_counter()
            call().backward(grad)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            q.grad = k.grad = v.grad = None
        out[f"{name}_ms"] = 1000 * statistics.median(times[warmup:])
        out[f"{name}_gib"] = (torch.cuda.max_memory_allocated() - before) / 2 ** 30 if cuda else float("nan")
    return out


def table_cells(r: dict) -> str:
    """``measure``'s result as the cells of a markdown row (the GPU report prints them too)."""
    return " | ".join([f"{r['sdpa_ms']:.1f}", f"{r['blocks_ms']:.1f}", f"{r['flash_ms']:.1f}",
                       f"{r['blocks_ms'] / r['sdpa_ms']:.2f}", f"{r['flash_ms'] / r['sdpa_ms']:.2f}",
                       f"{r['sdpa_gib']:.2f}", f"{r['blocks_gib']:.2f}", f"{r['flash_gib']:.2f}"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--seq", type=int, nargs="+", default=None, help="lengths (default: CPU 1024 2048, CUDA 8192)")
    p.add_argument("--heads", type=int, default=None, help="default: CPU 4, CUDA 16")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=5)
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    seqs = args.seq or ([8192] if cuda else [1024, 2048])
    heads = args.heads or (16 if cuda else 4)
    print(f"causal attention, {heads} heads of {args.head_dim}, batch 1, {'bf16 on CUDA' if cuda else 'fp32 on CPU'}: "
          f"forward + backward, median of {args.iters}")
    print("| seq | SDPA ms | math blocks ms | flash blocks ms | math / SDPA | flash / SDPA | SDPA GiB | math GiB | "
          "flash GiB |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for seq in seqs:
        r = measure(seq, heads=heads, head_dim=args.head_dim, device=args.device, iters=args.iters)
        print(f"| {seq} | {table_cells(r)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
