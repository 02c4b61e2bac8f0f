"""T5's terms for the layout: its analytic parameter count per pipeline stage, the flags it cannot
run with, what its layers keep for the memory estimate and its pipeline split (``ModelFamily`` fields
of ``families/t5/t5_family.py``'s ``T5``).

The pipeline layers, in ``families/t5/t5_model.py``'s order, with the parameters one tensor parallel rank holds:

    T5Embedding         word V/tp x h, positions P x h (learned), LM-head bias V/tp (with biases)
    T5EncoderLayer x E  (as the GPT's layer: ``layout.layer_parameters``)
    T5EncoderFinalNorm  one norm
    T5Embedding         the decoder's input: a copy on the split-rank stage (tied)
    T5DecoderLayer x D  a GPT layer + cross-attention (query h x hd, key/value h x 2hd, dense hd x h,
                        their biases) + one more norm
    T5DecoderFinalNorm  one norm
    T5Embedding         the LM head: a copy on the last stage where it does not hold the first

Stages split as ``t5_stage_bounds`` says (the split rank's; ``families/t5/t5_model.py`` builds them so),
whatever --pipeline-partition-method.

The memory estimate (``config/memory.py``; ``t5_stage_activations`` here) counts encoder layers at
--encoder-seq-length as the GPT's, decoder layers at --decoder-seq-length with their cross-attention
(``decoder_layer_activation_bytes``), the encoder output each decoder stage holds for its
cross-attentions, and the logits at the decoder length. tests/families/test_family_memory.py measures a
layer of each kind with saved-tensor hooks.
"""
from __future__ import annotations

import dataclasses

from megatron_ds.config.layout import Layout, StageParams, gpt_only_refusals, layer_parameters
from megatron_ds.config.memory import LayerActivations, activation_bytes_per_layer
from megatron_ds.config.schema import Config, ModelConfig
from megatron_ds.errors import ConfigError


def decoder_layers(m: ModelConfig) -> int:
    """--decoder-num-layers, else --num-layers (Megatron-DeepSpeed leaves it unset and fails)."""
    return m.decoder_num_layers or m.num_layers


def cross_attention_parameters(m: ModelConfig, tp: int) -> tuple[int, int]:
    """(split over TP, replicated) parameters a decoder layer adds to a GPT layer."""
    h, q = m.hidden_size, m.num_attention_heads * m.kv_channels
    split = h * q + 2 * h * q + q * h + (3 * q if m.add_bias_linear else 0)
    norm = 2 * h if m.normalization.lower() == "layernorm" else h
    return split // tp, norm + (h if m.add_bias_linear else 0)


def t5_pipeline_layers(m: ModelConfig, padded_vocab: int, tp: int) -> list[tuple[str, int, int]]:
    """(class name, parameters on one TP rank, unique parameters over all TP ranks) per spec."""
    h, d = m.hidden_size, decoder_layers(m)
    split, repl = layer_parameters(m, tp)
    x_split, x_repl = cross_attention_parameters(m, tp)
    words = padded_vocab * h // tp
    pos = m.max_position_embeddings * h if m.position_embedding_type == "learned_absolute" else 0
    bias = padded_vocab // tp if m.add_bias_linear else 0
    # --position-embedding-type relative: the encoder's and the decoder's [buckets, heads] tables, heads split
    rel = 2 * m.relative_attention_num_buckets * m.num_attention_heads // tp \
        if m.position_embedding_type == "relative" else 0
    embedding = words + pos + bias + rel
    norm = 2 * h if m.normalization.lower() == "layernorm" else h
    return ([("T5Embedding", embedding, (words + bias + rel) * tp + pos)]
            + [("T5EncoderLayer", split + repl, split * tp + repl)] * m.num_layers
            + [("T5EncoderFinalNorm", norm, norm), ("T5Embedding", embedding, 0)]
            + [("T5DecoderLayer", split + repl + x_split + x_repl, (split + x_split) * tp + repl + x_repl)] * d
            + [("T5DecoderFinalNorm", norm, norm), ("T5Embedding", embedding, 0)])


