"""The GPT's parameter counts and checks (``ModelFamily.count_parameters``, ``active_parameters``,
``check``): the analytic count --dry-run, the memory estimate and the planner read, per pipeline stage
as DeepSpeed partitions the layers of ``gpt_model.py`` (checked against the built model in
``tests/families/gpt/test_pipeline.py`` and by --dry-run's meta-device build).
"""
from __future__ import annotations

from megatron_ds.config.layout import StageParams, layer_counts
from megatron_ds.config.schema import Config, ModelConfig
from megatron_ds.errors import ConfigError
from megatron_ds.parallel.partition import partition_stages


def _pipeline_layers(m: ModelConfig, padded_vocab: int, tp: int, ep: int = 1, etp: int = 1) -> list[tuple[str, int]]:
    """(class name, parameters on one TP rank) of the GPT's pipeline layers in order, as
    ``gpt_model.py`` lists them (the names are what a "type:" partition method matches): the
    embedding, the transformer layers, the final norm, the output layer -- tied, a second
    ``LanguageModelEmbedding`` holding the word embedding only, or untied, its own weight."""
    h = m.hidden_size
    emb = padded_vocab * h // tp
    pos = m.max_position_embeddings * h if m.position_embedding_type == "learned_absolute" else 0
    final_norm = 2 * h if m.normalization == "layernorm" else h
    head = "OutputLayer" if m.untie_embeddings_and_output_weights else "LanguageModelEmbedding"
    layers = [("ParallelTransformerLayer", per_rank) for per_rank, _, _, _ in layer_counts(m, tp, ep, etp)]
    return [("LanguageModelEmbedding", emb + pos)] + layers + [("FinalNorm", final_norm), (head, emb)]


def _stage_boundaries(num_layers: int, pp: int, partition_method: str | None, layers: list) -> list[int]:
    if partition_method is None:  # num_layers / pp transformer layers each, the others at the ends
        return [0] + [1 + s * (num_layers // pp) for s in range(1, pp)] + [len(layers)]
    return partition_stages(pp, partition_method, [name for name, _ in layers], lambda: [n for _, n in layers])


def count_gpt_parameters(m: ModelConfig, padded_vocab: int, tp: int, pp: int,
                         partition_method: str | None = None, ep: int = 1, etp: int = 1
                         ) -> tuple[int, tuple[StageParams, ...]]:
    """Analytic parameter count: (unique total, per-stage count on one TP rank). With MoE layers a rank
    holds 1/``ep`` of each MoE layer's experts, each split over ``etp`` ranks (Megatron-LM's
    --expert-tensor-parallel-size); the total counts every expert once (config/moe_params.py).

    ``partition_method``: how DeepSpeed's pipeline engine splits the layers over the stages
    (--pipeline-partition-method); None: ``num_layers / pp`` transformer layers per stage (the
    interleaved schedule's, and what the default "type:ParallelTransformerLayer" gives). Other
    methods move layers between stages ("uniform" counts the embedding, final norm and output
    layer as layers too), which the stages' parameters and activations must follow."""
    n, layers = m.num_layers, _pipeline_layers(m, padded_vocab, tp, ep, etp)
    per_layer = layer_counts(m, tp, ep, etp)
    parts = _stage_boundaries(n, pp, partition_method, layers)
    tied = not m.untie_embeddings_and_output_weights
    stages = []
    for s in range(pp):
        first, stop = parts[s], parts[s + 1]
        p = sum(count for _, count in layers[first:stop])
        if tied and first == 0 and stop == len(layers):
            p -= layers[-1][1]  # the output layer borrows the embedding of its own stage: no copy
        held = (min(max(first - 1, 0), n), min(max(stop - 1, 0), n))  # transformer layers are 1..n
        stages.append(StageParams(s, held, p, sum(c[1] for c in per_layer[held[0]:held[1]])))
    emb, final_norm = layers[-1][1], layers[-2][1]
    pos = layers[0][1] - emb
    total = sum(c[2] for c in per_layer) + emb * tp + pos + final_norm + (0 if tied else emb * tp)
    return total, tuple(stages)


def gpt_active_parameters(m: ModelConfig, padded_vocab: int) -> int:
    """The parameters one token goes through: count_gpt_parameters. total with each MoE layer's experts replaced
    by the --topk it is routed to (the gate and a residual MLP included)."""
    per_layer = layer_counts(m, 1, 1)
    h = m.hidden_size
    pos = m.max_position_embeddings * h if m.position_embedding_type == "learned_absolute" else 0
    final_norm = 2 * h if m.normalization == "layernorm" else h
    emb = padded_vocab * h
    return sum(c[3] for c in per_layer) + emb + pos + final_norm + (emb if m.untie_embeddings_and_output_weights
                                                                    else 0)




def check_gpt(flags: Config, pp: int) -> None:
    """The GPT's ``ModelFamily.check``: it runs every combination config/validation.py accepts but T5's
    own: relative position biases and the relu and gated-GeLU MLPs (families/t5/t5_model.py)."""
    m = flags.model
    bad = [what for what, on in (("--position-embedding-type relative", m.position_embedding_type == "relative"),
                                 ("--relu", m.relu), ("--geglu", m.geglu)) if on]
    if bad:
        raise ConfigError(f"{' and '.join(bad)}: T5 only (pretrain_t5.py); the GPT does not have it")
