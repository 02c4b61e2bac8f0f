"""Model FLOPs of one training iteration: the matmuls the model really runs (DESIGN.md section 7).

Per token and transformer layer, forward, counting a multiply-add as 2 FLOPs (d = kv_channels,
a = query heads, g = key/value heads, f = ffn size, s = sequence length, h = hidden size):

    QKV projection          2 h (a + 2 g) d         grouped-query attention has fewer K/V heads
    attention scores        2 s a d                 every query against all s keys, as Megatron
    attention over values   2 s a d                 counts it (the causal half is not subtracted)
    output projection       2 a d h
    MLP                     2 h f x (3 with SwiGLU's gate, else 2)

plus the output layer, 2 h V per token (V the padded vocabulary: the matmul runs over it; tied or
untied, it is one matmul). Backward costs two forwards (gradients for inputs and weights): x3.
Full recompute runs the transformer layers' forward once more, with --hidden-dropout 0 except each
layer's last matmul (the MLP's output projection): torch's non-reentrant checkpoint
(megatron_ds.parallel.random) stops recomputing once every tensor backward needs is back. With
hidden dropout on, the mask drawn after that matmul is one of them, so the whole forward re-runs.
The output layer is not inside a recomputed chunk, so it stays x3. (Megatron's closed form, 96 instead of 72, scales everything by
4; this counts what runs.) Selective recompute is not counted, as in Megatron.
Embedding lookups, norms and element-wise work are not matmuls and are not counted.

For GPT-2 shapes (a = g, a d = h, f = 4h, no SwiGLU) this is the closed form
``72 B s l h^2 (1 + s/(6h) + V/(12 l h))``.

Mixture of experts (issue 21): an MoE layer with E experts counts the experts a token is routed to, top-k
MLPs (the active experts only), plus the gate's 2 h E and, with --mlp-type residual, the dense MLP and the
2-way coefficient 2 h 2. What DeepSpeed's MOELayer runs around them is not model work and is not counted:
the dispatch and combine einsums (matmuls over the one-hot routing), and the capacity slots the experts
run empty or that hold dropped tokens. (Megatron-DeepSpeed's throughput_calculator multiplies every layer's
MLP by --topk, dense layers too; this counts each layer as it is.) Under full recompute an MoE layer runs
its whole forward again: the experts' outputs are what the combine keeps for backward.

BERT's and T5's counts (``families/bert/bert_flops.py``, ``families/t5/t5_flops.py``) build on
``dense_layer_flops``.
"""
from __future__ import annotations

import dataclasses

from megatron_ds.config.moe_params import model_experts


def layer_forward_flops_per_token(*, hidden: int, heads: int, kv_heads: int, kv_channels: int, ffn: int,
                                  swiglu: bool, seq: int) -> int:
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
    unless hidden dropout draws a mask after it that backward needs (the module docstring)."""
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
