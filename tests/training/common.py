"""Helpers for tests that run the real training entry point inside gloo test processes."""
from __future__ import annotations

TINY_GPT = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
            "--max-position-embeddings 32 --micro-batch-size 2 --lr 1e-3 --lr-decay-style cosine "
            "--lr-warmup-iters 2 --mock-data --vocab-size 512 --make-vocab-size-divisible-by 4 "
            "--log-interval 1 --eval-interval 1000 --eval-iters 1 --num-workers 0 --seed 1234").split()

LLAMA_FLAGS = ("--use-rotary-position-embeddings --swiglu --normalization rmsnorm --num-key-value-heads 2 "
               "--disable-bias-linear --untie-embeddings-and-output-weights").split()


def train_losses(rank: int, world_size: int, argv: list[str]) -> list[tuple[int, float]]:
    """Run pretrain_gpt.py's body with argv in this process; return (iteration, loss) pairs."""
    import contextlib
    import io

    from megatron_ds.config import parse_args
    from megatron_ds.training.pretrain import pretrain

    cfg, ignored = parse_args(argv)
    with contextlib.redirect_stdout(io.StringIO()):  # keep test output readable; losses are returned
        state = pretrain(cfg, ignored)
    return state.history
