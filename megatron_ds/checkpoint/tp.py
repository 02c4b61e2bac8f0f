"""How each parameter is split over tensor parallel ranks, and merging / splitting shards.

The rules mirror the layers (``megatron_ds.parallel.layers`` and ``model/``): a
``ColumnParallelLinear`` splits its weight (and bias) along dim 0, a ``RowParallelLinear`` its
weight along dim 1 (its bias is replicated), a ``VocabParallelEmbedding`` along the vocabulary
(dim 0); norms and learned positions are replicated. Two layouts make this exact at any TP size:

- the fused QKV projection is laid out per key/value group (``heads_per_group`` query heads, the
  group's key head, its value head) and each rank holds a contiguous block of groups, so the ranks'
  shards concatenated along dim 0 are the full matrix;
- the SwiGLU ``dense_h_to_4h`` fuses ``[gate; up]`` and is split with stride 2 (rank r holds
  ``[gate_r; up_r]``), so the full matrix is ``[gate_0 .. gate_{t-1}; up_0 .. up_{t-1}]``.

Names are matched by their last two components, which the layers fix (``query_key_value.weight``
...); a parameter matching no rule must be replicated, which ``merge`` checks. The rules below are
those of the layers every family shares (``model/``); a family's own layers add theirs
(``ModelFamily.tp_split``, ``vocab_parameters``: BERT's MLM bias, T5's cross-attention and relative
position biases).

Mixture of experts (Megatron-DeepSpeed ``megatron/model/transformer.py``, ``ParallelMLP(moe=True,
enable_expert_tensor_parallelism=...)``): an expert's MLP is split like the dense MLP only with
--enable-expert-tensor-parallelism; otherwise every tensor parallel rank holds whole experts. The
gate (``deepspeed_moe.gate.wg``) and PR-MoE's ``coefficient`` are replicated; PR-MoE's residual MLP
(``mlp.mlp.*``) is a dense MLP.
"""
from __future__ import annotations

import torch

from megatron_ds.checkpoint import stacked_experts
from megatron_ds.checkpoint.expert_files import EXPERTS_INFIX
from megatron_ds.config.family import ModelFamily
from megatron_ds.config.schema import ModelConfig

# (module name, parameter name) -> partition dim; stride below
_SPLIT_DIM = {
    ("word_embeddings", "weight"): 0,
    ("output_layer", "weight"): 0,
    ("query_key_value", "weight"): 0,
    ("query_key_value", "bias"): 0,
    ("dense", "weight"): 1,  # attention output projection (row parallel)
    ("dense_h_to_4h", "weight"): 0,
    ("dense_h_to_4h", "bias"): 0,
    ("dense_4h_to_h", "weight"): 1,
    # multi-latent attention (model/mla.py): the up projections split over heads; the down projections and
    # the latents' norms are replicated
    ("linear_q_proj", "weight"): 0,
    ("linear_q_up_proj", "weight"): 0,
    ("linear_kv_up_proj", "weight"): 0,
}
# --qk-layernorm's norm weights: of head size and replicated, or of the projection's size and split like it
_PROJECTION_NORMS = (("q_layernorm", "weight"), ("k_layernorm", "weight"))
VOCAB_PARAMS = (("word_embeddings", "weight"), ("output_layer", "weight"))


def _key(name: str) -> tuple[str, str]:
    parts = name.split(".")
    return (parts[-2], parts[-1]) if len(parts) >= 2 else ("", parts[-1])


def partition(name: str, model: ModelConfig, family: ModelFamily) -> tuple[int, int] | None:
    """(dim, stride) of a tensor parallel parameter of ``family``'s model, None for a replicated one."""
    key = _key(name)
    dim = _SPLIT_DIM.get(key, family.tp_split.get(key))
    if key in _PROJECTION_NORMS and model.qk_layernorm_scope == "projection" and not model.multi_latent_attention:
        dim = 0  # --qk-layernorm-scope projection: split with the heads (model/norms.py ProjectionRMSNorm)
    if dim is None:
        return None
    if EXPERTS_INFIX in name and not model.enable_expert_tensor_parallelism:
        return None
    stride = 2 if key[0] == "dense_h_to_4h" and (model.swiglu or model.geglu) else 1
    return dim, stride


def is_vocab_param(name: str, family: ModelFamily) -> bool:
    """Whether the parameter has a row per vocabulary entry (padded rows included)."""
    return _key(name) in VOCAB_PARAMS or _key(name) in family.vocab_parameters


def merge(name: str, shards: list[torch.Tensor], model: ModelConfig, family: ModelFamily) -> torch.Tensor:
    """The full tensor from the tensor parallel ranks' shards (in rank order)."""
    rule = partition(name, model, family)
    if stacked_experts.is_stacked(name) and len(shards) > 1:  # Megatron-LM's experts: split over ETP or whole
        split = stacked_experts.etp_split(name, shards[0].shape, model)
        rule, shards = (None, shards) if split is None else (split[:2], shards[:split[2]])
    if rule is None or len(shards) == 1:
        return shards[0]
    dim, stride = rule
    if stride == 1:
        return torch.cat(shards, dim=dim)
    pieces = [s.chunk(stride, dim=dim) for s in shards]
    return torch.cat([pieces[r][j] for j in range(stride) for r in range(len(shards))], dim=dim)


def split(name: str, full: torch.Tensor, tp: int, rank: int, model: ModelConfig,
          family: ModelFamily) -> torch.Tensor:
    """Tensor parallel rank ``rank``'s shard of ``full`` at TP size ``tp`` (a view where possible)."""
    rule = partition(name, model, family)
    if rule is None or tp == 1:
        return full
    dim, stride = rule
    if full.shape[dim] % (tp * stride):
        raise ValueError(f"{name}: dim {dim} of size {full.shape[dim]} does not split over TP {tp}"
                         f"{' x stride ' + str(stride) if stride > 1 else ''}")
    blocks = full.chunk(tp * stride, dim=dim)
    return torch.cat(blocks[rank::tp], dim=dim) if stride > 1 else blocks[rank]


def resize_vocab(name: str, full: torch.Tensor, padded_vocab_size: int, family: ModelFamily) -> torch.Tensor:
    """A vocabulary parameter with ``padded_vocab_size`` rows: padding rows cut off or added as
    zeros. Padding rows are never read by the model (no token id reaches them, their logits are
    masked), so their values carry nothing."""
    if not is_vocab_param(name, family) or full.shape[0] == padded_vocab_size:
        return full
    if full.shape[0] > padded_vocab_size:
        return full[:padded_vocab_size]
    pad = full.new_zeros((padded_vocab_size - full.shape[0], *full.shape[1:]))
    return torch.cat([full, pad], dim=0)
