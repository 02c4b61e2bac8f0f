"""Bidirectional self-attention with a padding mask (``self_attn_mask_type="padding"``), against a
dense layer written here from the math with Megatron's BERT mask.

The reference transcribes Megatron-DeepSpeed's padding path: ``bert_extended_attention_mask``
(megatron/model/bert_model.py: the [b, s] mask outer-multiplied with itself, masked where < 0.5)
and the unfused softmax of megatron/model/fused_softmax.py / transformer.py (masked scores filled
with -10000 before the softmax). Real positions must agree; padding positions are irrelevant to
Megatron's losses and differ by design (``padding_attention_mask``'s docstring).
"""
from __future__ import annotations

import dataclasses
import math

import torch

from megatron_ds.config.layout import resolve_model_config
from megatron_ds.config.schema import ModelConfig
from megatron_ds.model.transformer import ParallelTransformerLayer

# fp32; model and reference sum the same products in different orders (fused QKV, SDPA vs explicit
# softmax): a few ulps of O(1) activations. A wrong mask moves outputs by O(0.1).
TOL = dict(rtol=1e-5, atol=1e-5)
SEQ, B = 7, 3


def _cfg():
    cfg = ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=SEQ, hidden_dropout=0.0,
                      attention_dropout=0.0, init_method_std=0.3)
    return resolve_model_config(cfg)


def _layer_norm(x, norm):
    return torch.nn.functional.layer_norm(x, x.shape[-1:], norm.weight, norm.bias, norm.eps)


def _megatron_reference(layer, x, padding_mask):
    """x [s, b, h]; padding_mask [b, s] (1 real) -> the layer's output, Megatron's way."""
    s, b, h = x.shape
    heads, d = layer.self_attention.num_heads, layer.self_attention.kv_channels
    normed = _layer_norm(x, layer.input_layernorm)
    qkv = normed @ layer.self_attention.query_key_value.weight.T + layer.self_attention.query_key_value.bias
    qkv = qkv.view(s, b, heads, 3, d)  # MHA: per head [q; k; v]
    q, k, v = (qkv[:, :, :, i].permute(1, 2, 0, 3) for i in range(3))  # [b, heads, s, d]
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    m = padding_mask.float()
    masked = (m[:, None, :] * m[:, :, None]).unsqueeze(1) < 0.5  # bert_extended_attention_mask
    probs = torch.softmax(scores.masked_fill(masked, -10000.0), dim=-1)
    context = (probs @ v).permute(2, 0, 1, 3).reshape(s, b, heads * d)
    attn = context @ layer.self_attention.dense.weight.T + layer.self_attention.dense.bias
    hidden = x + attn
    normed = _layer_norm(hidden, layer.post_attention_layernorm)
    inner = torch.nn.functional.gelu(normed @ layer.mlp.dense_h_to_4h.weight.T + layer.mlp.dense_h_to_4h.bias)
    return hidden + inner @ layer.mlp.dense_4h_to_h.weight.T + layer.mlp.dense_4h_to_h.bias


def _inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SEQ, B, 16, generator=g)
    lengths = torch.tensor([SEQ, 4, 2])
    padding_mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
    return x, padding_mask


def test_padding_layer_matches_megatron_at_real_positions():
    torch.manual_seed(1)
    layer = ParallelTransformerLayer(_cfg(), 1, self_attn_mask_type="padding")
    x, padding_mask = _inputs()
    out, mask_out = layer((x, padding_mask))
    assert torch.equal(mask_out, padding_mask)  # travels on to the next layer / stage
    ref = _megatron_reference(layer, x, padding_mask)
    real = padding_mask.T.bool()  # [s, b]
    torch.testing.assert_close(out[real], ref[real], **TOL)


def test_padding_never_reaches_real_positions():
    """Changing what sits at padded positions changes no real position's output (or gradient)."""
    torch.manual_seed(1)
    layer = ParallelTransformerLayer(_cfg(), 1, self_attn_mask_type="padding")
    x, padding_mask = _inputs()
    other = x.clone()
    other[~padding_mask.T.bool()] = 5.0
    real = padding_mask.T.bool()
    torch.testing.assert_close(layer((x, padding_mask))[0][real], layer((other, padding_mask))[0][real],
                               rtol=0, atol=1e-6)  # only summation order of exact zeros


def test_unpadded_input_attends_both_ways():
    """Without a mask a padding layer is fully bidirectional (all ones), a causal one is not."""
    torch.manual_seed(1)
    cfg = _cfg()
    bidirectional = ParallelTransformerLayer(cfg, 1, self_attn_mask_type="padding")
    torch.manual_seed(1)
    causal = ParallelTransformerLayer(cfg, 1)
    x, _ = _inputs()
    ones = torch.ones(B, SEQ, dtype=torch.long)
    torch.testing.assert_close(bidirectional(x), _megatron_reference(bidirectional, x, ones), **TOL)
    assert not torch.allclose(causal(x), bidirectional(x), atol=1e-3)
    # the first position of a causal layer sees itself only; the mask changes nothing there
    torch.testing.assert_close(causal(x)[0], bidirectional((x[:1], ones[:, :1]))[0][0], **TOL)


def test_unknown_mask_type_is_refused():
    try:
        ParallelTransformerLayer(dataclasses.replace(_cfg()), 1, self_attn_mask_type="cross")
    except ValueError as exc:
        assert "self_attn_mask_type" in str(exc)
    else:
        raise AssertionError("accepted an unknown mask type")
