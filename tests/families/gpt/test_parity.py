"""Model parity: the same data, seed and global batch trained for 5 steps under different
(TP, PP, DP) layouts gives the same losses as one process.

Dropout is off: its random stream legitimately depends on the layout (TP ranks draw different
masks inside TP regions). Everything else -- initialization from master weights, layer seeding
independent of the pipeline stage, data order, gradient accumulation, clipping, Adam -- must
agree.

Tolerance: rtol 2e-5. In fp32 the layouts sum the same numbers in different orders (TP splits
the matmul reductions and the softmax normalizer, PP/DP change the order of gradient
accumulation and all-reduce), which perturbs each loss by ~1e-7 relative; five Adam steps at
lr 1e-3 amplify that by at most a few tens (Adam's update is m/sqrt(v), so a relative gradient
error becomes a similar relative update error). A real bug (a missing all-reduce, a wrong
shard, a mis-seeded layer) moves the loss by 1e-3 or more.
"""
import pytest

from tests.training.common import LLAMA_FLAGS, TINY_GPT, layout_losses, train_losses

# vocab 512 pads to 512 at every TP size here; a different padded vocabulary would change the
# initial embedding and the softmax, so layouts could not be compared.
STEPS = ["--train-iters", "5", "--global-batch-size", "8", "--hidden-dropout", "0", "--attention-dropout", "0"]
RTOL = 2e-5


def _losses(tp, pp, dp, extra=()):
    return layout_losses(train_losses, TINY_GPT + STEPS, tp, pp, dp, extra, timeout=600)


@pytest.fixture(scope="module")
def reference():
    return _losses(1, 1, 1)


# (1, 4, 1) has middle stages that read no data but join every schedule, validation included
@pytest.mark.parametrize("tp,pp,dp", [(2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1), (1, 4, 1)])
def test_layouts_match_single_process(reference, tp, pp, dp):
    losses = _losses(tp, pp, dp)
    assert losses == pytest.approx(reference, rel=RTOL)
    # the model actually trains: otherwise equal losses would prove little
    assert losses[-1] < losses[0]


def test_sequence_parallel_tp2_pp2_matches_single_process(reference):
    assert _losses(2, 2, 1, ["--sequence-parallel"]) == pytest.approx(reference, rel=RTOL)


def test_llama_style_tp2_matches_single_process():
    ref = _losses(1, 1, 1, LLAMA_FLAGS)
    assert _losses(2, 1, 1, LLAMA_FLAGS) == pytest.approx(ref, rel=RTOL)


def test_plain_engine_matches_pipeline_engine(reference):
    """--no-pipeline-parallel runs the same model in DeepSpeed's plain engine."""
    assert _losses(1, 1, 1, ["--no-pipeline-parallel"]) == pytest.approx(reference, rel=RTOL)
