"""Model FLOPs of one training iteration, for the iteration line's TFLOP/s per GPU and the benches' MFU.

What is counted is the matmuls the model really runs, a multiply-add being 2 FLOPs: QKV (fewer K/V
heads under grouped-query attention), attention scores and values over all s keys (as Megatron
counts them), the output projection, the MLP at its ffn size (SwiGLU's third matrix included) and
the output layer over the padded vocabulary. Backward counts as two forwards (x3); full recompute
adds what it really re-runs (not the output layer; not a dense layer's last matmul when hidden
dropout is 0, as torch's non-reentrant checkpoint stops once backward has what it needs). MoE
layers count their gate and the top-k experts a token is routed to, not DeepSpeed's routing
einsums. Norms, lookups and element-wise work are not counted.

For GPT-2 shapes (query heads = K/V heads, heads x kv_channels = h, ffn = 4h, no SwiGLU) this is
Megatron's closed form ``72 B s l h^2 (1 + s/(6h) + V/(12 l h))``: a layer is 24 h^2 + 4 s h FLOPs
per token forward, the output layer 2 h V, all x3. The per-piece table, the BERT and T5 counts and
the derivation are in docs/flops.md.
"""
from __future__ import annotations

import dataclasses

from megatron_ds.config.moe_params import model_experts


def layer_forward_flops_per_token(*, hidden: int, heads: int, kv_heads: int, kv_channels: int, ffn: int,
                                  swiglu: bool, seq: int) -> int:
    """Forward FLOPs per token of one dense transformer layer whose queries each see ``seq`` keys."""
    qkv = 2 * hidden * (heads + 2 * kv_heads) * kv_channels
    attention = 2 * 2 * seq * heads * kv_channels  # scores and values
    projection = 2 * heads * kv_channels * hidden
    mlp = 2 * hidden * ffn * (3 if swiglu else 2)
    return qkv + attention + projection + mlp


def moe_mlp_forward_flops_per_token(m, experts: int) -> int:
    """An MoE layer's MLP side per token, forward: the gate, top-k experts, a residual MLP and its coefficient."""
    h = m.hidden_size
    mlp = 2 * h * m.ffn_hidden_size * (3 if m.swiglu or m.geglu else 2)
    residual = mlp + 2 * h * 2 if m.mlp_type == "residual" else 0
    return 2 * h * experts + min(m.topk, experts) * mlp + residual


def model_flops_per_iteration(model, batch: int, padded_vocab_size: int, full_recompute: bool) -> float:
    """FLOPs of one iteration over ``batch`` sequences (the global batch) of ``model.seq_length``
    tokens; ``model`` is a resolved ``ModelConfig`` (every size set)."""
    m = model
    tokens = batch * m.seq_length
    layer = layer_forward_flops_per_token(hidden=m.hidden_size, heads=m.num_attention_heads,
                                          kv_heads=m.num_key_value_heads, kv_channels=m.kv_channels,
                                          ffn=m.ffn_hidden_size, swiglu=m.swiglu or m.geglu, seq=m.seq_length)
    output_layer = 2 * m.hidden_size * padded_vocab_size
    dense_mlp = 2 * m.hidden_size * m.ffn_hidden_size * (3 if m.swiglu or m.geglu else 2)
    total = 0
    for experts in model_experts(m):
        if experts == 1:
            forward, recompute = layer, layer - _unrecomputed(m)
        else:
            forward = layer - dense_mlp + moe_mlp_forward_flops_per_token(m, experts)
            recompute = forward
        total += 3 * forward + (recompute if full_recompute else 0)
    return float(tokens * (total + 3 * output_layer))


def _unrecomputed(m) -> int:
    """FLOPs per token of a dense layer that full recompute does not re-run: the MLP's output projection,
    unless hidden dropout draws a mask after it that backward needs (docs/flops.md)."""
    return 2 * m.ffn_hidden_size * m.hidden_size if m.hidden_dropout == 0 else 0


def dense_layer_flops(m, seq: int) -> tuple[int, int]:
    """(forward, recomputed) FLOPs per token of one dense transformer layer at ``seq`` keys."""
    forward = layer_forward_flops_per_token(hidden=m.hidden_size, heads=m.num_attention_heads,
                                            kv_heads=m.num_key_value_heads, kv_channels=m.kv_channels,
                                            ffn=m.ffn_hidden_size, swiglu=m.swiglu or m.geglu, seq=seq)
    return forward, forward - _unrecomputed(m)


def gpt_iteration_flops(layout, seq_length: int) -> float:
    """A ``ModelFamily.flops``: the GPT's FLOPs of one iteration at the layout's global batch, its
    sequences ``seq_length`` long (shorter than the model's under the sequence-length warm-up)."""
    model = dataclasses.replace(layout.model, seq_length=seq_length)
    return model_flops_per_iteration(model, layout.global_batch_size, layout.padded_vocab_size,
                                     layout.recompute == "full")
