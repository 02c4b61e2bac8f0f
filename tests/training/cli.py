"""Run pretrain_gpt.py's main() in gloo test processes and capture what a user would see."""
from __future__ import annotations

import re

SMALL_GPT = ("--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 16 --max-position-embeddings 16 "
             "--micro-batch-size 2 --lr 1e-3 --lr-decay-style cosine --lr-warmup-iters 2 --mock-data "
             "--vocab-size 128 --make-vocab-size-divisible-by 4 --log-interval 1 --eval-interval 1000 "
             "--eval-iters 0 --num-workers 0 --seed 1234").split()

ITERATION = re.compile(r"^ iteration\s+(\d+)/\s*\d+ \|.* lm loss: (\S+) \|", re.M)


def cli_many(rank: int, world_size: int, argvs: list[list[str]]) -> list[tuple[int, str, str]]:
    """main(argv) for each argv in turn in this process: [(exit status, stdout, stderr)]. One process
    for several runs keeps the DeepSpeed import (seconds on a busy machine) to one per test."""
    import contextlib
    import io

    from megatron_ds.families import main

    results = []
    for argv in argvs:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(argv)
        results.append((rc, out.getvalue(), err.getvalue()))
    return results


def iterations(stdout: str) -> list[tuple[int, str]]:
    """(iteration, printed loss) of each iteration line."""
    return [(int(it), loss) for it, loss in ITERATION.findall(stdout)]


def printed_losses(world_size: int, argv: list[str], timeout: float = 600) -> list[tuple[int, str]]:
    """(iteration, printed loss) of pretrain_gpt.py's main(argv) on world_size gloo processes
    (tests/distributed.py), as the last rank prints them (the last pipeline stage, as under a
    launcher). The uninterrupted reference run of the launcher tests (test_signals.py,
    test_kill_loop.py): the same flags, without a launcher's start-up of fresh processes."""
    from tests.distributed import run_distributed

    ranks = run_distributed(cli_many, world_size, [argv], timeout=timeout)
    for [(rc, _, err)] in ranks:
        assert rc == 0, err[-3000:]
    return iterations(ranks[-1][0][1])
