"""The GPT as DeepSpeed layer specs, and its builders: a ``PipelineModule`` (DeepSpeed's pipeline
engine), one plain module (pipeline parallel size 1, ``--no-pipeline-parallel``, inference,
references), one pipeline stage on the meta device (--dry-run) and this rank's model chunks of the
interleaved / ZB-H1 schedules (``pipeline/chunks.py``). Llama-style models and mixture of experts
are GPTs too: the flags pick RoPE, SwiGLU, RMSNorm, GQA and DeepSpeed's MoE layers.

Layers, in order: embedding, N transformer layers, final norm, output layer (``model/language_model.py``).
With tied embeddings (the GPT-2 default) the embedding and the output layer are two ``TiedLayerSpec`` s
with one key: DeepSpeed keeps a copy of the word embedding on the first and on the last stage,
broadcasts the first stage's weights to the last at start-up and all-reduces the two copies'
gradients every step.

Between stages only the hidden state ``[s, b, h]`` travels (``[s/tp, b, h]`` under sequence
parallelism): causal attention needs no mask, rotary embeddings use positions 0..s-1 and learned
positions are added on the first stage. The one exception is ``reset_attention_mask``: then the
``[b, s]`` int64 document ids travel with it as ``(hidden, document_ids)``. DeepSpeed's pipeline
engine sends non-floating tensors of an activation tuple as they are and expects no gradient for
them, so this works at any pipeline size, at a cost of 8 bytes per token instead of a [b,1,s,s] mask.
Seeding, tied copies and the stage partition are ``model/pipeline_model.py``'s, shared by every family.
"""
from __future__ import annotations

import torch
from deepspeed.pipe import LayerSpec, TiedLayerSpec

from megatron_ds.config.moe_selection import is_mlm_moe
from megatron_ds.config.moe_params import model_experts
from megatron_ds.config.schema import ModelConfig
from megatron_ds.model.language_model import (Z_LOSS_COEFF, FinalNorm, LanguageModelEmbedding, OutputLayer,
                                              language_model_loss_fn, tied_output_logits)
from megatron_ds.model.pipeline_model import (PARTITION_METHOD, TIED_EMBEDDING_KEY, PipelineModel, SequentialModel,
                                              stage_of_specs)
from megatron_ds.model.transformer import ParallelTransformerLayer
from megatron_ds.parallel.fp8 import Fp8Recipe
from megatron_ds.parallel.partition import chunk_layer_range
from megatron_ds.parallel.utils import tp_world_size
from megatron_ds.pipeline.chunks import ModelChunks

TIED_WEIGHT_ATTR = "word_embeddings.weight"
_POSITION_TYPES = ("learned_absolute", "rope", "none")


