"""FP8 delayed scaling in training (CPU: torchao's emulation of the FP8 GEMMs), with the real entry point.

A Megatron-LM command line (no --deepspeed) with --fp8-format hybrid and no --fp8-recipe runs delayed
scaling, Megatron-LM's default; a history of 8 amaxes with ``max`` (longer than the 6 steps: after step 6
the history holds the amax of every step, slots 2..7 = steps 1..6). The state is per layer, module buffers:

- resumed at TP 2 from the step-3 checkpoint, the run continues bitwise: the same losses, the same
  step-6 amax histories and scales (nothing else decides the casts);
- resumed at TP 1 (resharded), the histories' entries of steps 1-3 come from the checkpoint and must be
  the TP 2 run's bitwise (slots 2-4 after step 6); the later entries and the losses are recomputed at
  another layout, equal within the bf16 TP-resharding tolerance of tests/checkpoint/test_reshard.py for the
  losses (5e-3 relative), and 2^-3 relative for the amaxes and scales: an amax is one element of an operand
  computed through earlier FP8 GEMMs; summed in another order, a value at a rounding boundary of their FP8
  operands lands one FP8 step away, at most 2^-3 relative (E5M2's 2 fraction bits, the coarser format),
  and the largest element moves by up to as much (the measured: 2%). A lost history would have zeros in
  slots 2-4, and scale 1 at step 4.

bf16, as FP8 runs train: the engine casts the model to bf16, the scaling state stays fp32.
"""
from __future__ import annotations

import os

import pytest
import torch

from tests.checkpoint.common import layout_flags
from tests.distributed import run_distributed
from tests.training.common import TINY_GPT, train_losses
from megatron_ds.families.gpt.gpt_family import GPT

RUN = TINY_GPT + ["--bf16", "--num-layers", "2", "--train-iters", "6", "--global-batch-size", "2", "--hidden-dropout", "0",
                  "--attention-dropout", "0", "--eval-iters", "0",
                  "--fp8-format", "hybrid", "--fp8-amax-history-len", "8", "--fp8-amax-compute-algo", "max"]


def _run(tp: int, extra, pp: int = 1) -> list[tuple[int, float]]:
    return run_distributed(train_losses, tp * pp, RUN + layout_flags(tp, pp) + list(extra), timeout=600)[-1]


def _fp8_state(path, iteration=None) -> dict[str, torch.Tensor]:
    from megatron_ds.checkpoint import load_consolidated

    c = load_consolidated(path, iteration, fp8_state=True, log=lambda *a: None, family=GPT)
    return {k: v for k, v in c.state_dict.items() if ".fp8_scaling." in k}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("fp8-delayed"))
    losses = _run(2, ["--save", ckpt, "--save-interval", "3"])
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("3")  # resume from the middle of the run
    return losses, ckpt


def test_resumed_run_continues_bitwise(straight, tmp_path):
    losses, ckpt = straight
    want = _fp8_state(ckpt, 6)
    assert len(want) == 2 * 4 * 2  # 2 layers x (QKV, attention output, MLP in, MLP out) x (history, scale)
    # every layer's scales moved from the first step's 1, and the history holds steps 1-6 (slots 2-7)
    for name, t in want.items():
        if name.endswith("scale"):
            assert (t != 1).all(), name
        else:
            assert t.shape == (8, 3) and (t[:2] == 0).all() and (t[2:] > 0).all(), (name, t)
    out = str(tmp_path / "resumed")
    resumed = _run(2, ["--load", ckpt, "--save", out])
    assert [it for it, _ in resumed] == [4, 5, 6]
    assert [loss for _, loss in resumed] == [loss for _, loss in losses[3:]]
    got = _fp8_state(out)
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), name


def test_checkpoint_exports_and_evaluates_as_plain_weights(straight):
    from megatron_ds.checkpoint import load_consolidated
    from megatron_ds.inference.model import build_inference_model

    _, ckpt = straight
    c = load_consolidated(ckpt, 6, log=lambda *a: None, family=GPT)
    assert not any(".fp8_scaling." in k for k in c.state_dict)  # training state, not weights
    build_inference_model(c, family=GPT)  # the inference model (no FP8) takes the state dict key for key


def test_resharded_to_tp1_keeps_the_history(straight, tmp_path):
    losses, ckpt = straight
    out = str(tmp_path / "tp1")
    resumed = _run(1, ["--load", ckpt, "--save", out])
    assert [loss for _, loss in resumed] == pytest.approx([loss for _, loss in losses[3:]], rel=5e-3)
    want, got = _fp8_state(ckpt, 6), _fp8_state(out)
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        if name.endswith("amax_history"):
            assert torch.equal(got[name][:5], t[:5]), name  # steps 1-3: the checkpoint's, carried over
        torch.testing.assert_close(got[name], t, rtol=2 ** -3, atol=0, msg=lambda m, name=name: f"{name}: {m}")


def test_pipeline_stages_update_their_own_layers(straight, tmp_path):
    """PP 2: each stage updates the scaling of the layers it holds. The losses follow TP 2's within the bf16
    layout tolerance above, and so do the step-6 histories and scales (2^-3, above): without the update the
    scales would still be 1 (the losses alone would not tell: they move by 3e-4 here)."""
    losses, ckpt = straight
    out = str(tmp_path / "pp2")
    staged = _run(1, ["--save", out, "--save-interval", "6"], pp=2)
    assert [loss for _, loss in staged] == pytest.approx([loss for _, loss in losses], rel=5e-3)
    want, got = _fp8_state(ckpt, 6), _fp8_state(out)
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        torch.testing.assert_close(got[name], t, rtol=2 ** -3, atol=0, msg=lambda m, name=name: f"{name}: {m}")
