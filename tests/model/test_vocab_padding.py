"""Vocabulary padding changes nothing: the padded rows (``--make-vocab-size-divisible-by`` x TP)
take no part in the loss, the softmax or the logits a sampler sees.

1. The vocab-parallel cross entropy with ``vocab_size`` against a float64 reference computed on
   the *unpadded* logits only, while the padding columns hold huge values (1e4: if they entered
   the max or the sum, the loss would be off by thousands); TP 1, 2 and 4.
2. The GPT at TP 1, 2 and 4, each with its own padded vocabulary, against the unpadded
   single-process GPT with the same real weights: same logits on the real columns, -inf on the
   padding columns, same loss and same gradients of the real weights.
"""
import dataclasses

import torch
import torch.distributed as dist

from megatron_ds.families.gpt.gpt_family import GPT
from megatron_ds.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_ds.parallel.utils import pad_vocab_size, tp_rank, tp_world_size
from tests.distributed import run_distributed

VOCAB = 37  # pads to 40 at TP 1 (divisible by 8), 48 at TP 2, 64 at TP 4
DIVISIBLE_BY = 8
# fp32 against float64 on the same values: the cross-entropy tolerances of
# tests/parallel/test_cross_entropy.py (measured errors ~1e-7 relative).
LOSS_TOL = dict(rtol=1e-6, atol=1e-5)
GRAD_TOL = dict(rtol=1e-5, atol=1e-6)
# The model at TP t vs TP 1: fp32, the same numbers summed in other orders (TP splits the matmul
# reductions and the softmax sums): ~1e-7 relative per op through 2 layers; 1e-5 leaves a margin.
MODEL_TOL = dict(rtol=1e-5, atol=1e-5)


def _check_cross_entropy(group):
    world, rank = tp_world_size(group), tp_rank(group)
    padded = pad_vocab_size(VOCAB, DIVISIBLE_BY, world)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 3, padded, generator=g) * 3
    logits[..., VOCAB:] = 1e4  # padding columns that would dominate the softmax if counted
    target = torch.randint(0, VOCAB, (5, 3), generator=g)
    target[0, 0] = VOCAB - 1  # the last real id
    for smoothing in (0.0, 0.1):
        ref_logits = logits[..., :VOCAB].double().requires_grad_(True)
        log_p = torch.log_softmax(ref_logits, dim=-1)
        q = torch.full_like(log_p, smoothing / (VOCAB - 1)).scatter_(-1, target.unsqueeze(-1), 1.0 - smoothing)
        ref = -(q * log_p).sum(-1)
        ref.sum().backward()
        shard = logits.chunk(world, dim=-1)[rank].clone().requires_grad_(True)
        loss = vocab_parallel_cross_entropy(shard, target, group, label_smoothing=smoothing, vocab_size=VOCAB)
        torch.testing.assert_close(loss.double(), ref.detach(), **LOSS_TOL)
        loss.sum().backward()
        full_grad = torch.cat([ref_logits.grad, torch.zeros(5, 3, padded - VOCAB, dtype=torch.float64)], -1)
        torch.testing.assert_close(shard.grad.double(), full_grad.chunk(world, dim=-1)[rank], **GRAD_TOL)


def _model_cfg():
    from megatron_ds.config import ModelConfig, resolve_model_config

    return resolve_model_config(ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8,
                                            hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.2))


def _unpadded_reference(cfg):
    """The unpadded single-process GPT, its loss, logits and real-weight gradients on one batch."""
    from megatron_ds.families.gpt.gpt_model import build_sequential_gpt

    model = build_sequential_gpt(cfg, padded_vocab_size=VOCAB, seed=7)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (2, 9), generator=g)
    inputs = (tokens[:, :-1], torch.arange(8).expand(2, 8))
    labels = (tokens[:, 1:], torch.ones(2, 8))
    logits = model(inputs)
    loss = model.loss_fn(logits, labels)
    loss.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    return model.state_dict(), inputs, labels, logits.detach(), loss.detach(), grads


def _check_model(group):
    from megatron_ds.checkpoint import tp as tp_rules
    from megatron_ds.families.gpt.gpt_model import build_sequential_gpt

    cfg = _model_cfg()
    for name, extra in (("gpt2", {}), ("untied", dict(untie_embeddings_and_output_weights=True))):
        cfg_ = dataclasses.replace(cfg, **extra)
        state, inputs, labels, ref_logits, ref_loss, ref_grads = _unpadded_reference(cfg_)
        world, rank = tp_world_size(group), tp_rank(group)
        padded = pad_vocab_size(VOCAB, DIVISIBLE_BY, world)
        model = build_sequential_gpt(cfg_, padded_vocab_size=padded, vocab_size=VOCAB, tp_group=group, seed=3)
        with torch.no_grad():
            for key, param in model.named_parameters():
                full = state[key]
                if tp_rules.is_vocab_param(key, GPT):  # padding rows: large random values, to be ignored
                    full = torch.cat([full, 50 * torch.randn(padded - VOCAB, full.shape[1])])
                param.copy_(tp_rules.split(key, full, world, rank, cfg_, GPT))
        logits = model(inputs)
        loss = model.loss_fn(logits, labels)
        loss.backward()
        torch.testing.assert_close(loss, ref_loss, **MODEL_TOL, msg=name)
        per_rank = padded // world
        real = ref_logits.new_full((2, 8, padded), float("-inf"))
        real[..., :VOCAB] = ref_logits
        torch.testing.assert_close(logits.detach(), real[..., rank * per_rank:(rank + 1) * per_rank], **MODEL_TOL,
                                   msg=name)
        for key, param in model.named_parameters():
            ref = ref_grads[key]
            if tp_rules.is_vocab_param(key, GPT):
                ref = torch.cat([ref, torch.zeros(padded - VOCAB, ref.shape[1])])  # padding rows: no gradient
            torch.testing.assert_close(param.grad, tp_rules.split(key, ref, world, rank, cfg_, GPT), **MODEL_TOL,
                                       msg=f"{name} {key}")


def _distributed_checks(rank, world_size):
    for group in (dist.group.WORLD, dist.new_subgroups(2)[0]):
        _check_cross_entropy(group)
        _check_model(group)


def test_padding_is_invisible_at_tp1():
    _check_cross_entropy(None)
    _check_model(None)


def test_padding_is_invisible_at_tp2_and_tp4():
    run_distributed(_distributed_checks, 4, timeout=300)
