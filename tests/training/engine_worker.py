"""The real engine of a GPT run, built inside a gloo test process from flags, fed hand-made micro-batches."""
from __future__ import annotations

import contextlib
import io

import torch

from megatron_ds.config import parse_args, resolve
from megatron_ds.families.gpt.gpt_family import GPT
from megatron_ds.parallel.groups import ParallelState
from megatron_ds.training.engine import build_engine
from megatron_ds.training.initialize import discover_world, init_distributed

VOCAB = 64
BASE = ("--num-layers 2 --hidden-size 16 --num-attention-heads 2 --seq-length 8 --max-position-embeddings 8 "
        f"--vocab-size {VOCAB} --make-vocab-size-divisible-by 16 --hidden-dropout 0 --attention-dropout 0 "
        "--mock-data --seed 1234").split()


def engine_for(argv: list[str]):
    """(run, ps, runtime) of ``BASE + argv`` on this process's rank (gloo, CPU)."""
    cfg, _ = parse_args(BASE + argv)
    env = discover_world(use_mpi=False, local_rank=None)
    device = torch.device("cpu")
    run = resolve(cfg, world_size=env.world_size, vocab_size=VOCAB, device_type="cpu", family=GPT)
    init_distributed(run.distributed, device)
    ps = ParallelState(run.layout.tp, run.layout.pp, run.layout.dp)
    with contextlib.redirect_stdout(io.StringIO()):
        rt = build_engine(run, ps, device, VOCAB - 1, family=GPT)
    return run, ps, rt


def micro_batch(seed: int, batch: int, seq: int, keep: float):
    """((tokens, positions), (labels, loss_mask)): ``keep`` is the share of loss tokens (0/1 mask)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batch, seq), generator=g)
    labels = torch.randint(0, VOCAB, (batch, seq), generator=g)
    mask = (torch.rand(batch, seq, generator=g) < keep).float()
    return (tokens, torch.arange(seq).expand(batch, seq).contiguous()), (labels, mask)

