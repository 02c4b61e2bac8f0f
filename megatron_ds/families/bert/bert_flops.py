"""BERT's model FLOPs of one training iteration (``ModelFamily.flops``), in the terms of
``planner/flops.py`` (its module docstring: a multiply-add is 2 FLOPs, backward two forwards, what
full recompute re-runs).

BERT (pretrain_bert.py; ``families/bert/bert_model.py``): the dense layers at s = --seq-length (bidirectional, every
query against all s keys), then per token the MLM head's transform, a dense h -> h (2 h^2), and the
output layer over the padded vocabulary (2 h V); with the binary head, per sequence (position 0 only)
the pooler's dense h -> h (2 h^2) and the binary head h -> 2 (2 h 2). Full recompute re-runs the
transformer layers only (the heads are not in a recomputed chunk), as the GPT's.
"""
from __future__ import annotations

import dataclasses

from megatron_ds.planner.flops import dense_layer_flops


def bert_flops_per_iteration(model, batch: int, padded_vocab_size: int, full_recompute: bool) -> float:
    """BERT's FLOPs of one iteration over ``batch`` sequences of ``model.seq_length`` tokens (module docstring)."""
    m, h = model, model.hidden_size
    tokens = batch * m.seq_length
    forward, recompute = dense_layer_flops(m, m.seq_length)
    layers = m.num_layers * (3 * forward + (recompute if full_recompute else 0))
    mlm_head = 2 * h * h + 2 * h * padded_vocab_size
    pooler = 2 * h * h + 2 * h * 2 if m.bert_binary_head else 0  # once per sequence: position 0
    return float(tokens * (layers + 3 * mlm_head) + batch * 3 * pooler)


def bert_iteration_flops(layout, seq_length: int) -> float:
    """``gpt_iteration_flops`` for BERT (no warm-up: ``seq_length`` is the model's)."""
    model = dataclasses.replace(layout.model, seq_length=seq_length)
    return bert_flops_per_iteration(model, layout.global_batch_size, layout.padded_vocab_size,
                                    layout.recompute == "full")
