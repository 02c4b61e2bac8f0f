"""T5's model FLOPs of one training iteration (``ModelFamily.flops``), in the terms of
``planner/flops.py`` (its module docstring: a multiply-add is 2 FLOPs, backward two forwards, what
full recompute re-runs).

T5 (pretrain_t5.py; ``families/t5/t5_model.py``), s_e = --encoder-seq-length, s_d = --decoder-seq-length:

    encoder layer           the dense layer at s = s_e, per encoder token
    decoder layer           the dense layer at s = s_d, per decoder token (causal self-attention
                            counted over all s_d keys, as the GPT's), plus cross-attention:
      query projection      2 h a d                 per decoder token
      key/value projection  2 h 2 a d               per encoder token (of the encoder output)
      scores and values     2 2 s_e a d             per decoder token: every query against s_e keys
      output projection     2 a d h                 per decoder token
    LM head                 2 h V                   per decoder token (the tied word embedding)

The relative position bias (--position-embedding-type relative) is a table lookup, not a matmul.
Full recompute re-runs every encoder and decoder layer as the GPT's (the cross-attention included).
"""
from __future__ import annotations

import dataclasses

from megatron_ds.families.t5.t5_params import decoder_layers
from megatron_ds.planner.flops import dense_layer_flops


def t5_flops_per_iteration(model, batch: int, padded_vocab_size: int, full_recompute: bool, *,
                           decoder_seq_length: int) -> float:
    """T5's FLOPs of one iteration over ``batch`` samples of ``model.seq_length`` encoder and
    ``decoder_seq_length`` decoder tokens (module docstring)."""
    m, h, s_e, s_d = model, model.hidden_size, model.seq_length, decoder_seq_length
    q = m.num_attention_heads * m.kv_channels  # multi-head only (families/t5/t5_params.py check_t5)
    enc_forward, enc_recompute = dense_layer_flops(m, s_e)
    dec_forward, dec_recompute = dense_layer_flops(m, s_d)
    cross_per_decoder_token = 2 * h * q + 2 * 2 * s_e * q + 2 * q * h
    cross_per_encoder_token = 2 * h * 2 * q
    encoder = m.num_layers * s_e * (3 * enc_forward + (enc_recompute if full_recompute else 0))
    per_decoder_layer = (s_d * (dec_forward + cross_per_decoder_token) + s_e * cross_per_encoder_token,
                         s_d * (dec_recompute + cross_per_decoder_token) + s_e * cross_per_encoder_token)
    decoder = decoder_layers(m) * (3 * per_decoder_layer[0] + (per_decoder_layer[1] if full_recompute else 0))
    lm_head = s_d * 2 * h * padded_vocab_size
    return float(batch * (encoder + decoder + 3 * lm_head))


def t5_iteration_flops(layout, seq_length: int) -> float:
    """``gpt_iteration_flops`` for T5: ``seq_length`` the encoder's, the decoder's the layout's."""
    model = dataclasses.replace(layout.model, seq_length=seq_length)
    return t5_flops_per_iteration(model, layout.global_batch_size, layout.padded_vocab_size,
                                  layout.recompute == "full", decoder_seq_length=layout.decoder_seq_length)
