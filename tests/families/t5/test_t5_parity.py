"""T5 model parity (pretrain_t5.py): the same data, seed and global batch trained for 5 steps at
(TP, PP, DP) = (2, 1, 1), (1, 2, 1) with --pipeline-model-parallel-split-rank 1, (1, 1, 2) and
(2, 2, 1) with the split gives the single process's losses, in fp32.

As tests/families/gpt/test_parity.py: dropout off (its streams legitimately depend on the layout), and
rtol 2e-5 -- the layouts sum the same numbers in other orders (TP splits matmul reductions and the
softmax normalizer; PP all-reduces the tied embedding's three copies and sums the encoder output's
gradient per decoder stage; DP all-reduces), ~1e-7 relative per loss, which five Adam steps at lr
1e-3 amplify by at most a few tens. A missing encoder-output gradient, a wrong shard or a mis-seeded
layer moves the loss by 1e-3 or more.
"""
import pytest

from tests.training.common import layout_losses

TINY_T5 = ("--num-layers 2 --decoder-num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
           "--decoder-seq-length 8 --max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 8 "
           "--lr 1e-3 --lr-decay-style cosine --lr-warmup-iters 2 --mock-data --vocab-size 64 "
           "--make-vocab-size-divisible-by 4 --log-interval 1 --eval-interval 1000 --eval-iters 1 --num-workers 0 "
           "--seed 1234 --train-iters 5 --hidden-dropout 0 --attention-dropout 0").split()
RTOL = 2e-5  # see the module docstring


def t5_train_losses(rank: int, world_size: int, argv: list[str]) -> list[tuple[int, float]]:
    """pretrain_t5.py's body with argv in this process; (iteration, loss) pairs."""
    import contextlib
    import io

    from megatron_ds.config import parse_args
    from megatron_ds.families import pretrain
    from megatron_ds.families.t5.t5_family import T5

    cfg, ignored = parse_args(argv)
    with contextlib.redirect_stdout(io.StringIO()):
        return pretrain(cfg, ignored, T5).history


def _losses(tp, pp, dp, extra=()):
    return layout_losses(t5_train_losses, TINY_T5, tp, pp, dp, extra, timeout=900)


@pytest.fixture(scope="module")
def reference():
    return _losses(1, 1, 1)


SPLIT = ("--pipeline-model-parallel-split-rank", "1")


@pytest.mark.parametrize("tp,pp,dp,extra", [(2, 1, 1, ()), (1, 2, 1, SPLIT), (1, 1, 2, ()), (2, 2, 1, SPLIT)],
                         ids=["tp2", "pp2-split1", "dp2", "tp2-pp2-split1"])
def test_t5_layouts_match_single_process(reference, tp, pp, dp, extra):
    losses = _losses(tp, pp, dp, extra)
    assert losses == pytest.approx(reference, rel=RTOL)
    assert losses[-1] < losses[0]  # it trains: equal losses would otherwise prove little


def test_t5_plain_engine_with_full_recompute_matches_pipeline_engine(reference):
    """--no-pipeline-parallel runs the plain module (families/t5/t5_model.py build_sequential_t5) in DeepSpeed's
    plain engine; --checkpoint-activations recomputes its encoder and decoder layers (their tuple
    inputs included) in backward, which changes no number."""
    losses = _losses(1, 1, 1, ("--no-pipeline-parallel", "--checkpoint-activations"))
    assert losses == pytest.approx(reference, rel=RTOL)



RELATIVE = ("--position-embedding-type", "relative", "--relative-attention-num-buckets", "8",
            "--relative-attention-max-distance", "12", "--relu", "--num-layers", "4", "--decoder-num-layers", "4")


@pytest.fixture(scope="module")
def relative_reference():
    return _losses(1, 1, 1, RELATIVE)


@pytest.mark.parametrize("tp,pp,extra", [(2, 2, SPLIT), (1, 4, ("--pipeline-model-parallel-split-rank", "2")),
                                         (1, 2, SPLIT + ("--checkpoint-activations",))],
                         ids=["tp2-pp2-split1", "pp4-split2", "pp2-split1-recompute"])
def test_t5_relative_position_bias_matches_single_process(relative_reference, tp, pp, extra):
    """--position-embedding-type relative (families/t5/t5_model.py): each stack's bias table lives in the tied
    embedding and its bias rides in the activation tuple to the stack's later stages, heads split
    over TP. TP 2 x PP 2 checks the head split; PP 4 with split rank 2 sends each stack's bias to a
    second stage, whose gradient must come back to the table (DeepSpeed's tuple gradients) and be
    summed with the tied copies'. 8 buckets, max distance 12 over 16 / 8 positions: logarithmic and
    clamped buckets occur; with --checkpoint-activations the layers recompute with the bias among
    their tuple inputs. 4 + 4 layers (PP 4 needs --num-layers divisible by 4). The losses equal the
    single process's (same tolerance as above)."""
    losses = _losses(tp, pp, 1, extra + RELATIVE)
    assert losses == pytest.approx(relative_reference, rel=RTOL)
    assert losses[-1] < losses[0]
