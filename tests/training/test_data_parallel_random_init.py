"""--data-parallel-random-init (megatron/initialize.py _set_random_seed, megatron/checkpointing.py
get_rng_state / load_checkpoint, Megatron-DeepSpeed commit 4efb479): each data parallel rank seeds
with + 10 x its DP rank, so dropout differs across them (the weights do not: DeepSpeed's engine
broadcasts DP rank 0's at start-up), and a checkpoint keeps every DP rank's RNG state, so a resumed
run continues each rank's own streams. Two DP ranks, dropout on, CPU fp32: losses compared exactly,
as tests/training/test_resume.py does."""
from tests.distributed import run_distributed
from tests.training.common import TINY_GPT, train_losses

RUN = TINY_GPT + ["--train-iters", "6", "--global-batch-size", "8", "--hidden-dropout", "0.3",
                  "--attention-dropout", "0.3", "--zero-stage", "1"]


def _run(argv):
    return run_distributed(train_losses, 2, argv, timeout=600)[-1]


def test_per_rank_seeds_change_dropout_and_resume_exactly(tmp_path):
    flag = ["--data-parallel-random-init"]
    plain = _run(RUN)
    straight = _run(RUN + flag)
    # the first step's loss is the forward of equal weights: dropout masks alone tell the runs apart
    assert plain[0] != straight[0]
    ckpt = str(tmp_path / "ckpt")
    first = _run(RUN + flag + ["--save", ckpt, "--save-interval", "100", "--exit-interval", "3"])
    second = _run(RUN + flag + ["--load", ckpt])
    assert [it for it, _ in first + second] == list(range(1, 7))
    assert first + second == straight
