"""A tiny GPT with DeepSeek's multi-latent attention (--multi-latent-attention, megatron_ds/model/mla.py; a query
latent, YaRN x40 with DeepSeek-V2's mscale) trains as one process does at TP 2, TP 2 with --sequence-parallel, CP 2 and
PP 2 (1F1B, interleaved) and ZB-H1 at TP 2 x PP 2: the same losses and, at TP 2, the same weights after the last
step; the TP 2 checkpoint resumes in one process, directly and through DeepSpeed's universal checkpoint.

What each layout checks: at TP 2 the up projections split over heads and the output projection over its input,
while the down projections and the latents' norms are whole on each rank -- their gradients must be complete
there (the rotary key's gradient summed over the heads of both ranks); under --sequence-parallel each rank
projects half the tokens, so those gradients are partial sums that must be summed over TP (weights compared:
a missing sum moves them by ~lr while six losses barely notice, as tests/families/gpt/test_attention_variant_layouts.py
measured for the q/k norms); at PP 2 the layers are split over stages and the YaRN tables are rebuilt per stage.

Tolerances are test_attention_variant_layouts.py's (rtol 2e-5 for losses, weights within 1e-5/1e-6: other
summation orders in fp32, amplified by a few Adam steps). Dropout is off (its streams depend on the layout).
"""
import os

import pytest
import torch

from megatron_ds.families.gpt.gpt_family import GPT
from tests.distributed import run_distributed
from tests.training.common import TINY_GPT, train_losses

ITERS = 6
MLA_FLAGS = ("--multi-latent-attention --q-lora-rank 16 --kv-lora-rank 12 --qk-head-dim 8 --qk-pos-emb-head-dim 8 "
             "--v-head-dim 12 --rotary-scaling-factor 40 --mscale 0.707 --mscale-all-dim 0.707 "
             "--position-embedding-type rope --normalization rmsnorm --disable-bias-linear --swiglu").split()
RUN = TINY_GPT + MLA_FLAGS + ["--train-iters", str(ITERS), "--global-batch-size", "8", "--hidden-dropout", "0",
                              "--attention-dropout", "0", "--adam-eps", "1e-4", "--save-interval", str(ITERS)]
RTOL = 2e-5


def _run(world, ckpt, extra=()):
    results = run_distributed(train_losses, world, RUN + ["--save", ckpt] + list(extra), timeout=600)
    for other in results:
        assert other == results[-1]
    assert [it for it, _ in results[-1]][-1] == ITERS
    return [loss for _, loss in results[-1]]


def _weights(path, iteration=None):
    from megatron_ds.checkpoint import load_consolidated

    return load_consolidated(path, iteration, log=lambda *a: None, family=GPT).state_dict


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("reference"))
    losses = _run(1, ckpt)
    assert len(set(losses)) == ITERS  # the steps change the model
    return losses, _weights(ckpt)


def _same_weights(want, got):
    assert sorted(want) == sorted(got)
    assert any("linear_kv_down_proj" in n for n in want) and any("q_layernorm" in n for n in want)
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    """TP 2 under ZeRO-1, saving at steps 3 and 6; the tracker then points at step 3, where the checkpoint tests
    resume."""
    ckpt = str(tmp_path_factory.mktemp("tp2"))
    losses = _run(2, ckpt, ["--tensor-model-parallel-size", "2", "--zero-stage", "1", "--save-interval", "3"])
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("3")
    return losses, ckpt


def test_tp2_matches_single_process(reference, tp2):
    losses, ckpt = tp2
    assert losses == pytest.approx(reference[0], rel=RTOL)
    _same_weights(reference[1], _weights(ckpt, ITERS))


def test_tp2_sequence_parallel_matches_single_process(reference, tmp_path):
    losses = _run(2, str(tmp_path), ["--tensor-model-parallel-size", "2", "--sequence-parallel"])
    assert losses == pytest.approx(reference[0], rel=RTOL)
    _same_weights(reference[1], _weights(str(tmp_path)))


@pytest.mark.parametrize("extra", [[], ["--cp-comm-type", "all_gather", "--cp-block-kernel", "flash"]],
                         ids=["p2p_math", "all_gather_flash"])
def test_cp2_matches_single_process(reference, tmp_path, extra):
    """--context-parallel-size 2 (parallel/context_parallel.py): each rank holds chunks i and 3-i of every
    sequence, the YaRN tables at their global positions; the attention's keys (qk 8 + rope 8) and values (12)
    travel with their own head dims and the blocks take MLA's mscale-corrected softmax scale. Megatron-LM runs
    MLA with CP (multi_latent_attention.py; only its hybrid CP is refused there). The losses and the final
    weights (so the gradients of every step) are the single process's; the flash kernel runs torch's CPU flash
    operator with the values zero-padded to the keys' head dim."""
    losses = _run(2, str(tmp_path), ["--context-parallel-size", "2", *extra])
    assert losses == pytest.approx(reference[0], rel=RTOL)
    _same_weights(reference[1], _weights(str(tmp_path)))


@pytest.mark.parametrize("universal", [False, True], ids=["direct", "universal"])
def test_tp2_checkpoint_resumes_at_tp1(tp2, tmp_path, universal):
    """Saved at TP 2, resumed at step 3 by one process (the up projections merged by heads, the down projections
    and latent norms taken once; or DeepSpeed's ds_to_universal merging them by the patterns the checkpoint
    declares): steps 4-6 and the final weights are the TP 2 run's."""
    from tests.checkpoint.test_universal import ds_to_universal

    straight, ckpt = tp2
    extra = ["--load", ckpt, "--zero-stage", "1"]
    if universal:
        ds_to_universal(ckpt, 3)
        extra.append("--universal-checkpoint")
    results = run_distributed(train_losses, 1, RUN + ["--save", str(tmp_path)] + extra, timeout=600)[-1]
    assert [it for it, _ in results] == [4, 5, 6]
    assert [loss for _, loss in results] == pytest.approx(straight[3:], rel=RTOL)
    _same_weights(_weights(ckpt, ITERS), _weights(str(tmp_path)))


def test_pp2_matches_single_process(reference, tmp_path):
    losses = _run(2, str(tmp_path), ["--pipeline-model-parallel-size", "2"])
    assert losses == pytest.approx(reference[0], rel=RTOL)


def test_pp2_interleaved_matches_single_process(reference, tmp_path):
    """The interleaved schedule (two chunks of one layer per rank)."""
    losses = _run(2, str(tmp_path), ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage",
                                     "1"])
    assert losses == pytest.approx(reference[0], rel=RTOL)


def test_tp2_pp2_zbh1_matches_single_process(reference, tmp_path):
    """ZB-H1's deferred weight passes at TP 2 x PP 2: the down projections' weight gradients too."""
    losses = _run(4, str(tmp_path), ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                     "--enable-zbh1-pipeline"])
    assert losses == pytest.approx(reference[0], rel=RTOL)
    _same_weights(reference[1], _weights(str(tmp_path)))
