"""--use-z-loss (the Swallow fork of Megatron-LM's flag) against a plain-torch reference written from the
fork's definition: every loss token's cross entropy plus 1e-4 x logsumexp(logits)^2, averaged over the
loss mask; logsumexp over the whole real vocabulary, here computed by torch.logsumexp on the gathered,
unsplit logits in float64. At tensor parallel size 2 each rank holds half the vocabulary (the padded
columns on the last one), so the log-sum-exp crosses the ranks."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_ds.config import parse_args, resolve
from megatron_ds.errors import ConfigError
from megatron_ds.families.gpt.gpt_family import GPT
from megatron_ds.families.gpt.gpt_model import build_sequential_gpt
from megatron_ds.model.language_model import Z_LOSS_COEFF, language_model_loss
from tests.distributed import run_distributed

REAL_VOCAB, PADDED = 90, 96  # the last TP rank holds 6 padding columns
B, S = 2, 8
FLAGS = ("--num-layers 2 --hidden-size 16 --num-attention-heads 2 --seq-length 8 --max-position-embeddings 8 "
         "--micro-batch-size 2 --lr 1e-3 --train-iters 1 --hidden-dropout 0 --attention-dropout 0 "
         "--make-vocab-size-divisible-by 48").split()
# fp32 logits: the loss and the z term are a few fp32 roundings from the float64 reference (~1e-7
# relative); 1e-5 leaves room. bf16 logits (the chunked path): the reference takes the same bf16
# values, so only fp32 summation order differs: same tolerance.
TOL = dict(rtol=1e-5, atol=1e-5)


def _reference(full_logits: torch.Tensor, labels, mask, z: float):
    """(loss, d loss / d logits) in float64 from the definition."""
    x = full_logits.detach().double()[..., :REAL_VOCAB].requires_grad_(True)
    ce = F.cross_entropy(x.reshape(-1, REAL_VOCAB), labels.reshape(-1), reduction="none")
    lse = torch.logsumexp(x, dim=-1).reshape(-1)
    m = mask.reshape(-1).double()
    loss = ((ce + z * lse.square()) * m).sum() / m.sum()
    loss.backward()
    grad = torch.zeros(full_logits.shape, dtype=torch.float64)
    grad[..., :REAL_VOCAB] = x.grad
    return loss.detach(), grad


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, S, PADDED, generator=g) * 4 + 3  # log Z far from 0: the z term matters
    logits[..., REAL_VOCAB:] = float("-inf")  # as the output layer masks them
    labels = torch.randint(0, REAL_VOCAB, (B, S), generator=g)
    mask = (torch.rand(B, S, generator=g) > 0.3).float()
    return logits, labels, mask


def _loss_checks(rank, world_size):
    group = dist.group.WORLD
    results = []
    for dtype in (torch.float32, torch.bfloat16):  # the exact and the chunked vocab-parallel cross entropy
        logits, labels, mask = _inputs(5)
        logits = logits.to(dtype)
        shard = logits.chunk(world_size, dim=-1)[rank].clone().requires_grad_(True)
        loss = language_model_loss(shard, (labels, mask), tp_group=group, vocab_size=REAL_VOCAB,
                                   z_loss_coeff=Z_LOSS_COEFF)
        loss.backward()
        ref_loss, ref_grad = _reference(logits.float(), labels, mask, Z_LOSS_COEFF)
        plain = language_model_loss(shard.detach(), (labels, mask), tp_group=group, vocab_size=REAL_VOCAB)
        results.append((float(loss), float(ref_loss), float(plain)))
        torch.testing.assert_close(loss.double(), ref_loss, **TOL)
        grad_tol = TOL if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-4)  # a bf16 gradient: 8 bits
        torch.testing.assert_close(shard.grad.double(), ref_grad.chunk(world_size, dim=-1)[rank], **grad_tol)
    return results


def test_z_loss_tp2_matches_torch_reference():
    results = run_distributed(_loss_checks, 2, timeout=240)
    assert results[0] == results[1]
    for loss, ref, plain in results[0]:
        # not vacuous: the z term moves the loss by far more than the tolerance
        assert loss - plain > 1e-3 and loss == pytest.approx(ref, rel=1e-5)


def _model_checks(rank, world_size):
    """The flag through resolve into the GPT's own loss function, at TP 2: its loss on its logits equals
    the reference on the logits gathered from both ranks."""
    cfg, _ = parse_args(FLAGS + ["--use-z-loss", "--tensor-model-parallel-size", "2"])
    run = resolve(cfg, world_size=2, vocab_size=REAL_VOCAB, device_type="cpu", family=GPT)
    layout = run.layout
    model = build_sequential_gpt(layout.model, padded_vocab_size=layout.padded_vocab_size, vocab_size=REAL_VOCAB,
                                 tp_group=dist.group.WORLD, seed=3)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, REAL_VOCAB, (B, S), generator=g)
    labels = torch.randint(0, REAL_VOCAB, (B, S), generator=g)
    mask = (torch.rand(B, S, generator=g) > 0.3).float()
    logits = model((tokens, torch.arange(S).expand(B, S)))
    loss = model.loss_fn(logits, (labels, mask))
    shards = [torch.empty_like(logits) for _ in range(world_size)]
    dist.all_gather(shards, logits.detach().contiguous())
    ref_loss, _ = _reference(torch.cat(shards, dim=-1), labels, mask, Z_LOSS_COEFF)
    torch.testing.assert_close(loss.detach().double(), ref_loss, **TOL)
    return layout.padded_vocab_size, float(loss.detach())


def test_use_z_loss_flag_reaches_the_gpt_loss_at_tp2():
    results = run_distributed(_model_checks, 2, timeout=240)
    assert results[0] == results[1] and results[0][0] == PADDED


def test_z_loss_refuses_liger_and_other_families():
    cfg, _ = parse_args(FLAGS + ["--use-z-loss", "--liger-kernel"])
    with pytest.raises(ConfigError, match="--liger-kernel with --use-z-loss"):
        resolve(cfg, world_size=1, vocab_size=REAL_VOCAB, device_type="cpu", family=GPT)
    cfg, _ = parse_args(FLAGS + ["--use-z-loss"])
    run = resolve(cfg, world_size=1, vocab_size=REAL_VOCAB, device_type="cpu", family=GPT)
    assert run.layout.model.liger_kernel is False and "--use-z-loss" in run.fused_loss_reason
