"""DeepSpeed-Ulysses (--ds-sequence-parallel-size): the same data, seed and global batch trained for a
few steps with each sequence split over SP ranks gives the losses of the same model trained in one
process (SP 1, a dense run), for GPT and Llama shapes (RoPE, GQA) and with document-reset masks;
a run resumed from a checkpoint continues bit for bit; a checkpoint saved at SP 2 loads at SP 1.

Dropout is off in the comparisons across layouts (its stream depends on the layout); on in the resume
test, which compares one layout with itself. Tolerance rtol 2e-5 as in test_parity.py (fp32
sums in another order: the attention of each head runs on another rank, the loss is a sum of
per-shard sums, the gradients a sum over SP x DP); a wrong shard, position or mask moves the loss by
1e-3 or more.
"""
import pytest

from tests.distributed import run_distributed
from tests.training.common import LLAMA_FLAGS, TINY_GPT, train_losses

STEPS = ["--train-iters", "10", "--global-batch-size", "8", "--hidden-dropout", "0", "--attention-dropout", "0",
         "--no-pipeline-parallel", "--num-layers", "2", "--lr-warmup-iters", "0"]
RTOL = 2e-5
# document resets: mock tokens are uniform over the vocabulary and the last id ends a document
# (vocabulary 16, EOD 15: about two documents end in every 33-token sample)
RESET = ["--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss", "--vocab-size", "16"]
# 8 query heads in 4 key/value groups: SP 4 gives each rank one group of two query heads
LLAMA = LLAMA_FLAGS + ["--num-attention-heads", "8", "--num-key-value-heads", "4"]


def _losses(sp, dp, extra=(), steps=STEPS, tp=1):
    argv = TINY_GPT + steps + ["--ds-sequence-parallel-size", str(sp), "--tensor-model-parallel-size", str(tp), *extra]
    results = run_distributed(train_losses, tp * sp * dp, argv, timeout=600)
    for other in results:  # every rank reports the loss of the whole sequence
        assert other == results[0]
    return [loss for _, loss in results[0]]


@pytest.fixture(scope="module")
def llama_reference():
    return _losses(1, 1, LLAMA + RESET)


@pytest.mark.parametrize("sp,dp", [(2, 1), (2, 2), (4, 1)])
def test_llama_with_document_resets_matches_single_process(llama_reference, sp, dp):
    assert _losses(sp, dp, LLAMA + RESET) == pytest.approx(llama_reference, rel=RTOL)


def test_llama_tp2_sp2_matches_single_process(llama_reference):
    """Each TP rank's 2 key/value groups split again over 2 SP ranks."""
    assert _losses(2, 1, LLAMA + RESET, tp=2) == pytest.approx(llama_reference, rel=RTOL)


def test_the_comparisons_can_fail(llama_reference):
    """Random tokens teach the model little in ten steps, so check the reference is sensitive: the
    steps change the loss, and the same run without document masks (causal only) differs."""
    assert len(set(llama_reference)) == len(llama_reference)
    causal = _losses(1, 1, LLAMA + [f for f in RESET if f != "--reset-attention-mask"])
    assert causal != pytest.approx(llama_reference, rel=10 * RTOL)


def test_gpt_learned_positions_matches_single_process():
    assert _losses(2, 1, RESET) == pytest.approx(_losses(1, 1, RESET), rel=RTOL)


RESUME = TINY_GPT + ["--train-iters", "4", "--global-batch-size", "8", "--no-pipeline-parallel", "--num-layers", "2",
                     "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]


def _run(world, argv):
    return run_distributed(train_losses, world, argv, timeout=600)[0]


def test_resume_equals_straight_run(tmp_path):
    """SP 2 with ZeRO 1 (the upstream example's): 4 steps straight == 2 steps, save, load, 2 more, bit for bit
    (dropout on: the RNG streams are restored too)."""
    argv = RESUME + ["--ds-sequence-parallel-size", "2", "--zero-stage", "1"]
    straight = _run(2, argv)
    ckpt = str(tmp_path / "ckpt")
    first = _run(2, argv + ["--save", ckpt, "--save-interval", "100", "--exit-interval", "2"])
    second = _run(2, argv + ["--load", ckpt])
    assert [it for it, _ in first + second] == [1, 2, 3, 4]
    assert first + second == straight


@pytest.mark.parametrize("zero", ["0", "1"])
def test_checkpoint_saved_at_sp2_loads_at_sp1(tmp_path, zero):
    """The weights do not depend on SP: a run saved at SP 2 continues at SP 1 as the SP 1 run would
    (ZeRO 1: the optimizer state sharded over the 2 ranks is resharded for 1)."""
    argv = RESUME + ["--hidden-dropout", "0", "--attention-dropout", "0", "--zero-stage", zero]
    straight = _run(1, argv)
    ckpt = str(tmp_path / "ckpt")
    _run(2, argv + ["--ds-sequence-parallel-size", "2", "--save", ckpt, "--save-interval", "100",
                    "--exit-interval", "2"])
    second = _run(1, argv + ["--load", ckpt])
    assert [it for it, _ in second] == [3, 4]
    assert [loss for _, loss in second] == pytest.approx([loss for _, loss in straight[2:]], rel=RTOL)
