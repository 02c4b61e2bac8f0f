"""A trained decoder-only language model (a family that ``generates``: the GPT's) ready for inference:
built at any tensor parallel size from full (consolidated) weights, evaluated without dropout, with
full-vocabulary logits.

The weights come as one full fp32 state dict keyed like the single-process model of the family's
layer specs (what ``megatron_ds.checkpoint.load_consolidated`` returns, for a checkpoint saved at any
TP / PP). For TP > 1 each rank builds the same ``SequentialModel`` with its
tensor parallel group and copies in its slice of every split parameter: the slice a parameter's
``partition_dim`` / ``partition_stride`` attributes describe, the same rule the layers use to cut
their master weights (``megatron_ds.parallel.layers._master_weight_shard``). Pipeline parallelism
needs nothing at inference: the consolidated model holds every stage's layers.

Mixture of experts: the consolidated weights hold every expert by its global id, which is the
model at EP 1 (every rank holds all experts; DeepSpeed's MoE at EP 1 needs no process group). In
eval mode DeepSpeed's gate routes as it does in evaluation during training: capacity from
--moe-eval-capacity-factor when tokens are dropped, and the second expert sampled with Gumbel
noise unless the model was trained with --disable-moe-top2-2nd-expert-sampling
(deepspeed/moe/sharded_moe.py ``TopKGate.forward`` / ``top2gating``), so such a model's
generations vary from run to run, as upstream's do.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from megatron_ds.config.family import ModelFamily
from megatron_ds.config.schema import ModelConfig
from megatron_ds.model.language_model import LanguageModelEmbedding, split_moe_loss
from megatron_ds.model.pipeline_model import SequentialModel
from megatron_ds.model.transformer import ParallelTransformerLayer
from megatron_ds.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_ds.parallel.mappings import gather_from_tensor_parallel_region
from megatron_ds.parallel.utils import divide, tp_rank, tp_world_size


@dataclass
class ModelWeights:
    """What building an inference model needs; ``load_consolidated``'s result has these fields."""

    model: ModelConfig
    padded_vocab_size: int
    vocab_size: int | None
    state_dict: dict


def shard_tensor(full: torch.Tensor, partition_dim: int, stride: int, rank: int, world: int) -> torch.Tensor:
    """This rank's slice of a full weight: the dim is ``stride`` interleaved blocks (fused
    projections such as SwiGLU's [gate; up]), and every rank takes its piece of each block."""
    piece = divide(full.shape[partition_dim], world * stride)
    chunks = torch.split(full, piece, dim=partition_dim)
    return torch.cat(chunks[rank::world], dim=partition_dim)


def load_full_state_dict(module: torch.nn.Module, state_dict: dict, tp_group=None) -> None:
    """Copy full weights into ``module`` (built with ``tp_group``), slicing the split parameters."""
    own = dict(module.named_parameters())
    own.update(dict(module.named_buffers()))
    missing = sorted(set(own) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(own))
    if missing or unexpected:
        raise ValueError(f"weights do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    rank, world = tp_rank(tp_group), tp_world_size(tp_group)
    with torch.no_grad():
        for name, tensor in own.items():
            full = state_dict[name]
            if getattr(tensor, "tensor_model_parallel", False) and world > 1:
                full = shard_tensor(full, tensor.partition_dim, getattr(tensor, "partition_stride", 1), rank, world)
            if full.shape != tensor.shape:
                raise ValueError(f"{name}: weight of shape {tuple(full.shape)} for a parameter of shape "
                                 f"{tuple(tensor.shape)} (TP {world})")
            tensor.copy_(full)


class InferenceModel:
    """A ``SequentialModel`` of a decoder-only language model in eval mode, run step by step so a KV cache
    can be threaded through.

    ``logits`` returns ``[batch, seq, vocab_size]`` fp32 with the vocabulary gathered over the
    tensor parallel ranks and its padding dropped; ``token_losses`` stays vocab-parallel.
    """

    def __init__(self, module: SequentialModel, *, vocab_size: int, max_positions: int | None, tp_group=None):
        self.module = module.eval()
        self.vocab_size = vocab_size
        self.max_positions = max_positions
        self.tp_group = tp_group
        funcs = module.forward_funcs
        if not isinstance(funcs[0], LanguageModelEmbedding) or funcs[0].eod_token is not None:
            raise ValueError("inference expects a model built without reset_attention_mask")
        self._embedding = funcs[0]
        self._layers = [f for f in funcs if isinstance(f, ParallelTransformerLayer)]
        self._head = funcs[1 + len(self._layers):]  # final norm, output layer

    @property
    def device(self) -> torch.device:
        return self._embedding.word_embeddings.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self._embedding.word_embeddings.weight.dtype

    @torch.no_grad()
    def parallel_logits(self, tokens: torch.Tensor, position_ids: torch.Tensor, kv_cache=None) -> torch.Tensor:
        """``[b, s, padded_vocab / tp]`` logits of this rank's vocabulary slice."""
        hidden = self._embedding((tokens, position_ids))
        for layer in self._layers:
            hidden = layer(hidden, kv_cache=kv_cache)
        if kv_cache is not None:
            kv_cache.advance(tokens.shape[1])
        for f in self._head:
            hidden = f(hidden)
        logits, _ = split_moe_loss(hidden)  # an MoE model's output carries its auxiliary loss: not needed here
        return logits

    def logits(self, tokens: torch.Tensor, position_ids: torch.Tensor, kv_cache=None) -> torch.Tensor:
        out = self.parallel_logits(tokens, position_ids, kv_cache)
        return gather_from_tensor_parallel_region(out.float(), self.tp_group)[..., :self.vocab_size]

    @torch.no_grad()
    def token_losses(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Per-token negative log-likelihood ``[b, s]`` (fp32) of ``labels`` after ``tokens``."""
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        # The output layer sets the padded vocabulary's logits to -inf (built with vocab_size), so
        # the softmax covers the real vocabulary only, as in training and in a HF export.
        logits = self.parallel_logits(tokens, positions).float()
        return vocab_parallel_cross_entropy(logits, labels, self.tp_group)


def build_inference_model(weights: ModelWeights, *, family: ModelFamily, tp_group=None, device=None,
                          dtype: torch.dtype = torch.float32) -> InferenceModel:
    """Build ``family``'s model at this process's tensor parallel size and load ``weights`` into it
    (without FP8: a checkpoint trained with it evaluates in the weights' precision, as its export does)."""
    cfg = dataclasses.replace(weights.model, hidden_dropout=0.0, attention_dropout=0.0)
    tp = tp_world_size(tp_group)
    if weights.padded_vocab_size % tp:
        raise ValueError(f"the checkpoint's padded vocabulary ({weights.padded_vocab_size}) does not split over "
                         f"tensor parallel size {tp}")
    vocab_size = min(weights.vocab_size or weights.padded_vocab_size, weights.padded_vocab_size)
    module = SequentialModel(family.layer_specs(cfg, weights.padded_vocab_size, tp_group=tp_group,
                                                vocab_size=vocab_size), seed=0)
    load_full_state_dict(module, weights.state_dict, tp_group)
    module.to(device=device, dtype=dtype)
    max_positions = cfg.max_position_embeddings if cfg.position_embedding_type == "learned_absolute" else None
    return InferenceModel(module, vocab_size=vocab_size,
                          max_positions=max_positions, tp_group=tp_group)
