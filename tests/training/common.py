"""Helpers for tests that run the real training entry point inside gloo test processes."""
from __future__ import annotations

from tests.distributed import run_distributed

TINY_GPT = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
            "--max-position-embeddings 32 --micro-batch-size 2 --lr 1e-3 --lr-decay-style cosine "
            "--lr-warmup-iters 2 --mock-data --vocab-size 512 --make-vocab-size-divisible-by 4 "
            "--log-interval 1 --eval-interval 1000 --eval-iters 1 --num-workers 0 --seed 1234").split()

LLAMA_FLAGS = ("--use-rotary-position-embeddings --swiglu --normalization rmsnorm --num-key-value-heads 2 "
               "--disable-bias-linear --untie-embeddings-and-output-weights").split()

# Qwen2.5/Qwen3/Llama 3.1's attention on top (with TINY_GPT: head dim 24 != hidden 64 / 4 heads; Llama 3.1
# scaling whose original context, 16, is under the sequence, 32)
OPEN_MODEL_FLAGS = LLAMA_FLAGS + ("--kv-channels 24 --add-qkv-bias --qk-layernorm --use-rope-scaling "
                                  "--rope-scaling-original-max-position-embeddings 16").split()


def train_losses(rank: int, world_size: int, argv: list[str]) -> list[tuple[int, float]]:
    """Run pretrain_gpt.py's body with argv in this process; return (iteration, loss) pairs."""
    import contextlib
    import io

    from megatron_ds.config import parse_args
    from megatron_ds.families import pretrain

    cfg, ignored = parse_args(argv)
    with contextlib.redirect_stdout(io.StringIO()):  # keep test output readable; losses are returned
        state = pretrain(cfg, ignored)
    return state.history


def layout_losses(fn, base: list[str], tp: int, pp: int, dp: int, extra=(), *, timeout: float) -> list[float]:
    """The 5 losses of ``fn(rank, world_size, argv)`` (one of the ``*_losses`` bodies) trained at TP x PP x DP
    in tp * pp * dp gloo processes, after checking that every rank reports them."""
    argv = [*base, "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp), *extra]
    results = run_distributed(fn, tp * pp * dp, argv, timeout=timeout)
    last = results[-1]  # the last rank holds the last pipeline stage
    assert [it for it, _ in last] == [1, 2, 3, 4, 5]
    for other in results:  # the pipeline engine broadcasts the loss: every rank reports the same
        assert other == last
    return [loss for _, loss in last]
