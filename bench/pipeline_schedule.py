#!/usr/bin/env python
"""Pipeline schedule efficiency, measured: 1F1B, interleaved 1F1B and ZB-H1 on a model whose layers
cost a fixed time.

Each layer's forward sleeps ``--fwd-ms`` and its backward ``--bwd-ms`` (a timed sleep, so CPU
contention from other processes barely matters: the ranks wait, they do not compute); the backward
is half input gradient (B) and half weight gradient (W), the latter deferrable to a zero-bubble
weight pass (``megatron_ds.parallel.weight_grad``). The pipeline runs on ``--pp`` gloo processes on
this host with the real executor (``megatron_ds.pipeline.executor.InterleavedPipeline``
on DeepSpeed's plain engine, real point-to-point messages, engine backward and optimizer step):
1F1B (``v = 1``), interleaved (``--v`` chunks per rank) and ZB-H1 (``zbh1_schedule``, exact
semantics). One step's compute per rank is ``m * layers_per_rank * (fwd + bwd)``; the ideal step
time adds the bubble: 1F1B ``(p - 1)(F + B + W)``, interleaved ``(p - 1)(F + B + W) / v``, ZB-H1
``(p - 1)(F + B - W)`` (each from an event simulation of the step lists where it is not
interleaved). With the defaults (F = B = W = 40 ms, PP 4, m = 8) ZB-H1's bubble is a third of 1F1B's.

    python bench/pipeline_schedule.py [--pp 4] [--m 8] [--v 2] [--layers 8] [--fwd-ms 40] [--bwd-ms 80]
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


HIDDEN = 8


class _SleepLayerFn(torch.autograd.Function):
    """y = x * w, taking a fixed wall time in forward, in the input gradient and in the weight
    gradient (half of ``bwd_s`` each; the latter deferred during a zero-bubble input backward)."""

    @staticmethod
    def forward(ctx, x, w, fwd_s, bwd_s):
        time.sleep(fwd_s)
        ctx.save_for_backward(x, w)
        ctx.bwd_s = bwd_s
        return x * w

    @staticmethod
    def backward(ctx, grad):
        from megatron_ds.parallel.weight_grad import weight_grad_now_or_later

        time.sleep(ctx.bwd_s / 2)
        x, w = ctx.saved_tensors

        def weight_grad():
            time.sleep(ctx.bwd_s / 2)
            return (grad * x).sum(dim=tuple(range(grad.dim() - 1)))

        return grad * w, weight_grad_now_or_later(w, weight_grad), None, None


class SleepLayer(torch.nn.Module):
    def __init__(self, fwd_s: float, bwd_s: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(HIDDEN))
        self.fwd_s, self.bwd_s = fwd_s, bwd_s

    def forward(self, x):
        return _SleepLayerFn.apply(x, self.weight, self.fwd_s, self.bwd_s)


class SleepChunks(torch.nn.Module):
    """The interface InterleavedPipeline needs from ModelChunks, with sleeping layers."""

    def __init__(self, v: int, layers_per_chunk: int, fwd_s: float, bwd_s: float):
        super().__init__()
        self.v, self.tied_weight, self.tie_group = v, None, None
        self.chunks = torch.nn.ModuleList(
            torch.nn.Sequential(*[SleepLayer(fwd_s, bwd_s) for _ in range(layers_per_chunk)]) for _ in range(v))

    def forward(self, inputs, chunk: int = 0):
        x = inputs[0] if isinstance(inputs, tuple) else inputs
        return self.chunks[chunk](x)

    def layer_files(self, tp_rank):
        return []

    def sync_tied_weights(self):
        pass


def _loss(out, labels):
    return (out.float() - labels[0]).pow(2).mean()


def _batches():
    x, y = torch.ones(1, 1, HIDDEN), torch.zeros(1, 1, HIDDEN)
    while True:
        yield (x,), (y,)


def _worker(rank, world, port, v, zbh1, args, queue):
    import deepspeed

    from megatron_ds.parallel.groups import ParallelState
    from megatron_ds.parallel.schedules import zbh1_schedule
    from megatron_ds.pipeline.executor import InterleavedPipeline

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ps = ParallelState(1, world, 1)
    model = SleepChunks(v, args.layers // (world * v), args.fwd_ms / 1000, args.bwd_ms / 1000)
    config = {"train_batch_size": args.m, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": args.m,
              "steps_per_print": 10 ** 9, "zero_optimization": {"stage": 0}}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1e-3),
                                           config=config, mpu=ps, dist_init_required=False)
    schedule = zbh1_schedule(world, rank, args.m, exact=True) if zbh1 else None
    pipe = InterleavedPipeline(engine, ps, micro_batches=args.m, activation_specs=[((1, 1, HIDDEN), torch.float32)],
                               loss_fn=_loss, schedule=schedule)
    data, times = _batches(), []
    for step in range(args.warmup + args.steps):
        dist.barrier()
        start = time.perf_counter()
        pipe.train_batch(data)
        dist.barrier()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    if rank == 0:
        queue.put(times)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(v: int, zbh1: bool, args) -> list[float]:
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_worker, args=(r, args.pp, port, v, zbh1, args, queue))
             for r in range(args.pp)]
    for p in procs:
        p.start()
    times = queue.get(timeout=1800)
    for p in procs:
        p.join(timeout=120)
        if p.exitcode != 0:
            raise SystemExit(f"a pipeline rank failed (exit code {p.exitcode})")
    return times


def _ideal_step(args, v: int, zbh1: bool) -> float:
    """Seconds one step takes with no overheads: the event simulation of the step lists (interleaved:
    the paper's ``m + (p - 1) / v`` micro-batch slots)."""
    from megatron_ds.parallel.schedules import pipeline_schedule, simulate_step_time, zbh1_schedule

    per_rank = args.layers // args.pp
    f, b = per_rank * args.fwd_ms / 1000, per_rank * args.bwd_ms / 2000
    if v > 1:
        return (args.m + (args.pp - 1) / v) * (f + 2 * b)
    lists = [zbh1_schedule(args.pp, r, args.m, exact=True) if zbh1 else pipeline_schedule(args.pp, r, args.m)
             for r in range(args.pp)]
    return simulate_step_time(lists, f=f, b=b, w=b)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--m", type=int, default=8, help="micro-batches per step")
    p.add_argument("--v", type=int, default=2, help="chunks per rank of the interleaved run")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--fwd-ms", type=float, default=40.0, help="forward time of one layer")
    p.add_argument("--bwd-ms", type=float, default=80.0,
                   help="backward time of one layer: half input gradient, half weight gradient")
    p.add_argument("--steps", type=int, default=4, help="timed steps per schedule")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    args = p.parse_args(argv)
    if args.layers % (args.pp * args.v):
        raise SystemExit(f"--layers {args.layers} must be divisible by pp x v = {args.pp * args.v}")
    per_rank = args.layers // args.pp
    compute = args.m * per_rank * (args.fwd_ms + args.bwd_ms) / 1000  # one rank's work per step, seconds
    print(f"PP {args.pp}, m = {args.m}, {args.layers} layers ({per_rank} per rank), layer fwd {args.fwd_ms} ms + "
          f"bwd {args.bwd_ms} ms: {compute * 1000:.0f} ms of compute per rank and step; "
          f"{args.steps} timed steps after {args.warmup} warm-up")
    results = {}
    for name, v, zbh1 in (("1F1B", 1, False), (f"interleaved v={args.v}", args.v, False), ("ZB-H1", 1, True)):
        times = measure(v, zbh1, args)
        step = min(times)  # the least disturbed step: the schedule's own time plus fixed overheads
        ideal = _ideal_step(args, v, zbh1)
        results[name] = step
        print(f"{name:16s}: step {step * 1000:7.1f} ms (mean {sum(times) / len(times) * 1000:7.1f}), ideal "
              f"{ideal * 1000:7.1f} ms ({step / ideal - 1:+.1%}); bubble {step / compute - 1:6.1%} of compute "
              f"(ideal {ideal / compute - 1:6.1%}); efficiency {compute / step:6.1%}")
    predicted = (args.m + args.pp - 1) / (args.m + (args.pp - 1) / args.v)
    print(f"speed-up of interleaving: measured {results['1F1B'] / results[f'interleaved v={args.v}']:.3f}x, "
          f"predicted {predicted:.3f}x")
    print(f"ZB-H1 bubble / 1F1B bubble: measured {(results['ZB-H1'] - compute) / (results['1F1B'] - compute):.3f}, "
          f"ideal {(_ideal_step(args, 1, True) - compute) / (_ideal_step(args, 1, False) - compute):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
