"""FP8 training on the CPU (torchao's emulation of the FP8 GEMMs: the same quantized numbers, fp32 sums).

A Llama-style model (SwiGLU, RMSNorm, GQA, untied output layer) trains 20 steps with --fp8-hybrid and
with plain --bf16, at TP 1, TP 2 and PP 2, with the real entry point in gloo processes.

Tolerance, derived from the roundings: bf16 stores every tensor (weights, activations, GEMM outputs,
gradients) with 7 fraction bits, a relative rounding error of at most 2^-8; FP8 rounds the GEMM operands
-- a subset of the same tensors -- again, with 3 fraction bits (E4M3, 2^-4) forward and 2 (E5M2, 2^-3)
for the gradients. How far a rounding moves the 20 losses is this model's and these steps' property,
and the fp32 run measures it for bf16's: |bf16 - fp32|. Rounding 2^5 times coarser (2^-3 / 2^-8) moves
them at most 2^5 times as far, so every FP8 loss must lie within 32 * max|bf16 - fp32| of the bf16 run's
at the same layout (the TP 2 model starts from the same weights as TP 1: its bf16 run is TP 1's). The FP8
losses must also differ from the bf16 ones: the FP8 GEMMs ran.

The FP8 recipe (current scaling) has no state, so a run resumed from its step-10 checkpoint must give
the uninterrupted run's last 10 losses bitwise; the checkpoint (bf16 weights, as any) exports to Hugging
Face, whose logits equal ours on the same weights (both fp32, tolerance as tests/families/gpt/test_hf.py).
"""
from __future__ import annotations

import os

import pytest
import torch

from tests.distributed import run_distributed
from tests.training.common import LLAMA_FLAGS, TINY_GPT, train_losses
from megatron_ds.families.gpt.gpt_family import GPT

RUN = TINY_GPT + LLAMA_FLAGS + ["--num-layers", "2", "--train-iters", "20", "--global-batch-size", "2",
                                "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-iters", "0"]
BF16, FP8 = ["--bf16"], ["--bf16", "--fp8-hybrid"]
TP2, PP2 = ["--tensor-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "2"]
# coarsest FP8 rounding (E5M2, 2^-3) over bf16's (2^-8)
ROUNDING_RATIO = 2.0 ** -3 / 2.0 ** -8


def _losses(world: int, argv: list[str]) -> list[tuple[int, float]]:
    return run_distributed(train_losses, world, RUN + argv, timeout=600)[-1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("fp8-ckpt"))
    got = {"fp32": _losses(1, []), "bf16": _losses(1, BF16),
           "fp8": _losses(1, FP8 + ["--save", ckpt, "--save-interval", "10"]),
           "fp8-tp2": _losses(2, FP8 + TP2), "bf16-pp2": _losses(2, BF16 + PP2), "fp8-pp2": _losses(2, FP8 + PP2)}
    for name, history in got.items():
        assert [it for it, _ in history] == list(range(1, 21)), name
    return {name: [loss for _, loss in history] for name, history in got.items()}, ckpt


def test_fp8_losses_follow_bf16_within_the_rounding_bound(runs):
    losses, _ = runs
    bf16_error = max(abs(a - b) for a, b in zip(losses["bf16"], losses["fp32"]))
    tol = ROUNDING_RATIO * bf16_error
    assert 0 < bf16_error < 0.01  # bf16 did round, and this model does not amplify it wildly
    for fp8, bf16 in (("fp8", "bf16"), ("fp8-tp2", "bf16"), ("fp8-pp2", "bf16-pp2")):
        diffs = [abs(a - b) for a, b in zip(losses[fp8], losses[bf16])]
        assert max(diffs) > 0, f"{fp8}: no FP8 GEMM ran"
        assert max(diffs) <= tol, f"{fp8} vs {bf16}: {max(diffs):.2e} > {tol:.2e} ({diffs})"


def test_resumed_fp8_run_equals_the_uninterrupted_one(runs):
    losses, ckpt = runs
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("10")  # back to the step-10 checkpoint the uninterrupted run saved on its way
    resumed = _losses(1, FP8 + ["--load", ckpt])
    assert [it for it, _ in resumed] == list(range(11, 21))
    assert [loss for _, loss in resumed] == losses["fp8"][10:]


def test_fp8_checkpoint_exports_to_hugging_face(runs, tmp_path):
    transformers = pytest.importorskip("transformers")
    from megatron_ds.checkpoint import load_consolidated
    from megatron_ds.cli import to_hf
    from megatron_ds.inference.model import build_inference_model

    _, ckpt = runs
    out = str(tmp_path / "hf")
    assert to_hf.main(["--load", ckpt, "--out", out]) == 0
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    c = load_consolidated(ckpt, log=lambda *a: None, family=GPT)
    assert c.model.fp8_hybrid  # the run's flags travel with the checkpoint; the weights are plain
    # ours as our evaluation and generation tools build it: the weights without FP8 (inference/model.py)
    ours = build_inference_model(c, family=GPT)
    assert not any(getattr(m, "fp8", None) for m in ours.module.modules())
    tokens = torch.randint(0, 512, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ours.logits(tokens, torch.arange(20).expand_as(tokens))
        torch.testing.assert_close(theirs(input_ids=tokens).logits, want, rtol=1e-5, atol=1e-5)
