"""Reshape: a checkpoint saved at one (TP, PP, DP, ZeRO, precision) resumes at another layout and
continues as the uninterrupted run at the original layout would.

One run trains 6 steps at the original layout, saving at 3 and 6; the tracker is pointed back at
3 (a plain text file) and runs at other layouts resume from it to step 6. Compared: the losses of
steps 4-6, and the final weights (``load_consolidated`` of both step-6 checkpoints). The weights
are the sharp test: had the fp32 masters, the Adam moments, the Adam step or the LR schedule not
carried over, three AdamW steps at lr ~1e-3 would move weights of size ~0.02 by ~1e-4 or more.

The vocabulary (500, divisible by 4) pads to 500 at TP 1 and 504 at TP 2, so the padded rows are
resized on the way (they take no part in the model: tests/model/test_vocab_padding.py).
Dropout is off (its streams depend on the layout); adam-eps 1e-4 keeps gradients that are zero in
exact arithmetic (e.g. the key bias, which softmax ignores) from turning floating-point noise of
~1e-10 into lr-sized, layout-dependent updates.

Tolerances. fp32: the layouts sum the same numbers in other orders (~1e-7 relative per op);
tests/families/gpt/test_parity.py measures losses within 2e-5 relative after 5 steps; weights move
by lr x (relative gradient error) per step, far below atol 1e-6. bf16: activations and weights
round to 8 bits of mantissa at every layer, and different TP/PP sizes round partial sums
differently: losses agree to ~1e-3 relative (rtol 5e-3 leaves a margin), and a master weight that
moved by a hair can round to the neighbouring bf16 value, so bf16 weights may differ by one ulp at
|w| < 0.0625 (2.5e-4) or 2 ulps of their own size. That alone could not tell a lost optimizer
state, so the bf16 case also compares the saved fp32 masters and Adam moments at step 6: their
difference must stay below 0.2 of how far they moved during steps 4-6 (measured worst: 0.07, the
tied embedding, whose gradient is summed in bf16 across stages; fresh moments or masters taken
from bf16 weights would differ by about as much as they moved), and the Adam step must be 6.
"""
import os

import pytest
import torch

from tests.checkpoint.common import layout_flags
from tests.distributed import run_distributed
from tests.training.common import TINY_GPT, train_losses
from megatron_ds.families.gpt.gpt_family import GPT

RUN = TINY_GPT + ["--global-batch-size", "8", "--hidden-dropout", "0", "--attention-dropout", "0",
                  "--vocab-size", "500", "--train-iters", "6", "--adam-eps", "1e-4"]
FP32 = dict(loss=dict(rel=2e-5), weights=dict(rtol=1e-5, atol=1e-6))
BF16 = dict(loss=dict(rel=5e-3), weights=dict(rtol=2**-7, atol=2.5e-4))
MOVED_FRACTION = 0.2


def _run(layout, extra):
    tp, pp, dp = layout
    return run_distributed(train_losses, tp * pp * dp, RUN + layout_flags(tp, pp) + list(extra), timeout=600)[-1]


def _straight(tmp_path_factory, name, layout, extra):
    ckpt = str(tmp_path_factory.mktemp(name))
    losses = _run(layout, [*extra, "--save", ckpt, "--save-interval", "3"])
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("3")  # resume from the middle of the run
    return losses, ckpt


@pytest.fixture(scope="module")
def fp32_2x2(tmp_path_factory):
    return _straight(tmp_path_factory, "fp32", (2, 2, 1), [])


def _weights(path, iteration=None):
    from megatron_ds.checkpoint import load_consolidated

    c = load_consolidated(path, iteration, log=lambda *a: None, family=GPT)
    # the real vocabulary rows (the padded sizes differ between the layouts)
    return {k: (v[:500] if v.shape[0] in (500, 504) and v.ndim == 2 else v) for k, v in c.state_dict.items()}


def _check_resumed(straight, ckpt, layout, extra, tmp_path, tol):
    out = str(tmp_path / "resumed")
    resumed = _run(layout, [*extra, "--load", ckpt, "--save", out])
    assert [it for it, _ in resumed] == [4, 5, 6]
    assert [loss for _, loss in resumed] == pytest.approx([loss for _, loss in straight[3:]], **tol["loss"])
    want, got = _weights(ckpt, 6), _weights(out)
    assert sorted(want) == sorted(got)
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, **tol["weights"],
                                   msg=lambda m, name=name: f"{name}: {m}")


# (2, 1, 2) resumes under ZeRO-1: the saved torch optimizer state goes into DeepSpeed's flat partitions
@pytest.mark.parametrize("layout,extra", [((1, 1, 2), []), ((1, 4, 1), []), ((2, 1, 2), ["--zero-stage", "1"])])
def test_fp32_tp2_pp2_resumes_at_other_layouts(fp32_2x2, tmp_path, layout, extra):
    straight, ckpt = fp32_2x2
    _check_resumed(straight, ckpt, layout, extra, tmp_path, FP32)


def _optimizer_state(path, iteration=None):
    """{name: {"fp32", "exp_avg", "exp_avg_sq"}} full tensors (real vocabulary rows), and Adam's step."""
    from megatron_ds.checkpoint.files import layer_prefixes, open_checkpoint
    from megatron_ds.checkpoint.optim_state import SavedOptimizer
    from megatron_ds.checkpoint.reshard import full_tensors
    from megatron_ds.checkpoint.sources import layer_source

    ckpt = open_checkpoint(path, iteration, GPT)
    saved = SavedOptimizer(ckpt)
    out = {}
    for idx, prefix in layer_prefixes(ckpt.model, ckpt.padded_vocab_size, GPT):
        for name, t in full_tensors(ckpt, layer_source(ckpt), saved, idx, prefix).items():
            out[name] = {k: v[:500] if v.ndim == 2 and v.shape[0] in (500, 504) else v
                         for k, v in t.items() if k != "weight"}
    return out, saved.step


def test_bf16_tp2_pp2_resumes_at_dp2(tmp_path_factory, tmp_path):
    straight, ckpt = _straight(tmp_path_factory, "bf16", (2, 2, 1), ["--bf16"])
    _check_resumed(straight, ckpt, (1, 1, 2), ["--bf16"], tmp_path, BF16)
    (at3, _), (want, want_step), (got, got_step) = (_optimizer_state(ckpt, 3), _optimizer_state(ckpt, 6),
                                                      _optimizer_state(str(tmp_path / "resumed")))
    assert want_step == got_step == 6
    for name in want:
        for key, tensor in want[name].items():
            moved = (tensor - at3[name][key]).abs().max().item()
            assert (got[name][key] - tensor).abs().max().item() <= MOVED_FRACTION * moved, (name, key)


def test_zero1_dp2_resumes_at_dp1_without_zero(tmp_path_factory, tmp_path):
    # saved by DeepSpeed's plain engine (its module lives in the mp_rank files), resumed by the
    # pipeline engine (per-layer files)
    straight, ckpt = _straight(tmp_path_factory, "zero1", (1, 1, 2), ["--zero-stage", "1", "--no-pipeline-parallel"])
    _check_resumed(straight, ckpt, (1, 1, 1), [], tmp_path, FP32)
