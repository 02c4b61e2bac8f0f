"""Tiny trained checkpoints for the checkpoint tests (GPT-2 style and Llama style)."""
from __future__ import annotations

from tests.distributed import run_distributed
from tests.training.common import LLAMA_FLAGS, TINY_GPT, train_losses

# Dropout off: its random streams legitimately depend on the layout, so runs at different layouts
# could not be compared (tests/families/gpt/test_parity.py has the same rule).
STEPS = ["--global-batch-size", "8", "--hidden-dropout", "0", "--attention-dropout", "0"]
STYLES = {"gpt2": [], "llama": LLAMA_FLAGS}


def layout_flags(tp: int, pp: int) -> list[str]:
    return ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]


def train(style: str, tp: int, pp: int, dp: int, iters: int, extra=(), timeout: int = 600) -> list:
    """Train with the real entry point; returns the last rank's (iteration, loss) history."""
    argv = TINY_GPT + STEPS + STYLES[style] + layout_flags(tp, pp) + ["--train-iters", str(iters), *extra]
    return run_distributed(train_losses, tp * pp * dp, argv, timeout=timeout)[-1]
