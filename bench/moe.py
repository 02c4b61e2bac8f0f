#!/usr/bin/env python
"""Mixture of experts: Megatron-LM's MoE layer (model/mlm_moe.py) against DeepSpeed-MoE (model/moe_layer.py)
on the same shape, and MoE GPTs against the dense GPT of the same active size.

    python bench/moe.py                    # the layers, 2 gloo processes on the CPU (about 1 minute)
    python bench/moe.py --device cuda      # the layers on one GPU, bf16: also the grouped GEMM against the loop
    python bench/moe.py --train [--iters 60] [--warmup 10] [--workdir DIR]   # whole models, 2 CPU processes

**Layers** (the default): one MoE layer of each implementation, built from the same model configuration as a
training run builds it, forward and backward on random tokens, ``--tokens`` per process: 8 experts, top-2,
expert parallel size 2 on the CPU (4 experts per process; one process and EP 1 on a GPU). The rows:

- DeepSpeed-MoE, top-2 with capacity factor 1 (Megatron-DeepSpeed's default, tokens beyond it dropped) and
  dropless (``--disable-moe-token-dropping``); its tokens travel by all-to-all in [experts, capacity] slots;
- Megatron-LM's layer, dropless, by its all-gather and its all-to-all dispatchers
  (``--moe-token-dispatcher-type``); on a GPU also with ``--moe-grouped-gemm`` (one ``torch._grouped_mm`` per
  linear instead of one GEMM per expert: what the GPU report measures in a whole model too).

Per row: milliseconds per forward + backward (the slowest process, median of ``--iters``), tokens per second
over all processes, and the **bytes a process sends per token it owns**: every collective the layer calls
during the timed iterations is counted as a ring algorithm moves data (all-to-all: the parts for other
ranks; all-gather: the input to each of the n - 1 others; reduce-scatter: (n - 1) / n of the input;
all-reduce: twice that), divided by the tokens. Gloo has no reduce-scatter: there the parallel mappings run it as
an all-reduce (parallel/mappings.py), so on the CPU the all-gather dispatcher's return path counts twice what
NCCL sends. On the CPU the time is gloo's and the CPU's: the bytes are
the figure that carries over to a cluster; the GPU's times are the ones that decide anything
(bench/RESULTS.md).

**Training** (``--train``): pretrain_gpt.py through torchrun on real text (the quickstart's corpus of
standard-library docstrings and its byte-level BPE, made offline), fp32, 2 processes (DP 2): the dense GPT,
DeepSpeed-MoE (8 experts on every second layer, top-2, capacity factor 1, EP 2) and Megatron-LM's MoE on the
same layers (``--moe-layer-freq 2``, top-2, dropless, all-to-all, EP 2). Prints each run's steady-state tokens/s
(the mean time per iteration after the warm-up) and the mean lm loss of the first and the last 10 iterations.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import inspect
import io
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# --------------------------------------------------------------------------- layers

LAYER = dict(hidden=256, ffn=512, experts=8, topk=2, seq=256)
# each row: (label, ModelConfig fields beyond the shape, Megatron-LM's layer?)
DS_ROWS = [("DeepSpeed-MoE, capacity factor 1", dict(topk=2)),
           ("DeepSpeed-MoE, dropless", dict(topk=2, disable_moe_token_dropping=True))]
MLM_ROWS = [("Megatron-LM, allgather dispatch", dict(moe_token_dispatcher_type="allgather")),
            ("Megatron-LM, alltoall dispatch", dict(moe_token_dispatcher_type="alltoall"))]
GROUPED_ROW = ("Megatron-LM, alltoall, --moe-grouped-gemm", dict(moe_token_dispatcher_type="alltoall",
                                                                  moe_grouped_gemm=True))


class WireBytes:
    """Bytes this process sends through torch.distributed's collectives while ``counting`` (module docstring)."""

    def __init__(self):
        import torch.distributed as dist

        self.sent, self.counting = 0, False
        size = dist.get_world_size

        def a2a(a):  # the rows for the other ranks
            inp, group = a["input"], a.get("group")
            n, me = size(group), dist.get_rank(group)
            rows = a.get("input_split_sizes") or [inp.shape[0] // n] * n
            return (sum(rows) - rows[me]) * (_bytes(inp) // max(inp.shape[0], 1))

        counters = {"all_to_all_single": a2a,
                    "all_gather_into_tensor": lambda a: (size(a.get("group")) - 1) * _bytes(a["input_tensor"]),
                    "all_gather": lambda a: (size(a.get("group")) - 1) * _bytes(a["tensor"]),
                    "reduce_scatter_tensor": lambda a: (size(a.get("group")) - 1) * _bytes(a["input"])
                    // size(a.get("group")),
                    "all_reduce": lambda a: 2 * (size(a.get("group")) - 1) * _bytes(a["tensor"]) // size(a.get("group"))}
        for name, count in counters.items():
            setattr(dist, name, self._counted(getattr(dist, name), count))

    def _counted(self, fn, count):
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if self.counting:
                self.sent += count(signature.bind(*args, **kwargs).arguments)
            return fn(*args, **kwargs)
        return wrapper


def _bytes(t) -> int:
    return t.numel() * t.element_size()


def _config(fields: dict):
    """The layer's model configuration, resolved as a command line's (Megatron-LM's layer: top-2 by default)."""
    from megatron_ds.config.layout import resolve_model_config
    from megatron_ds.config.schema import ModelConfig

    s = LAYER
    return resolve_model_config(ModelConfig(
        num_layers=2, hidden_size=s["hidden"], ffn_hidden_size=s["ffn"], num_attention_heads=4, seq_length=s["seq"],
        max_position_embeddings=s["seq"], num_experts=(s["experts"],), **fields))


def _build(fields: dict, ep: int, ep_rank: int, dtype, device):
    import torch

    from megatron_ds.config import moe_selection
    from megatron_ds.model.mlm_moe import build_mlm_moe
    from megatron_ds.model.transformer import ParallelTransformerLayer

    cfg = _config(fields)
    torch.manual_seed(1234)
    if moe_selection.is_mlm_moe(cfg):
        layer = build_mlm_moe(cfg, LAYER["experts"], ep_size=ep, ep_rank=ep_rank, params_dtype=dtype, device=device)
        return layer, lambda x: layer(x)
    parallel = dict(tp_group=None, sequence_parallel=False, params_dtype=dtype, device=device, fp8=None)
    layer = ParallelTransformerLayer._build_moe(cfg, LAYER["experts"], ep, ep_rank, parallel).to(device)
    layer.set_deepspeed_parallelism()
    return layer, lambda x: layer(x)[:2]


def layer_worker(rank: int, world: int, port: int, rows, args) -> list[dict] | None:
    """One process of the layer benchmark: its rows' timings and bytes (rank 0 returns them)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    import deepspeed
    import torch
    import torch.distributed as dist

    from megatron_ds import ds_compat
    from megatron_ds.parallel.groups import ParallelState

    ds_compat.skip_shm_comm_op()
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    else:  # one thread per process, as torchrun's children run (OMP_NUM_THREADS=1): 2 processes on 2 cores
        torch.set_num_threads(1)
    deepspeed.init_distributed("nccl" if cuda else "gloo", verbose=False)
    ep = world
    ps = ParallelState(1, 1)
    ps.expert_groups(ep, False)
    wire = WireBytes()
    device, dtype = (torch.device("cuda", rank), torch.bfloat16) if cuda else (torch.device("cpu"), torch.float32)
    out = []
    for label, fields in rows:
        layer, step = _build(fields, ep, ps.expert_parallel_rank(ep, False), dtype, device)
        gen = torch.Generator(device=device).manual_seed(rank)
        x = torch.randn(LAYER["seq"], args.tokens // LAYER["seq"], LAYER["hidden"], generator=gen, device=device,
                        dtype=dtype, requires_grad=True)
        times = []
        for i in range(args.warmup + args.iters):
            wire.counting = i >= args.warmup
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            y, aux = step(x)
            (y.float().square().mean() + aux.float().sum()).backward()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            wire.counting = False
        slowest = torch.tensor([statistics.median(times[args.warmup:])], dtype=torch.float64)
        sent = torch.tensor([float(wire.sent)], dtype=torch.float64)
        wire.sent = 0
        if cuda:
            slowest, sent = slowest.cuda(), sent.cuda()
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        dist.all_reduce(sent)
        sec = slowest.item()
        out.append(dict(label=label, ms=1000 * sec, tokens_per_s=world * args.tokens / sec,
                        bytes_per_token=sent.item() / world / args.iters / args.tokens))
        del layer, step
    dist.destroy_process_group()
    return out if rank == 0 else None


def _spawned(rank, world, port, rows, args, queue):
    result = layer_worker(rank, world, port, rows, args)
    if result is not None:
        queue.put(result)
    queue.close()
    queue.join_thread()  # the result is in the pipe
    # no interpreter teardown: a process group's threads can still be joinable in C++ static destructors there,
    # which aborts the process ("terminate called without an active exception") after its work is done
    os._exit(0)


def run_layers(args) -> list[dict]:
    import torch.multiprocessing as mp

    rows = DS_ROWS + MLM_ROWS + ([GROUPED_ROW] if args.device == "cuda" else [])
    world = 1 if args.device == "cuda" else 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_spawned, args=(r, world, port, rows, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise SystemExit(f"a layer benchmark process failed (exit codes {[p.exitcode for p in procs]})")
    return queue.get()


def print_layers(args, results: list[dict]) -> None:
    where = "1 GPU, bf16, EP 1" if args.device == "cuda" else "2 gloo processes on the CPU, fp32, EP 2"
    s = LAYER
    print(f"MoE layer, {s['experts']} experts, top-{s['topk']}, hidden {s['hidden']}, expert ffn {s['ffn']}, "
          f"{args.tokens} tokens per process, {where}; median of {args.iters} forward + backward")
    print("| layer | ms | tokens/s | bytes sent per token |\n|---|---:|---:|---:|")
    for r in results:
        print(f"| {r['label']} | {r['ms']:.2f} | {r['tokens_per_s']:.0f} | {r['bytes_per_token']:.0f} |")
    if args.device != "cuda":
        print("(gloo runs a reduce-scatter as an all-reduce: the allgather row's return path counts twice NCCL's)")


# --------------------------------------------------------------------------- whole models

SHAPE = dict(layers=4, hidden=256, heads=4, seq=128, micro=4, global_batch=16, vocab=2048)
TRAIN_RUNS = (("dense", ""),
              ("DeepSpeed-MoE", "--num-experts 8 --topk 2 --moe-expert-parallel-size 2 --moe-loss-coeff 0.01"),
              ("Megatron-LM MoE", "--num-experts 8 --moe-layer-freq 2 --moe-router-topk 2 --expert-model-parallel-size 2 "
                                  "--moe-token-dispatcher-type alltoall --moe-router-load-balancing-type aux_loss "
                                  "--moe-aux-loss-coeff 0.01"))


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
    return dict(tokens_per_s=SHAPE["global_batch"] * SHAPE["seq"] / (sum(steady) / len(steady) / 1000.0),
                first=sum(lm[:10]) / 10, last=sum(lm[-10:]) / 10)


def run_training(args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        data = prepare(args.workdir or tmp)
        results = {name: summary(train(data, args.iters, extra), args.warmup) for name, extra in TRAIN_RUNS}
    for name, r in results.items():
        print(f"{name:16s}: {r['tokens_per_s']:8.0f} tokens/s (2 processes), lm loss {r['first']:.3f} (first 10) -> "
              f"{r['last']:.3f} (last 10), {r['tokens_per_s'] / results['dense']['tokens_per_s']:.2f} x dense")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train", action="store_true", help="whole models through pretrain_gpt.py (module docstring)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="the layers: where they run")
    p.add_argument("--tokens", type=int, default=4096, help="the layers: tokens per process (a multiple of 256)")
    p.add_argument("--iters", type=int, default=None, help="timed iterations (layers: 10; --train: 60)")
    p.add_argument("--warmup", type=int, default=None, help="untimed first iterations (layers: 3; --train: 10)")
    p.add_argument("--workdir", default=None, help="--train: where the corpus and tokenizer go (default: temporary)")
    args = p.parse_args(argv)
    if args.train:
        args.iters, args.warmup = args.iters or 60, 10 if args.warmup is None else args.warmup
        run_training(args)
        return 0
    args.iters, args.warmup = args.iters or 10, 3 if args.warmup is None else args.warmup
    if args.tokens % LAYER["seq"]:
        p.error(f"--tokens must be a multiple of {LAYER['seq']}")
    print_layers(args, run_layers(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