def t5_stage_bounds(num_layers: int, decoder_num_layers: int, pp: int, split_rank: int | None) -> list[int]:
    """First spec index of each stage, then the number of specs (DeepSpeed's ``parts``): encoder
    stages get the embedding, equal shares of the encoder layers and (the last) the encoder's final
    norm; decoder stages the decoder embedding, equal shares of the decoder layers, the final norm
    and the LM head (megatron/model/transformer.py ``_get_num_layers``'s equal shares per side)."""
    total = num_layers + decoder_num_layers + 5
    if pp == 1:
        return [0, total]
    enc, dec = num_layers // split_rank, decoder_num_layers // (pp - split_rank)
    parts = [0] + [1 + enc * (i + 1) for i in range(split_rank - 1)]
    parts += [num_layers + 2] + [num_layers + 3 + dec * i for i in range(1, pp - split_rank)]
    return parts + [total]


def count_t5_parameters(m: ModelConfig, padded_vocab: int, tp: int, pp: int, partition_method: str | None = None,
                        ep: int = 1, etp: int = 1) -> tuple[int, tuple[StageParams, ...]]:
    """(unique total, per-stage count on one TP rank), as ``layout.count_parameters`` for the GPT; a
    stage builds the tied embedding once however many of its specs use it. The split rank is the
    model's (--pipeline-model-parallel-split-rank); --dry-run's what-if layouts at another pipeline
    size split it in the middle. ``ep`` and ``etp`` (expert parallel and expert tensor parallel sizes) are 1: T5
    has no MoE layers."""
    layers = t5_pipeline_layers(m, padded_vocab, tp)
    split_rank = m.pipeline_model_parallel_split_rank
    if pp > 1 and (split_rank is None or split_rank >= pp):
        split_rank = pp // 2
    parts = t5_stage_bounds(m.num_layers, decoder_layers(m), pp, split_rank)
    n_transformer = m.num_layers + decoder_layers(m)
    stages = []
    for s in range(pp):
        first, stop = parts[s], parts[s + 1]
        held, p, embedded = layers[first:stop], 0, False
        for name, count, _ in held:
            if name == "T5Embedding":
                if embedded:
                    continue
                embedded = True
            p += count
        # transformer layers before this stage's first spec / its end (encoder 0..E-1, decoder E..E+D-1)
        before = sum(1 for name, _, _ in layers[:first] if name.endswith("Layer"))
        inside = sum(1 for name, _, _ in held if name.endswith("Layer"))
        stages.append(StageParams(s, (before, min(before + inside, n_transformer)), p))
    return sum(total for _, _, total in layers), tuple(stages)


