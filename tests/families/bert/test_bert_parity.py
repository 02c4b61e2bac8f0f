"""BERT parity: the same data, seed and global batch trained for 5 steps with tensor, pipeline or
data parallelism gives the single-process losses (fp32, dropout off), through pretrain_bert.py's
body (``training.pretrain.pretrain`` with the BERT family).

The loss compared is what backward runs on: pretrain_bert.py's masked-LM loss + sentence-order
loss. What must agree across layouts: per-layer seeding independent of the stage, the padding mask
carried between pipeline stages, the tied word embedding (first and last stage), the replicated MLM
head and pooler, the vocab-parallel bias and cross entropy, data order and gradient accumulation.

Tolerance rtol 2e-5, as tests/families/gpt/test_parity.py for the GPT: fp32 sums in different orders
(TP splits matmul reductions and the softmax normalizer, PP/DP the accumulation order) perturb each
loss by ~1e-7 relative, five Adam steps amplify that by a few tens; a real bug (a missing
all-reduce, a wrong shard, a mask lost between stages) moves the loss by 1e-3 or more.
"""
import pytest

from tests.training.common import layout_losses

TINY_BERT = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
             "--max-position-embeddings 32 --micro-batch-size 2 --lr 1e-3 --lr-decay-style cosine "
             "--lr-warmup-iters 2 --mock-data --vocab-size 512 --make-vocab-size-divisible-by 4 "
             "--log-interval 1 --eval-interval 1000 --eval-iters 1 --num-workers 0 --seed 1234 "
             "--train-iters 5 --global-batch-size 8 --hidden-dropout 0 --attention-dropout 0").split()
RTOL = 2e-5


def bert_losses(rank: int, world_size: int, argv: list[str]) -> list[tuple[int, float]]:
    """pretrain_bert.py's body in this process; the (iteration, loss) pairs."""
    import contextlib
    import io

    from megatron_ds.config import parse_args
    from megatron_ds.families import pretrain
    from megatron_ds.families.bert.bert_family import BERT

    cfg, ignored = parse_args(argv)
    with contextlib.redirect_stdout(io.StringIO()):
        state = pretrain(cfg, ignored, BERT)
    return state.history


def _losses(tp, pp, dp, extra=()):
    return layout_losses(bert_losses, TINY_BERT, tp, pp, dp, extra, timeout=900)


@pytest.fixture(scope="module")
def reference():
    return _losses(1, 1, 1)


@pytest.mark.parametrize("tp,pp,dp", [(2, 1, 1), (1, 2, 1), (1, 1, 2)])
def test_bert_layouts_match_single_process(reference, tp, pp, dp):
    # steps 2-5 see weights after 1-4 Adam updates at lr 1e-3, so they compare training, not only a
    # forward pass (the synthetic masked tokens are random: the loss itself barely moves in 5 steps;
    # tests/families/bert/test_bert_quickstart.py shows it falling on real text)
    assert _losses(tp, pp, dp) == pytest.approx(reference, rel=RTOL)


def test_bert_tp2_pp2_sequence_parallel_matches_single_process(reference):
    """TP 2 x PP 2 with Megatron's sequence parallelism: the head gathers the sequence before the
    replicated MLM transform and the pooler (position 0 of the whole sequence)."""
    assert _losses(2, 2, 1, ["--sequence-parallel"]) == pytest.approx(reference, rel=RTOL)


def test_bert_without_binary_head_tp2_pp2_matches_single_process():
    """--bert-no-binary-head (no pooler, no token types: the masked-LM loss alone) at TP 2 x PP 2
    against the same model on one process."""
    extra = ["--bert-no-binary-head"]
    assert _losses(2, 2, 1, extra) == pytest.approx(_losses(1, 1, 1, extra), rel=RTOL)
