"""The liger-kernel path, as far as a CPU can see it: when it is chosen (never on the CPU, without
liger, at TP > 1, under ZeRO-3 or with --no-liger-kernel), what the start-up line says, and the
glue around liger's kernel (padded vocabulary rows sliced off, loss mask, [s, b] token order)
against the vocab-parallel loss, with a torch stand-in for liger's function (the kernel itself is
compared on a GPU in tests/gpu/test_gpu_fusions.py)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from megatron_ds.families.gpt.gpt_model import build_sequential_gpt
from megatron_ds.model import language_model as gpt_module
from megatron_ds.model import liger
from megatron_ds.model.kernels import describe_kernels
from tests.model.test_fusions import REAL_VOCAB, SEQ, VOCAB, batch, model_config


def torch_fused_linear_cross_entropy(x, weight, target, ignore_index=-100, reduction="mean"):
    """What liger's liger_fused_linear_cross_entropy computes (its documented contract: the
    cross entropy of x @ weight.T, ignore_index skipped), written with torch."""
    return F.cross_entropy(F.linear(x, weight).float(), target, ignore_index=ignore_index, reduction=reduction)


def test_liger_is_never_chosen_on_the_cpu_or_without_liger():
    x = torch.zeros(2, 1, 4)
    weight = torch.zeros(8, 4)
    assert not liger.use_fused_linear_loss(True, True, x, weight, None)
    fn, why = liger.liger_fused_linear_cross_entropy()
    if fn is None:  # this machine: no liger, or no CUDA
        assert why in ("liger-kernel not installed", "no CUDA device") or why.startswith("liger-kernel failed")
        assert f"liger-kernel unused: {why}" in describe_kernels()["output layer + loss"]


def test_selection_rules(monkeypatch):
    monkeypatch.setattr(liger, "liger_fused_linear_cross_entropy", lambda: (torch_fused_linear_cross_entropy, None))
    meta = torch.empty(2, 1, 4, device="meta")  # not CUDA: still never chosen
    assert not liger.use_fused_linear_loss(True, True, meta, torch.zeros(8, 4), None)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # pretend
    x, weight = torch.zeros(2, 1, 4), torch.zeros(8, 4)
    assert liger.use_fused_linear_loss(True, True, x, weight, None)
    assert not liger.use_fused_linear_loss(False, True, x, weight, None)  # --no-liger-kernel
    assert not liger.use_fused_linear_loss(True, False, x, weight, None)  # evaluation / generation
    with torch.no_grad():
        assert not liger.use_fused_linear_loss(True, True, x, weight, None)
    zero3 = torch.nn.Parameter(torch.zeros(8, 4))
    zero3.ds_id = 3  # what a ZeRO-3 partitioned parameter carries
    assert not liger.use_fused_linear_loss(True, True, x, zero3, None)
    monkeypatch.setattr(liger, "tp_world_size", lambda group: 2)
    assert not liger.use_fused_linear_loss(True, True, x, weight, object())
    cfg = model_config("gpt2", True, liger_kernel=True)
    assert liger.describe_liger(cfg, 1).startswith("liger-kernel fused linear + cross entropy")
    assert "tensor parallel size > 1" in liger.describe_liger(cfg, 2)
    assert "--no-liger-kernel" in liger.describe_liger(dataclasses.replace(cfg, liger_kernel=False), 1)


@pytest.mark.parametrize("name", ["gpt2", "llama"])  # tied output layer / untied output head
def test_fused_loss_glue_equals_the_vocab_parallel_loss(monkeypatch, name):
    """The model handing (hidden, weight) to liger's function gives the vocab-parallel loss and the
    same gradients; the padded vocabulary rows (120..127) get no gradient and never count."""
    monkeypatch.setattr(liger, "liger_fused_linear_cross_entropy", lambda: (torch_fused_linear_cross_entropy, None))
    monkeypatch.setattr(gpt_module, "use_fused_linear_loss",
                        lambda enabled, training, hidden, weight, group: enabled and training)
    cfg = dataclasses.replace(model_config(name, False), hidden_dropout=0.0)
    tokens, labels, loss_mask = batch()
    results = {}
    for fused in (False, True):
        model = build_sequential_gpt(dataclasses.replace(cfg, liger_kernel=fused), padded_vocab_size=VOCAB,
                                     vocab_size=REAL_VOCAB, seed=7)
        out = model((tokens, torch.arange(SEQ).expand_as(tokens)))
        assert isinstance(out, liger.HiddenForLoss) == fused
        loss = model.loss_fn(out, (labels, loss_mask))
        loss.backward()
        results[fused] = loss.detach(), {n: p.grad for n, p in model.named_parameters()}
    # fp32 both ways; the sums over tokens and vocabulary run in a different order: a few ulps
    torch.testing.assert_close(results[True][0], results[False][0], rtol=1e-6, atol=1e-6)
    for n, g in results[True][1].items():
        torch.testing.assert_close(g, results[False][1][n], rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")
    output_weight = [g for n, g in results[True][1].items() if "word_embeddings" in n or "output_layer" in n]
    assert output_weight and all(torch.count_nonzero(g[REAL_VOCAB:]) == 0 for g in output_weight)


def test_fully_masked_batch_gives_zero_not_nan(monkeypatch):
    monkeypatch.setattr(liger, "liger_fused_linear_cross_entropy",
                        lambda: (lambda x, w, t, ignore_index, reduction: F.cross_entropy(
                            F.linear(x, w), t, ignore_index=ignore_index, reduction=reduction), None))
    hidden, weight = torch.randn(SEQ, 2, 8), torch.randn(VOCAB, 8)
    labels = torch.zeros(2, SEQ, dtype=torch.long)
    loss = liger.fused_linear_loss(liger.HiddenForLoss(hidden, weight, REAL_VOCAB), labels, torch.zeros(2, SEQ))
    assert loss.item() == 0.0