def check_t5(flags: Config, pp: int) -> None:
    """What pretrain_t5.py refuses, in one line each (the model's own checks: ``families/t5/t5_model.py``)."""
    par, data, m = flags.parallel, flags.data, flags.model
    refused = {
        **gpt_only_refusals(flags),
        "--sequence-parallel (T5's layers here keep the whole sequence on every tensor parallel rank)":
            par.sequence_parallel,
        "--reset-attention-mask / --reset-position-ids (a T5 sample is one span-corrupted text)":
            data.reset_attention_mask or data.reset_position_ids,
        "--untie-embeddings-and-output-weights (T5's LM head is the tied embedding, as Megatron's)":
            m.untie_embeddings_and_output_weights,
        "rotary positions (Megatron's T5: learned absolute positions; or --position-embedding-type none)":
            m.use_rotary_position_embeddings or m.position_embedding_type == "rope",
        "--num-key-value-heads (T5's cross-attention is multi-head, as Megatron's)":
            m.num_key_value_heads not in (None, m.num_attention_heads),
    }
    bad = [what for what, on in refused.items() if on]
    if bad:
        raise ConfigError(f"pretrain_t5.py cannot run with {'; '.join(bad)}: drop the flag")
    buckets, distance = m.relative_attention_num_buckets, m.relative_attention_max_distance
    if m.position_embedding_type == "relative" and (buckets < 4 or distance <= buckets // 2):
        # HF's _relative_position_bucket divides by log(max_distance / (buckets // 4)) in the encoder
        # and log(max_distance / (buckets // 2)) in the decoder: both must be positive
        raise ConfigError(f"--relative-attention-num-buckets {buckets} must be at least 4 and "
                          f"--relative-attention-max-distance {distance} above half of it")
    split = m.pipeline_model_parallel_split_rank
    if pp > 1 and (split is None or not 0 < split < pp):
        raise ConfigError(f"pretrain_t5.py at --pipeline-model-parallel-size {pp} needs "
                          f"--pipeline-model-parallel-split-rank in [1, {pp - 1}] (encoder stages before it)")
    if pp > 1 and not par.no_pipeline_parallel:
        for name, layers, ranks in (("--encoder-num-layers", m.num_layers, split),
                                    ("--decoder-num-layers", m.decoder_num_layers or m.num_layers, pp - split)):
            if layers is not None and layers % ranks:  # megatron/model/transformer.py _get_num_layers
                raise ConfigError(f"{name} {layers} must be divisible by the {ranks} pipeline stages on its side "
                                  f"of --pipeline-model-parallel-split-rank {split}")
    decoder_seq = flags.masked_lm.decoder_seq_length
    if decoder_seq is None:
        raise ConfigError("pretrain_t5.py needs --decoder-seq-length (the decoder's input and target length)")
    if m.max_position_embeddings is not None and m.position_embedding_type == "learned_absolute":
        longest = max(m.seq_length or 0, decoder_seq)
        if m.max_position_embeddings < longest:  # megatron/arguments.py asserts both
            raise ConfigError(f"--max-position-embeddings {m.max_position_embeddings} is shorter than the longest "
                              f"sequence ({longest}): raise it")


def _act_scale(layout: Layout) -> int:
    """fp32 activations double every 16-bit byte (``activation_bytes_per_layer``)."""
    return 2 if layout.precision == "fp32" else 1


def relative_mask_bytes(layout: Layout, seq: int) -> float:
    """--position-embedding-type relative: the additive mask a self-attention hands SDPA (its stack's
    bias where a key is allowed, ``families/t5/t5_model.py biased_mask``), ``[b, a/t, s, s]`` in the activations'
    dtype. On a GPU the memory-efficient kernel (flash takes no mask) keeps it for backward, which also
    computes its gradient; without relative positions the mask is boolean and broadcast over heads."""
    if layout.model.position_embedding_type != "relative":
        return 0.0
    heads = layout.model.num_attention_heads / layout.tp
    return 2 * layout.micro_batch_size * heads * seq * seq * _act_scale(layout)


def decoder_layer_activation_bytes(layout: Layout, *, recompute: str | None) -> float:
    """Activations a T5 decoder layer keeps for backward, one micro-batch on one GPU (``families/t5/t5_model.py``
    ``T5DecoderLayer``), in the terms of ``memory.activation_bytes_per_layer`` (b micro batch, t TP
    ranks, s_d / s_e the decoder's / encoder's lengths):

      the GPT layer's at s_d: causal self-attention and the MLP (selective recompute re-runs the
        self-attention's core only)
      cross-attention, per s_d b h: replicated its norm's input (2, 4 with --fp32-residual-connection),
        the query projection's input 2 and its dropout mask (as the GPT layer's); split by t the query
        2 a d/h, the attention output 2 a d/h (the output projection's input) and the logsumexp 4 a/h
      cross-attention, per s_e b h: the keys and values 2 2 a d/h split by t (views of the fused
        key/value projection's output, which they keep whole); its input is the encoder output, held
        once per stage (``t5_stage_activations``), not per layer
      the self-attention's causal mask [b, 1, s_d, s_d] as SDPA's additive mask, 2 bytes (with relative
        positions, the [b, a/t, s_d, s_d] biased mask instead: ``relative_mask_bytes``)
    """
    m = layout.model
    s_e, s_d, b, h, t = m.seq_length, layout.decoder_seq_length, layout.micro_batch_size, m.hidden_size, layout.tp
    a, d = m.num_attention_heads, m.kv_channels
    at_decoder = dataclasses.replace(layout, model=dataclasses.replace(m, seq_length=s_d))
    self_attention_and_mlp = activation_bytes_per_layer(at_decoder, recompute=recompute)
    residual = 4 if m.fp32_residual_connection else 2
    mask = (2 if m.bias_dropout_fusion else 1) if m.hidden_dropout > 0 else 0
    per_decoder_token = residual + 2 + mask + (2 * a * d / h + 2 * a * d / h + 4 * a / h) / t
    per_encoder_token = 2 * 2 * a * d / h / t
    cross = (s_d * b * h * per_decoder_token + s_e * b * h * per_encoder_token) * _act_scale(layout)
    causal = relative_mask_bytes(layout, s_d) or 2 * b * s_d * s_d * _act_scale(layout)
    return self_attention_and_mlp + cross + causal


def t5_stage_activations(layout: Layout, stage) -> tuple[list[list[LayerActivations]], float]:
    """``ModelFamily.activations`` of T5: the stage's encoder layers (0..E-1) as one run at the encoder's
    length, its decoder layers (E..) as another, and its buffers per micro-batch: the hidden state of
    each stack it holds at that stack's length (with relative positions, that stack's [1, a/t, s, s]
    bias, which rides along), and on a stage with decoder layers the encoder output, which every
    cross-attention's key/value projection keeps as its input."""
    m = layout.model
    s_e, s_d, b, h = m.seq_length, layout.decoder_seq_length, layout.micro_batch_size, m.hidden_size
    act_bytes = 4 if layout.precision == "fp32" or m.fp32_residual_connection else 2
    first, stop = stage.layers
    encoder_layers = max(0, min(stop, m.num_layers) - first)
    decoder_layers_here = max(0, stop - max(first, m.num_layers))
    encoder = LayerActivations(activation_bytes_per_layer(layout, recompute=layout.recompute)
                               + relative_mask_bytes(layout, s_e),
                               activation_bytes_per_layer(layout, recompute=None) + relative_mask_bytes(layout, s_e),
                               s_e * b * h * act_bytes)
    decoder = LayerActivations(decoder_layer_activation_bytes(layout, recompute=layout.recompute),
                               decoder_layer_activation_bytes(layout, recompute=None), s_d * b * h * act_bytes)
    boundary = 0.0
    for layers, seq in ((encoder_layers, s_e), (decoder_layers_here, s_d)):
        if layers:
            boundary += seq * b * h * act_bytes + relative_mask_bytes(layout, seq) / b
    if decoder_layers_here:
        boundary += s_e * b * h * act_bytes  # the encoder output
    return [[encoder] * encoder_layers, [decoder] * decoder_layers_here], boundary


def t5_pipeline_choice(m: ModelConfig, pp: int):
    """--dry-run's suggestion of pipeline size ``pp``: split in the middle (the rank a what-if layout takes in
    count_t5_parameters), when each side's layers divide over its stages (check_t5); the model with that
    split rank and its flag, or None."""
    split = pp // 2
    if m.num_layers % split or decoder_layers(m) % (pp - split):
        return None
    flag = f" --pipeline-model-parallel-split-rank {split}"
    return dataclasses.replace(m, pipeline_model_parallel_split_rank=split), flag



def t5_decoder_seq_length(flags: Config) -> int | None:
    """``ModelFamily.decoder_seq_length`` of T5: --decoder-seq-length (the model's seq_length is the encoder's)."""
    return flags.masked_lm.decoder_seq_length
