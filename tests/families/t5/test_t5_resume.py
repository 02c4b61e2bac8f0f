"""T5 resume is exact: 10 steps straight == 5 steps, save, fresh processes, load, 5 more steps,
on 2 processes as a pipeline split at rank 1 (encoder stage, decoder stage), dropout on.

Bitwise (==) on CPU fp32, as tests/training/test_resume.py: the same operations in the same order
on the same numbers, so any difference means lost state -- weights (the tied embedding's copies on
both stages), Adam moments, LR step, consumed samples or RNG streams.
"""
import os

from tests.distributed import run_distributed
from tests.families.t5.test_t5_parity import TINY_T5, t5_train_losses

RUN = [a for a in TINY_T5] + ["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-split-rank", "1"]
RUN[RUN.index("--train-iters") + 1] = "10"
RUN[RUN.index("--hidden-dropout") + 1] = "0.1"
RUN[RUN.index("--attention-dropout") + 1] = "0.1"


def _run(argv):
    return run_distributed(t5_train_losses, 2, argv, timeout=900)[-1]


def test_t5_resume_equals_straight_run(tmp_path):
    straight = _run(RUN)
    ckpt = str(tmp_path / "ckpt")
    first = _run(RUN + ["--save", ckpt, "--save-interval", "100", "--exit-interval", "5"])
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read() == "5"
    second = _run(RUN + ["--load", ckpt])
    assert [it for it, _ in first] == [1, 2, 3, 4, 5]
    assert [it for it, _ in second] == [6, 7, 8, 9, 10]
    assert first + second == straight
    assert straight[-1][1] < straight[0][1]
