"""Tensor parallel GPT (TP = 2, gloo) against the same model at TP = 1 in each process.

Both are built with the same seed, so the TP = 2 shards must be exact slices of the TP = 1
weights; the gathered logits, the loss and every (sharded) gradient of one step must then match,
with and without sequence parallelism, for the GPT-2, the Llama-style and the Qwen-style model.
"""
from __future__ import annotations

import torch

from megatron_ds.config.layout import resolve_model_config
from megatron_ds.config.schema import ModelConfig
from tests.distributed import run_distributed

VOCAB = 128  # padded: divisible by TP
SEQ = 12  # divisible by TP (sequence parallel splits it)
EOD = 0

# fp32. TP = 2 sums the same products in a different order (row parallel partial sums then an
# all-reduce, the cross entropy's max/sum all-reduces, sequence-parallel norm gradients summed per
# shard), i.e. differences of a few ulps of O(1) values; 1e-5 leaves ~100 ulps of headroom while a
# wrong shard, stride or head layout gives O(0.1) errors.
TOL = dict(rtol=1e-5, atol=1e-5)

_BASE = dict(num_layers=2, seq_length=SEQ, max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0,
             init_method_std=0.2)
CASES = {
    "gpt2": (dict(hidden_size=32, num_attention_heads=4), False),
    # two key/value groups per rank, two query heads per group; untied head; document masking
    "llama": (dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=4, ffn_hidden_size=96,
                   use_rotary_position_embeddings=True, swiglu=True, normalization="rmsnorm",
                   add_bias_linear=False, untie_embeddings_and_output_weights=True), True),
    # Qwen-style: head dim 12 != hidden / heads, QKV bias alone, per-head q/k RMSNorm (its replicated
    # weights' gradients summed over TP), Llama 3.1 RoPE scaling from position 8 on
    "qwen": (dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=4, kv_channels=12, ffn_hidden_size=96,
                  use_rotary_position_embeddings=True, swiglu=True, normalization="rmsnorm", add_bias_linear=False,
                  untie_embeddings_and_output_weights=True, add_qkv_bias=True, qk_layernorm=True,
                  use_rope_scaling=True, rope_scaling_original_max_position_embeddings=8), False),
    # OLMo 2 / OLMoE-style: q/k RMSNorms over the whole projections (--qk-layernorm-scope projection), their
    # weights split over TP with the heads (random here: an unsplit or misordered slice would show) and their
    # mean of squares summed over TP
    "olmo": (dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=4, ffn_hidden_size=96,
                  use_rotary_position_embeddings=True, swiglu=True, normalization="rmsnorm", add_bias_linear=False,
                  untie_embeddings_and_output_weights=True, qk_layernorm=True, qk_layernorm_scope="projection"),
             False),
}


def _config(name: str) -> tuple[ModelConfig, bool]:
    over, reset = CASES[name]
    return resolve_model_config(ModelConfig(**_BASE, **over)), reset


def _shard(full: torch.Tensor, param, rank: int, world: int) -> torch.Tensor:
    """This rank's part of a TP = 1 tensor, as the layer attributes describe it."""
    if not getattr(param, "tensor_model_parallel", False):
        return full
    dim, stride = param.partition_dim, param.partition_stride
    chunks = torch.split(full, full.shape[dim] // (world * stride), dim=dim)
    return torch.cat(chunks[rank::world], dim=dim)


def _one_step(model, tokens, labels, loss_mask):
    position_ids = torch.arange(SEQ).expand_as(tokens)
    logits = model((tokens, position_ids))
    loss = model.loss_fn(logits, (labels, loss_mask))
    loss.backward()
    return logits.detach(), loss.detach()


def _compare_tp2_with_tp1(rank, world_size, name, sequence_parallel):
    import torch.distributed as dist

    from megatron_ds.families.gpt.gpt_model import build_sequential_gpt
    from megatron_ds.parallel.layers import register_sequence_parallel_grad_hooks
    from megatron_ds.parallel.random import set_parallel_seeds

    group = dist.group.WORLD
    cfg, reset = _config(name)
    set_parallel_seeds(1234, rank)
    kw = dict(padded_vocab_size=VOCAB, seed=7, reset_attention_mask=reset, eod_token=EOD if reset else None)
    ref = build_sequential_gpt(cfg, tp_group=None, **kw)
    par = build_sequential_gpt(cfg, tp_group=group, sequence_parallel=sequence_parallel, **kw)
    register_sequence_parallel_grad_hooks(par, group)  # what training does at start-up
    with torch.no_grad():  # norms start at 1: random ones (the same on both ranks) test their layout
        g = torch.Generator().manual_seed(1)
        named = dict(par.named_parameters())
        for n, rp in ref.named_parameters():
            if "_layernorm" in n:
                rp.copy_(1.0 + 0.3 * torch.randn(rp.shape, generator=g))
                named[n].copy_(_shard(rp, named[n], rank, world_size))

    g = torch.Generator().manual_seed(0)  # same batch on both ranks
    tokens = torch.randint(1, VOCAB, (2, SEQ), generator=g)
    tokens[0, 4] = tokens[1, 7] = EOD
    labels = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    loss_mask = (torch.rand(2, SEQ, generator=g) > 0.2).float()

    ref_logits, ref_loss = _one_step(ref, tokens, labels, loss_mask)
    logits, loss = _one_step(par, tokens, labels, loss_mask)

    assert logits.shape == (2, SEQ, VOCAB // world_size)
    parts = [torch.empty_like(logits.contiguous()) for _ in range(world_size)]
    dist.all_gather(parts, logits.contiguous(), group=group)
    where = f"{name}, sequence_parallel={sequence_parallel}, rank {rank}"
    torch.testing.assert_close(torch.cat(parts, dim=-1), ref_logits, **TOL, msg=lambda m: f"{where} logits: {m}")
    torch.testing.assert_close(loss, ref_loss, **TOL, msg=lambda m: f"{where} loss: {m}")
    ref_params = dict(ref.named_parameters())
    names = [n for n, _ in par.named_parameters()]
    assert names == list(ref_params), f"{where}: parameter names differ"
    for n, p in par.named_parameters():
        rp = ref_params[n]
        assert torch.equal(p.detach(), _shard(rp.detach(), p, rank, world_size)), f"{where}: initial {n} differs"
        torch.testing.assert_close(p.grad, _shard(rp.grad, p, rank, world_size), **TOL,
                                   msg=lambda m: f"{where} grad of {n}: {m}")
    return loss.item()


def _all_cases(rank, world_size):
    return {(name, sp): _compare_tp2_with_tp1(rank, world_size, name, sp) for name in CASES for sp in (False, True)}


def test_tp2_equals_tp1_with_and_without_sequence_parallel():
    ranks = run_distributed(_all_cases, 2, timeout=180)
    # Every rank computed the same (replicated) loss.
    assert ranks[0] == ranks[1]
    assert set(ranks[0]) == {(n, sp) for n in CASES for sp in (False, True)}
