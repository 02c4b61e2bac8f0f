"""The GPT's model FLOPs of one training iteration (``ModelFamily.flops``), in the terms of
``planner/flops.py``: its transformer layers (MoE layers their gate and the top-k experts a token is
routed to, not DeepSpeed's routing einsums) and the output layer over the padded vocabulary, x3 for
forward and backward, plus what full recompute re-runs. docs/flops.md has the derivation.
"""
from __future__ import annotations

import dataclasses

from megatron_ds.config.moe_selection import is_mlm_moe
from megatron_ds.config.moe_params import model_experts
from megatron_ds.planner.flops import dense_layer_flops


def moe_mlp_forward_flops_per_token(m, experts: int) -> int:
    """An MoE layer's MLP side per token, forward: the gate, top-k experts, a residual MLP and its coefficient
    (DeepSpeed-MoE); the router, top-k experts of --moe-ffn-hidden-size and the shared experts (Megatron-LM's)."""
    h = m.hidden_size
    if is_mlm_moe(m):
        matrices = 3 if m.swiglu or m.geglu else 2
        shared = 2 * h * (m.moe_shared_expert_intermediate_size or 0) * matrices
        gate = 2 * h if m.moe_shared_expert_gate else 0
        return 2 * h * experts + m.moe_router_topk * 2 * h * m.moe_ffn_hidden_size * matrices + shared + gate
    mlp = 2 * h * m.ffn_hidden_size * (3 if m.swiglu or m.geglu else 2)
    residual = mlp + 2 * h * 2 if m.mlp_type == "residual" else 0
    return 2 * h * experts + min(m.topk, experts) * mlp + residual


def model_flops_per_iteration(model, batch: int, padded_vocab_size: int, full_recompute: bool) -> float:
    """FLOPs of one iteration over ``batch`` sequences (the global batch) of ``model.seq_length``
    tokens; ``model`` is a resolved ``ModelConfig`` (every size set)."""
    m = model
    tokens = batch * m.seq_length
    layer, dense_recompute = dense_layer_flops(m, m.seq_length)
    output_layer = 2 * m.hidden_size * padded_vocab_size
    dense_mlp = 2 * m.hidden_size * m.ffn_hidden_size * (3 if m.swiglu or m.geglu else 2)
    total = 0
    for experts in model_experts(m):
        if experts == 1:
            forward, recompute = layer, dense_recompute
        else:
            forward = layer - dense_mlp + moe_mlp_forward_flops_per_token(m, experts)
            recompute = forward
        total += 3 * forward + (recompute if full_recompute else 0)
    return float(tokens * (total + 3 * output_layer))


def gpt_iteration_flops(layout, seq_length: int) -> float:
    """A ``ModelFamily.flops``: the GPT's FLOPs of one iteration at the layout's global batch, its
    sequences ``seq_length`` long (shorter than the model's under the sequence-length warm-up)."""
    model = dataclasses.replace(layout.model, seq_length=seq_length)
    return model_flops_per_iteration(model, layout.global_batch_size, layout.padded_vocab_size,
                                     layout.recompute == "full")
