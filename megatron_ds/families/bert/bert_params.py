"""BERT's terms for the layout: its analytic parameter count per pipeline stage, the flags it cannot
run with and what its layers keep for the memory estimate (``ModelFamily.count_parameters``,
``check`` and ``activations`` of ``families/bert/bert_family.py``'s ``BERT``).

The pipeline layers, in ``families/bert/bert_model.py``'s order, with the parameters one tensor parallel rank holds:

    BertEmbedding   word V/tp x h, positions P x h, token types 2 x h (binary head only)
    ParallelTransformerLayer x N   (as the GPT's: ``layout.layer_parameters``)
    FinalNorm       2 h
    BertHeads       dense h x h + h, LayerNorm 2 h; pooler h x h + h and binary head 2 h + 2 (binary head only)
    BertEmbedding   the tied word embedding V/tp x h (a copy where the stage does not hold the first)
    BertLMBias      V/tp

The memory estimate (``config/memory.py``) counts BERT's transformer layers as the GPT's (the same
layer; its [b, 1, 1, s] padding mask is negligible) and adds, on the last stage, what the MLM head's
transform keeps (``mlm_head_activation_bytes``; tests/families/test_family_memory.py measures it).
"""
from __future__ import annotations

from megatron_ds.config.layout import Layout, StageParams, gpt_only_refusals, layer_parameters
from megatron_ds.config.memory import LayerActivations, stack_activations
from megatron_ds.config.schema import Config, ModelConfig
from megatron_ds.errors import ConfigError
from megatron_ds.parallel.partition import partition_stages

TIED = "BertEmbedding"


def bert_pipeline_layers(m: ModelConfig, padded_vocab: int, tp: int) -> list[tuple[str, int, int]]:
    """(class name, parameters on one TP rank, parameters over all TP ranks) of each pipeline layer."""
    h = m.hidden_size
    split, repl = layer_parameters(m, tp)
    emb = padded_vocab * h // tp
    types = 2 * h if m.bert_binary_head else 0
    embedding = emb + m.max_position_embeddings * h + types
    heads = h * h + h + 2 * h + ((h * h + h) + (2 * h + 2) if m.bert_binary_head else 0)
    bias = padded_vocab // tp
    return ([("BertEmbedding", embedding, embedding + emb * (tp - 1))]
            + [("ParallelTransformerLayer", split + repl, split * tp + repl)] * m.num_layers
            + [("FinalNorm", 2 * h, 2 * h), ("BertHeads", heads, heads), (TIED, emb, 0),
               ("BertLMBias", bias, bias * tp)])


def count_bert_parameters(m: ModelConfig, padded_vocab: int, tp: int, pp: int,
                          partition_method: str | None = None, ep: int = 1, etp: int = 1
                          ) -> tuple[int, tuple[StageParams, ...]]:
    """(unique total, per-stage count on one TP rank), as ``layout.count_parameters`` for the GPT
    (``ep``, ``etp``: its expert parallel and expert tensor parallel sizes, 1 here: BERT has no MoE layers)."""
    layers = bert_pipeline_layers(m, padded_vocab, tp)
    if partition_method is None:
        partition_method = "type:ParallelTransformerLayer"
    parts = partition_stages(pp, partition_method, [name for name, _, _ in layers],
                             lambda: [count for _, count, _ in layers])
    n, stages = m.num_layers, []
    for s in range(pp):
        first, stop = parts[s], parts[s + 1]
        held = layers[first:stop]
        p = sum(count for _, count, _ in held)
        if first == 0 and stop > len(layers) - 2:  # the output layer borrows this stage's embedding
            p -= layers[-2][1]
        stages.append(StageParams(s, (min(max(first - 1, 0), n), min(max(stop - 1, 0), n)), p))
    return sum(total for _, _, total in layers), tuple(stages)


def check_bert(flags: Config, pp: int) -> None:
    """What pretrain_bert.py refuses, in one line each."""
    data, m = flags.data, flags.model
    refused = {
        **gpt_only_refusals(flags),
        "--reset-attention-mask / --reset-position-ids (BERT samples are one [CLS] A [SEP] B [SEP] each)":
            data.reset_attention_mask or data.reset_position_ids,
        "--untie-embeddings-and-output-weights (BERT's MLM head is tied, as Megatron's)":
            m.untie_embeddings_and_output_weights,
        "--swiglu / --relu / --geglu / --normalization rmsnorm / rotary, relative or no positions (Megatron's "
        "BERT: GeLU, LayerNorm, learned positions)": m.swiglu or m.relu or m.geglu
        or m.normalization.lower() != "layernorm" or m.use_rotary_position_embeddings
        or m.position_embedding_type != "learned_absolute" or m.no_position_embedding,
        "--train-data-path / --valid-data-path / --test-data-path (BERT samples come from --data-path and "
        "--split, as upstream's pretrain_bert.py)": bool(data.train_data_path or data.valid_data_path
                                                         or data.test_data_path),
    }
    bad = [what for what, on in refused.items() if on]
    if bad:
        raise ConfigError(f"pretrain_bert.py cannot run with {'; '.join(bad)}: drop the flag")


def mlm_head_activation_bytes(layout: Layout) -> float:
    """What ``families/bert/bert_model.py BertHeads``' MLM transform keeps for backward, one micro-batch: the dense
    h -> h's output (GeLU's input), GeLU's output (the LayerNorm's input) and the LayerNorm's output (the
    tied projection's input), 2 bytes per s b h each (fp32: 4), replicated over the tensor parallel ranks
    (the head gathers the sequence first). Its input, the final norm's output, is the GPT's output layer's
    input too; the pooler's [b, h] tensors are negligible."""
    m = layout.model
    return 3 * 2 * m.seq_length * layout.micro_batch_size * m.hidden_size * (2 if layout.precision == "fp32" else 1)


def bert_stage_activations(layout: Layout, stage) -> tuple[list[list[LayerActivations]], float]:
    """``ModelFamily.activations`` of BERT: the GPT's, and on the last stage the MLM head's transform."""
    runs, boundary = stack_activations(layout, stage)
    if stage.stage == layout.pp - 1:
        boundary += mlm_head_activation_bytes(layout)
    return runs, boundary

