"""ZB-H1 end to end against 1F1B of the same model: DeepSpeed's own pipeline engine running
1F1B (``--pipeline-model-parallel-size`` without the flag) is the reference.

* exact semantics: losses and every weight after the run equal 1F1B's bit for bit (fp32, CPU):
  each parameter takes the same micro-batch gradients, computed by the same code, in the same order;
* default: the middle micro-batches' weight gradients are added before the deferred ones, so sums
  differ in their last bits (~1e-7 relative) -- and they do differ: the order is not 1F1B's. Adam
  divides each gradient by its running RMS, so a weight whose gradient is itself near zero can move
  by more than the rounding: atol 1e-5 on weights (seen: 5e-7), rtol 1e-5 on losses. A lost or
  doubled weight pass changes a quarter of a gradient, moving weights by ~lr/4 = 2.5e-4;
* resume: interrupted and resumed equals straight, bit for bit.

10 steps of 4 (PP 2) or 8 (PP 4) micro-batches per run (the processes' start-up dominates the time);
dropout off, as the schedules draw from a stage's dropout stream in the same order anyway.
"""
import os

import pytest
import torch

from megatron_ds.families import main
from tests.distributed import run_distributed
from tests.training.common import LLAMA_FLAGS, TINY_GPT, train_losses

ITERS = 10
STEPS = ["--train-iters", str(ITERS), "--global-batch-size", "8", "--hidden-dropout", "0", "--attention-dropout", "0"]
ZBH1 = ["--enable-zbh1-pipeline"]
EXACT = ZBH1 + ["--enable-zbh1-exact-semantics"]


def _run(world, argv, save_dir):
    results = run_distributed(train_losses, world, argv + ["--save", str(save_dir), "--save-interval", str(ITERS)],
                              timeout=600)
    return results[-1]


def _weights(save_dir):
    step = os.path.join(save_dir, f"global_step{ITERS}")
    files = sorted(f for f in os.listdir(step) if f.startswith("layer_"))
    assert files
    return {(f, k): v for f in files for k, v in torch.load(os.path.join(step, f), weights_only=True).items()}


def _compare(world, argv, tmp_path, *, default_too: bool):
    ref = _run(world, argv, tmp_path / "1f1b")
    exact = _run(world, argv + EXACT, tmp_path / "exact")
    assert exact == ref and len({x for _, x in ref}) == ITERS  # and the weights move
    ref_w, exact_w = _weights(tmp_path / "1f1b"), _weights(tmp_path / "exact")
    assert ref_w.keys() == exact_w.keys()
    assert all(torch.equal(ref_w[k], exact_w[k]) for k in ref_w)
    if default_too:
        default = _run(world, argv + ZBH1, tmp_path / "default")
        assert [x for _, x in default] == pytest.approx([x for _, x in ref], rel=1e-5)
        default_w = _weights(tmp_path / "default")
        for k in ref_w:
            torch.testing.assert_close(default_w[k], ref_w[k], rtol=1e-5, atol=1e-5)
        assert any(not torch.equal(default_w[k], ref_w[k]) for k in ref_w)


def _layout(tp, pp):
    return ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]


def test_pp2_exact_is_1f1b_bit_for_bit_and_default_close(tmp_path):
    _compare(2, TINY_GPT + STEPS + _layout(1, 2), tmp_path, default_too=True)


def test_pp4_exact_is_1f1b_bit_for_bit_and_default_close(tmp_path):
    # m = 8 micro-batches: with m <= pp the default mode has no whole backwards between deferred
    # ones and accumulates in 1F1B's order too; at m = 8 the last stage's is upstream README's
    # 4->5->6->7->1->2->3->8
    _compare(4, TINY_GPT + STEPS + _layout(1, 4) + ["--global-batch-size", "16"], tmp_path, default_too=True)


@pytest.mark.slow
def test_tp2_pp2_exact_is_1f1b_bit_for_bit(tmp_path):
    _compare(4, TINY_GPT + STEPS + _layout(2, 2), tmp_path, default_too=False)


@pytest.mark.slow
def test_dp2_zero1_recompute_untied_exact_is_1f1b_bit_for_bit(tmp_path):
    """PP 2 x DP 2 under ZeRO 1 (its gradient hooks see the deferred gradients), full recompute
    (the input backward recomputes the forward, the weight pass uses what it kept), untied Llama."""
    argv = TINY_GPT + STEPS + LLAMA_FLAGS + _layout(1, 2) + ["--zero-stage", "1", "--checkpoint-activations"]
    _compare(4, argv, tmp_path, default_too=False)


def test_resume_is_bitwise(tmp_path):
    argv = TINY_GPT + STEPS + _layout(1, 2) + ZBH1
    straight = run_distributed(train_losses, 2, argv, timeout=600)[-1]
    ckpt = str(tmp_path / "ckpt")
    first = run_distributed(train_losses, 2, argv + ["--save", ckpt, "--exit-interval", "2"], timeout=600)[-1]
    second = run_distributed(train_losses, 2, argv + ["--load", ckpt], timeout=600)[-1]
    assert first + second == straight


def test_dry_run_prints_the_schedule(capsys):
    argv = TINY_GPT + ["--train-iters", "1", "--global-batch-size", "16", "--dry-run", "--world-size", "4"]
    assert main(argv + _layout(1, 4) + EXACT) == 0
    out = capsys.readouterr().out
    assert "ZB-H1 pipeline schedule (exact semantics) on the plain engine" in out
    # 8 micro-batches at PP 4: 1F1B idles (p-1)/m = 37.5% of compute, ZB-H1 a third of it
    assert "predicted bubble with F = B = W: 12.5% of compute (1F1B: 37.5%)" in out


@pytest.mark.parametrize("extra,message", [
    (["--num-layers", "8", "--num-layers-per-virtual-pipeline-stage", "1"],
     "--enable-zbh1-pipeline and the interleaved"),
    (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--world-size", "8"],
     "cannot be combined with --sequence-parallel"),
    (["--pipeline-model-parallel-size", "1"], "needs --pipeline-model-parallel-size >= 2"),
    (["--rampup-batch-size", "4", "4", "100"], "--rampup-batch-size cannot be combined with --enable-zbh1-pipeline"),
])
def test_dry_run_refuses_what_cannot_combine(capsys, extra, message):
    argv = TINY_GPT + ["--train-samples", "64", "--global-batch-size", "16", "--dry-run", "--world-size", "4"]
    assert main(argv + _layout(1, 4) + ZBH1 + extra) == 1
    assert message in capsys.readouterr().err


def test_exact_semantics_need_the_schedule(capsys):
    argv = TINY_GPT + ["--train-iters", "1", "--dry-run", "--world-size", "2", "--enable-zbh1-exact-semantics"]
    assert main(argv + _layout(1, 2)) == 1
    assert "--enable-zbh1-exact-semantics needs --enable-zbh1-pipeline" in capsys.readouterr().err