def _check(model_cfg: ModelConfig, tp: int, padded_vocab_size: int, reset_attention_mask: bool,
           eod_token: int | None, recompute_granularity: str | None) -> None:
    """Reject what the layers cannot build, with one-line messages naming the values."""
    m = model_cfg
    unresolved = [name for name in ("num_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                                    "ffn_hidden_size", "kv_channels") if getattr(m, name) is None]
    if unresolved or m.position_embedding_type not in _POSITION_TYPES or m.normalization not in ("layernorm",
                                                                                                  "rmsnorm"):
        raise ValueError(f"model config is not resolved (missing {unresolved}, position type "
                         f"{m.position_embedding_type!r}, normalization {m.normalization!r}); pass it through "
                         f"megatron_ds.config.layout.resolve_model_config first")
    if m.position_embedding_type == "learned_absolute" and m.max_position_embeddings is None:
        raise ValueError("learned absolute positions need max_position_embeddings")
    if m.num_attention_heads % m.num_key_value_heads:
        raise ValueError(f"num_attention_heads {m.num_attention_heads} is not a multiple of "
                         f"num_key_value_heads {m.num_key_value_heads}")
    if reset_attention_mask and eod_token is None:
        raise ValueError("reset_attention_mask needs the tokenizer's end-of-document id (eod_token)")
    if recompute_granularity not in (None, "full", "selective"):
        raise ValueError(f"recompute_granularity must be None, 'full' or 'selective', got {recompute_granularity!r}")


def gpt_layer_specs(model_cfg: ModelConfig, *, padded_vocab_size: int, tp_group=None,
                    sequence_parallel: bool = False, params_dtype: torch.dtype = torch.float32, device=None,
                    reset_attention_mask: bool = False, eod_token: int | None = None,
                    recompute_granularity: str | None = None, vocab_size: int | None = None,
                    sp_group=None, ep_size: int = 1, ep_rank: int = 0, loss_report=None,
                    fp8: Fp8Recipe | None = None, cp=None, expert_tp: int = 1) -> list:
    """The GPT as a list of DeepSpeed layer specs (see the module docstring).

    ``model_cfg`` must be resolved (``resolve_model_config``). ``recompute_granularity="selective"``
    builds layers that recompute their attention core; ``"full"`` is a matter of the builder's
    ``activation_checkpoint_interval`` and changes nothing here. ``vocab_size`` (the real
    vocabulary, <= padded) makes the output layer mask the padding columns (``model/language_model.py``).
    ``sp_group``: DeepSpeed-Ulysses' sequence parallel group (the embedding and attention's; plain
    module only, ``build_sequential_gpt``). Mixture of experts (``model/moe_layer.py``): the layers
    ``experts_per_layer`` names hold this rank's share of their experts (``ep_size``, ``ep_rank``:
    ``ParallelState.expert_parallel_rank``; ``expert_tp``: the ranks Megatron-LM's experts split over, ETP);
    ``loss_report`` gets their dropped-route fractions.
    ``fp8``: the run's FP8 recipe (``Layout.fp8``), which the transformer layers' GEMMs run with.
    ``cp``: context parallelism (``parallel.context_parallel.ContextParallel``): the embedding keeps this
    rank's chunks of every sequence and attention runs over the CP ranks.
    """
    m = model_cfg
    _check(m, tp_world_size(tp_group), padded_vocab_size, reset_attention_mask, eod_token, recompute_granularity)
    common = dict(tp_group=tp_group, sequence_parallel=sequence_parallel, params_dtype=params_dtype, device=device)
    embedding = dict(init_method_std=m.init_method_std, dropout=m.hidden_dropout,
                     fp32_residual=m.fp32_residual_connection, sp_group=sp_group, cp=cp,
                     async_grad_comm=m.async_tensor_model_parallel_allreduce, **common)
    fused_loss = m.liger_kernel  # liger's fused linear + cross entropy where it applies (model/liger.py)
    positions = m.max_position_embeddings if m.position_embedding_type == "learned_absolute" else None
    eod = eod_token if reset_attention_mask else None
    if vocab_size is not None and not 0 < vocab_size <= padded_vocab_size:
        raise ValueError(f"vocab_size {vocab_size} must be in (0, padded_vocab_size {padded_vocab_size}]")
    tied = not m.untie_embeddings_and_output_weights

    experts = model_experts(m)  # DeepSpeed-MoE's or Megatron-LM's placement (config/moe_selection.py)
    moe = any(n > 1 for n in experts)
    if moe and tp_world_size(sp_group) > 1:
        raise ValueError("MoE layers do not combine with DeepSpeed-Ulysses sequence parallelism here")
    specs = []
    if tied:
        specs.append(TiedLayerSpec(TIED_EMBEDDING_KEY, LanguageModelEmbedding, m.hidden_size, padded_vocab_size,
                                   max_position_embeddings=positions, eod_token=eod,
                                   tied_weight_attr=TIED_WEIGHT_ATTR, vocab_size=vocab_size, fused_loss=fused_loss,
                                   **embedding))
    else:
        specs.append(LayerSpec(LanguageModelEmbedding, m.hidden_size, padded_vocab_size,
                               max_position_embeddings=positions,
                               eod_token=eod, **embedding))
    for i in range(m.num_layers):
        specs.append(LayerSpec(ParallelTransformerLayer, m, i + 1,
                               recompute_attention=recompute_granularity == "selective", sp_group=sp_group,
                               num_experts=experts[i], ep_size=ep_size, ep_rank=ep_rank, carry_moe_loss=moe,
                               loss_report=loss_report, fp8=fp8, cp=cp, expert_tp=expert_tp, **common))
    specs.append(LayerSpec(FinalNorm, m.normalization, m.hidden_size, m.layernorm_epsilon,
                           sequence_parallel=sequence_parallel, params_dtype=params_dtype, device=device,
                           one_plus=m.apply_layernorm_1p, fp32_input=m.fp32_residual_connection))
    if tied:
        # Built only on a last stage that does not also hold the embedding; that copy needs no
        # position table (its weights come from the first stage's broadcast anyway).
        specs.append(TiedLayerSpec(TIED_EMBEDDING_KEY, LanguageModelEmbedding, m.hidden_size, padded_vocab_size,
                                   max_position_embeddings=None, forward_fn=tied_output_logits,
                                   tied_weight_attr=TIED_WEIGHT_ATTR, vocab_size=vocab_size, fused_loss=fused_loss,
                                   **embedding))
    else:
        specs.append(LayerSpec(OutputLayer, m.hidden_size, padded_vocab_size, init_method_std=m.init_method_std,
                               vocab_size=vocab_size, fused_loss=fused_loss,
                               async_grad_comm=m.async_tensor_model_parallel_allreduce, **common))
    return specs




def gpt_loss(model_cfg: ModelConfig, tp_group, sp_group=None, loss_report=None, cp=None):
    """The GPT's loss function: the language-model loss (with --use-z-loss's z-loss), plus the MoE layers'
    weighted auxiliary loss."""
    # Megatron-LM's MoE layers return their losses already weighted by their own coefficients
    coeff = 1.0 if is_mlm_moe(model_cfg) else model_cfg.moe_loss_coeff
    return language_model_loss_fn(tp_group, sp_group, loss_report, coeff,
                                  Z_LOSS_COEFF if model_cfg.use_z_loss else 0.0, cp)


def build_pipeline_gpt(model_cfg: ModelConfig, topology, *, padded_vocab_size: int, tp_group, seed: int,
                       activation_checkpoint_interval: int = 0, partition_method: str = PARTITION_METHOD,
                       loss_report=None, **spec_kwargs) -> PipelineModel:
    """The GPT as a DeepSpeed ``PipelineModule``. ``topology`` must be the same
    ``PipeModelDataParallelTopology`` the process groups (``tp_group``) were built from.
    ``spec_kwargs`` go to ``gpt_layer_specs`` (sequence_parallel, params_dtype, device,
    reset_attention_mask, eod_token, recompute_granularity, fp8). ``loss_report``: the
    ``megatron_ds.model.loss_report.LossReport`` the loss function reports to (None: none)."""
    specs = gpt_layer_specs(model_cfg, padded_vocab_size=padded_vocab_size, tp_group=tp_group,
                            loss_report=loss_report, **spec_kwargs)
    return PipelineModel(specs, topology=topology, seed=seed, partition_method=partition_method,
                         activation_checkpoint_interval=activation_checkpoint_interval,
                         loss_fn=gpt_loss(model_cfg, tp_group, loss_report=loss_report, cp=spec_kwargs.get("cp")))


def build_stage_gpt(model_cfg: ModelConfig, *, num_stages: int, stage: int, padded_vocab_size: int, tp_group=None,
                    seed: int, partition_method: str = PARTITION_METHOD, activation_checkpoint_interval: int = 0,
                    **spec_kwargs) -> SequentialModel:
    """The modules pipeline stage ``stage`` of ``build_pipeline_gpt``'s model holds, as one module on
    any device (``model/pipeline_model.py`` ``stage_of_specs``)."""
    specs = gpt_layer_specs(model_cfg, padded_vocab_size=padded_vocab_size, tp_group=tp_group, **spec_kwargs)
    return stage_of_specs(specs, num_stages=num_stages, stage=stage, seed=seed, partition_method=partition_method,
                          activation_checkpoint_interval=activation_checkpoint_interval,
                          loss_fn=gpt_loss(model_cfg, tp_group))


def build_sequential_gpt(model_cfg: ModelConfig, *, padded_vocab_size: int, tp_group=None, seed: int,
                         activation_checkpoint_interval: int = 0, sp_group=None, loss_report=None,
                         **spec_kwargs) -> SequentialModel:
    """The GPT as one plain module (PP = 1, ``--no-pipeline-parallel``, references); same weights
    as ``build_pipeline_gpt`` with the same seed (at any DeepSpeed-Ulysses ``sp_group``).
    ``spec_kwargs`` and ``loss_report`` as for ``build_pipeline_gpt``."""
    specs = gpt_layer_specs(model_cfg, padded_vocab_size=padded_vocab_size, tp_group=tp_group, sp_group=sp_group,
                            loss_report=loss_report, **spec_kwargs)
    return SequentialModel(specs, seed=seed, activation_checkpoint_interval=activation_checkpoint_interval,
                           loss_fn=gpt_loss(model_cfg, tp_group, sp_group, loss_report, spec_kwargs.get("cp")))


def chunk_spec_indices(num_layers: int, pp: int, v: int, rank: int, chunk: int, counts=None) -> list[int]:
    """Global spec indices (0 = embedding, 1..N = transformer layers, N+1 = final norm, N+2 =
    output layer) held by ``chunk`` of pipeline ``rank`` (Megatron's assignment of the layers to the
    virtual stages, equal or of ``counts`` layers each: ``megatron_ds.parallel.partition.chunk_layer_range``)."""
    layers = chunk_layer_range(num_layers, pp, v, rank, chunk, counts)
    indices = [i + 1 for i in layers]
    if chunk == 0 and rank == 0:
        indices.insert(0, 0)
    if chunk == v - 1 and rank == pp - 1:
        indices += [num_layers + 1, num_layers + 2]
    return indices


def build_interleaved_gpt(model_cfg: ModelConfig, *, pp: int, pp_rank: int, v: int, padded_vocab_size: int,
                          tp_group, seed: int, tie_group=None, activation_checkpoint_interval: int = 0,
                          loss_report=None, chunk_layers=None, **spec_kwargs) -> ModelChunks:
    """This rank's ``v`` chunks of the GPT for the interleaved and ZB-H1 schedules (``spec_kwargs`` as for
    ``build_pipeline_gpt``); ``tie_group`` from ``megatron_ds.pipeline.p2p.tied_embedding_group`` (None:
    no copies to synchronize, e.g. on the meta device); ``chunk_layers``: the layout's transformer layers
    per virtual stage where they are uneven."""
    specs = gpt_layer_specs(model_cfg, padded_vocab_size=padded_vocab_size, tp_group=tp_group,
                            loss_report=loss_report, **spec_kwargs)
    indices = [chunk_spec_indices(model_cfg.num_layers, pp, v, pp_rank, c, chunk_layers) for c in range(v)]
    return ModelChunks(specs, layer_indices=indices, pp=pp, pp_rank=pp_rank, seed=seed, tie_group=tie_group,
                       loss_fn=gpt_loss(model_cfg, tp_group, loss_report=loss_report, cp=spec_kwargs.get("cp")),
                       activation_checkpoint_interval=activation_checkpoint_interval)
