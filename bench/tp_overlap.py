#!/usr/bin/env python
"""Tensor-parallel communication overlap, measured on the CPU: the backward of one transformer MLP
(ColumnParallelLinear h -> 4h, GeLU, RowParallelLinear 4h -> h) at TP 2, with the input gradient's
all-reduce run during the weight-gradient GEMM (``megatron_ds.parallel.async_comm``,
``--async-tensor-model-parallel-allreduce``) and after it (the default until a GPU measurement
shows the overlap helps).

Two gloo processes on this host; the link is made slow as between GPUs over a busy network: every
asynchronous or blocking all-reduce completes no earlier than ``--link-ms`` after it was issued
(the real all-reduce runs too, so the numbers are the real ones). With the overlap, the
column-parallel layer's backward takes about max(weight GEMM, link) instead of their sum. Only the
column-parallel layer's all-reduce can hide: the row-parallel layer has no communication in
backward (its forward's all-reduce is not overlapped, in Megatron either).
Each rank uses one thread (``torch.set_num_threads(1)``), so the two ranks do not fight for cores.

    python bench/tp_overlap.py [--hidden 512] [--tokens 1024] [--link-ms 20] [--iters 10]
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _slow_link(link_s: float):
    """Make every all-reduce take at least ``link_s`` from its issue to its completion."""
    real = dist.all_reduce

    class SlowWork:
        def __init__(self, work, issued):
            self.work, self.issued = work, issued

        def wait(self):
            time.sleep(max(0.0, self.issued + link_s - time.monotonic()))
            return self.work.wait()

    def all_reduce(tensor, *args, async_op=False, **kwargs):
        issued = time.monotonic()
        work = real(tensor, *args, async_op=async_op, **kwargs)
        if async_op:
            return SlowWork(work, issued)
        time.sleep(max(0.0, issued + link_s - time.monotonic()))
        return work

    dist.all_reduce = all_reduce


def _worker(rank: int, world: int, port: int, args, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron_ds.parallel.layers import ColumnParallelLinear, RowParallelLinear

    _slow_link(args.link_ms / 1000)
    group = dist.new_group(list(range(world)))
    h, times = args.hidden, {False: [], True: []}
    layers = {overlap: (ColumnParallelLinear(h, 4 * h, tp_group=group, gather_output=False, async_grad_comm=overlap),
                        RowParallelLinear(4 * h, h, tp_group=group, input_is_parallel=True))
              for overlap in (False, True)}
    x = torch.randn(args.tokens, 1, h, generator=torch.Generator().manual_seed(0), requires_grad=True)
    for i in range(args.iters + 2):  # two warm-up iterations; the modes alternate, so load drifts hit both
        for overlap, (up, down) in layers.items():
            out, _ = down(torch.nn.functional.gelu(up(x)[0]))
            dist.barrier()
            start = time.perf_counter()
            out.sum().backward()
            dist.barrier()
            if i >= 2:
                times[overlap].append(time.perf_counter() - start)
    if rank == 0:
        queue.put({overlap: statistics.median(t) for overlap, t in times.items()})
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=1024, help="sequence x micro batch")
    parser.add_argument("--link-ms", type=float, default=20.0, help="time each all-reduce takes at least")
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, args, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = queue.get(timeout=600)
    for p in procs:
        p.join()
    sync, overlapped = results[False], results[True]
    print(f"MLP backward at TP 2 (hidden {args.hidden}, {args.tokens} tokens, all-reduce >= {args.link_ms:g} ms), "
          f"median of {args.iters}:")
    print(f"  all-reduce after the weight GEMM (default):                               {sync * 1e3:8.1f} ms")
    print(f"  all-reduce during the weight GEMM (--async-tensor-model-parallel-allreduce): {overlapped * 1e3:8.1f} ms")
    print(f"  saved: {(sync - overlapped) * 1e3:.1f} ms per layer ({(1 - overlapped / sync) * 100:.0f}%)")


if __name__ == "__main__":
    main()
