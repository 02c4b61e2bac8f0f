"""Model FLOPs of the transformer's pieces, the terms each model family's count of one training iteration
(``ModelFamily.flops``: the GPT's in ``families/gpt/gpt_flops.py``) is made of, for the iteration line's
TFLOP/s per GPU, the planner's time model and the benches' MFU.

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


def layer_forward_flops_per_token(*, hidden: int, heads: int, kv_heads: int, kv_channels: int, ffn: int,
                                  swiglu: bool, seq: int) -> int:
    """Forward FLOPs per token of one dense transformer layer whose queries each see ``seq`` keys."""
    qkv = 2 * hidden * (heads + 2 * kv_heads) * kv_channels
    attention = 2 * 2 * seq * heads * kv_channels  # scores and values
    projection = 2 * heads * kv_channels * hidden
    mlp = 2 * hidden * ffn * (3 if swiglu else 2)
    return qkv + attention + projection + mlp


def unrecomputed_flops(m) -> int:
    """FLOPs per token of a dense layer that full recompute does not re-run: the MLP's output projection,
    unless hidden dropout draws a mask after it that backward needs (docs/flops.md)."""
    return 2 * m.ffn_hidden_size * m.hidden_size if m.hidden_dropout == 0 else 0


def mla_attention_flops_per_token(m, seq: int) -> int:
    """Forward FLOPs per token of multi-latent attention (``model/mla.py``): its down and up projections (Megatron-LM's
    training.py num_floating_point_operations counts the same matrices), scores over query heads of qk + rope
    channels, values of v channels, the output projection."""
    h, a, q_head = m.hidden_size, m.num_attention_heads, m.qk_head_dim + m.qk_pos_emb_head_dim
    q = 2 * h * a * q_head if m.q_lora_rank is None else 2 * m.q_lora_rank * (h + a * q_head)
    kv = 2 * h * (m.kv_lora_rank + m.qk_pos_emb_head_dim) + 2 * m.kv_lora_rank * a * (m.qk_head_dim + m.v_head_dim)
    return q + kv + 2 * seq * a * (q_head + m.v_head_dim) + 2 * a * m.v_head_dim * h


def dense_layer_flops(m, seq: int) -> tuple[int, int]:
    """(forward, recomputed) FLOPs per token of one dense transformer layer at ``seq`` keys."""
    forward = layer_forward_flops_per_token(hidden=m.hidden_size, heads=m.num_attention_heads,
                                            kv_heads=m.num_key_value_heads, kv_channels=m.kv_channels,
                                            ffn=m.ffn_hidden_size, swiglu=m.swiglu or m.geglu, seq=seq)
    if getattr(m, "multi_latent_attention", False):
        forward += mla_attention_flops_per_token(m, seq) - layer_forward_flops_per_token(
            hidden=m.hidden_size, heads=m.num_attention_heads, kv_heads=m.num_key_value_heads,
            kv_channels=m.kv_channels, ffn=0, swiglu=False, seq=seq)
    return forward, forward - unrecomputed_flops(m)
