"""BERT as pipeline layer specs: Megatron-DeepSpeed's ``BertModel`` (megatron/model/bert_model.py,
language_model.py) from the same tensor parallel layers as the GPT.

    (tokens, types, padding_mask) --BertEmbedding--> (hidden [s, b, h], padding_mask)
    --ParallelTransformerLayer x N (bidirectional, padding-masked)--> --FinalNorm--> hidden
    --BertHeads--> (lm hidden, binary logits [b, 2]) --tied word embedding--> --BertLMBias-->
    (lm logits [b, s, V/tp], binary logits)

As upstream: learned positions 0..s-1 (``bert_position_ids``), token-type embeddings when the
binary head is on (pretrain_bert.py's ``num_tokentypes = 2 if args.bert_binary_head else 0``),
pre-LN layers with a final norm (``ParallelTransformer``), the MLM head ``BertLMHead`` (a replicated
dense h->h, GeLU, LayerNorm, the projection by the word embedding and a vocab-parallel bias), and
the pooler (dense + tanh of position 0, language_model.py ``Pooler``) feeding the binary head
(``get_linear_layer(h, 2)``). Replicated linears are initialized as ``get_linear_layer``: weights
normal(init_method_std), biases zero. The loss is pretrain_bert.py's ``loss_func``: the masked-LM
cross entropy averaged over ``loss_mask`` plus the sentence-order cross entropy (ignore index -1).

Under sequence parallelism the head gathers the sequence first; everything after the final norm is
replicated over the tensor parallel ranks (only the vocabulary projection and bias are split), so
its parameters' gradients are complete on every rank.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, TiedLayerSpec
from torch import nn

from megatron_ds.config.schema import ModelConfig
from megatron_ds.model.language_model import FinalNorm, LanguageModelEmbedding, language_model_loss
from megatron_ds.model.pipeline_model import (PARTITION_METHOD, TIED_EMBEDDING_KEY, PipelineModel, SequentialModel,
                                              stage_of_specs)
from megatron_ds.model.activations import openai_gelu
from megatron_ds.model.transformer import ParallelTransformerLayer, hidden_dropout
from megatron_ds.parallel.fp8 import Fp8Recipe
from megatron_ds.parallel.layers import ColumnParallelLinear, init_method_normal
from megatron_ds.parallel.mappings import gather_from_sequence_parallel_region, scatter_to_sequence_parallel_region
from megatron_ds.parallel.utils import divide, tp_world_size

NUM_TOKENTYPES = 2  # with the binary head (sentence A / sentence B)
LOSS_NAMES = ("lm loss", "sop loss")  # what bert_loss_fn reports (pretrain_bert.py's loss_func names)


class BertEmbedding(LanguageModelEmbedding):
    """Word (vocab-parallel) + position + token-type embeddings, dropout; ``[s, b, h]`` out with the
    padding mask (``model/transformer.py``). The tied copy on the last stage projects with
    ``logits`` like the GPT's (no position or token-type table there)."""

    def __init__(self, hidden_size: int, padded_vocab_size: int, *, num_tokentypes: int, params_dtype=torch.float32,
                 device=None, tp_group=None, **kwargs):
        super().__init__(hidden_size, padded_vocab_size, params_dtype=params_dtype, device=device,
                         tp_group=tp_group, fused_loss=False, **kwargs)
        self.tokentype_embeddings = None
        if num_tokentypes:
            # fp32 on the CPU generator, then moved, as the position table (LanguageModelEmbedding)
            table = torch.empty(num_tokentypes, hidden_size, dtype=torch.float32)
            init_method_normal(kwargs["init_method_std"])(table)
            self.tokentype_embeddings = nn.Embedding.from_pretrained(table.to(device=device, dtype=params_dtype),
                                                                     freeze=False)
        # The MLM head hands the projection the whole (gathered) sequence: never sequence-sharded.
        self._output_projection = ColumnParallelLinear(
            hidden_size, padded_vocab_size, tp_group=tp_group, bias=False, gather_output=False,
            sequence_parallel=False, skip_weight_param_allocation=True,
            async_grad_comm=kwargs.get("async_grad_comm", False))

    def forward(self, inputs):
        tokens, types, padding_mask = inputs
        x = self.word_embeddings(tokens)
        if self.position_embeddings is not None:
            x = x + self.position_embeddings(torch.arange(tokens.shape[1], device=tokens.device))[None]
        if self.tokentype_embeddings is not None:
            x = x + self.tokentype_embeddings(types)
        x = x.transpose(0, 1).contiguous()  # [b, s, h] -> [s, b, h]
        if self.fp32_residual:
            x = x.float()
        if self.sequence_parallel:
            x = scatter_to_sequence_parallel_region(x, self.tp_group)
        x = hidden_dropout(x, self.dropout, self.training, self.sequence_parallel)
        return x, padding_mask.long()  # integer: DeepSpeed sends it between stages without a gradient


def linear_layer(in_features: int, out_features: int, std: float, params_dtype, device) -> nn.Linear:
    """Megatron's ``get_linear_layer``: normal(std) weight drawn in fp32 on the CPU, zero bias."""
    weight = torch.empty(out_features, in_features, dtype=torch.float32)
    init_method_normal(std)(weight)
    layer = nn.Linear(in_features, out_features, device=device, dtype=params_dtype)
    with torch.no_grad():
        layer.weight.copy_(weight.to(device=device, dtype=params_dtype))
        layer.bias.zero_()
    return layer


class BertHeads(nn.Module):
    """The MLM head's transform (dense, GeLU, LayerNorm) and, with the binary head, pooler + binary
    head: ``[s, b, h]`` -> ``(lm hidden [s, b, h], binary logits [b, 2])`` (or the lm hidden alone)."""

    def __init__(self, hidden_size: int, *, init_method_std: float, layernorm_epsilon: float, binary_head: bool,
                 openai: bool = False, tp_group=None, sequence_parallel: bool = False,
                 params_dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.activation = openai_gelu if openai else F.gelu  # BertLMHead: --openai-gelu, else erf GeLU
        # not "dense"/"layernorm": checkpoint/tp.py reads a ".dense.weight" as row parallel
        self.lm_dense = linear_layer(hidden_size, hidden_size, init_method_std, params_dtype, device)
        self.lm_layernorm = nn.LayerNorm(hidden_size, eps=layernorm_epsilon, device=device, dtype=params_dtype)
        self.pooler = self.binary_head = None
        if binary_head:
            self.pooler = linear_layer(hidden_size, hidden_size, init_method_std, params_dtype, device)
            self.binary_head = linear_layer(hidden_size, 2, init_method_std, params_dtype, device)

    def forward(self, hidden: torch.Tensor):
        if self.sequence_parallel:  # replicated from here on: backward only splits the gradient
            hidden = gather_from_sequence_parallel_region(hidden, self.tp_group, tensor_parallel_output_grad=False)
        lm = self.lm_layernorm(self.activation(self.lm_dense(hidden)))
        if self.binary_head is None:
            return lm
        pooled = torch.tanh(self.pooler(hidden[0]))  # Pooler: position 0 ([CLS])
        return lm, self.binary_head(pooled)


def bert_tied_logits(embedding: BertEmbedding, inputs):
    """``TiedLayerSpec`` forward_fn: the MLM hidden state projected by the word embedding
    (``[b, s, V/tp]``, padding columns -inf); the binary logits pass through."""
    if isinstance(inputs, (tuple, list)):
        lm, binary = inputs
        return embedding.logits(lm), binary
    return embedding.logits(inputs)


class BertLMBias(nn.Module):
    """``BertLMHead.bias``: one per vocabulary entry, split over the tensor parallel ranks, zero-initialized.
    Named ``lm_head.bias``, the name checkpoint/tp.py splits over the vocabulary."""

    def __init__(self, padded_vocab_size: int, *, tp_group=None, params_dtype: torch.dtype = torch.float32,
                 device=None):
        super().__init__()
        self.lm_head = nn.ParameterDict({"bias": nn.Parameter(torch.zeros(
            divide(padded_vocab_size, tp_world_size(tp_group)), device=device, dtype=params_dtype))})

    def forward(self, inputs):
        bias = self.lm_head["bias"]
        if isinstance(inputs, (tuple, list)):
            logits, binary = inputs
            return logits + bias, binary
        return inputs + bias


def bert_loss_fn(output, labels, *, tp_group=None, vocab_size: int | None = None, report=None) -> torch.Tensor:
    """pretrain_bert.py ``loss_func``: masked-LM loss (vocab-parallel cross entropy in fp32, averaged
    over ``loss_mask``) + sentence-order loss (cross entropy of the binary logits, ignore index -1).

    ``output``: lm logits ``[b, s, V/tp]``, or ``(lm logits, binary logits [b, 2])``; ``labels``:
    ``(lm labels [b, s] (-1 where not predicted), loss_mask [b, s], sentence order [b])``.
    ``report`` (the run's ``model.loss_report.LossReport``, declaring ``LOSS_NAMES``) gets both terms."""
    lm_labels, loss_mask, sentence_order = labels
    logits, binary = output if isinstance(output, (tuple, list)) else (output, None)
    # -1 marks unpredicted positions; any id works there, as the mask drops them
    targets = torch.where(loss_mask > 0, lm_labels, torch.zeros_like(lm_labels))
    lm_loss = language_model_loss(logits, (targets, loss_mask), tp_group=tp_group, vocab_size=vocab_size)
    if report is not None:
        report.add("lm loss", lm_loss)
    if binary is None:
        return lm_loss
    sop_loss = F.cross_entropy(binary.view(-1, 2).float(), sentence_order.view(-1), ignore_index=-1)
    if report is not None:
        report.add("sop loss", sop_loss)
    return lm_loss + sop_loss


def _check(m: ModelConfig) -> None:
    if m.position_embedding_type != "learned_absolute" or m.normalization != "layernorm" or m.swiglu:
        raise ValueError("BERT is built with learned absolute positions, LayerNorm and a GeLU MLP, as Megatron's "
                         f"(got positions {m.position_embedding_type!r}, {m.normalization!r}, swiglu {m.swiglu})")
    if m.untie_embeddings_and_output_weights:
        raise ValueError("BERT's MLM head is tied to the word embedding (Megatron's BertModel); drop "
                         "--untie-embeddings-and-output-weights")


def bert_layer_specs(model_cfg: ModelConfig, *, padded_vocab_size: int, tp_group=None,
                     sequence_parallel: bool = False, params_dtype: torch.dtype = torch.float32, device=None,
                     recompute_granularity: str | None = None, vocab_size: int | None = None,
                     fp8: Fp8Recipe | None = None) -> list:
    """The BERT as DeepSpeed layer specs (module docstring); ``model_cfg`` resolved, its
    ``bert_binary_head`` choosing the binary head (and the token types); ``fp8``: the run's FP8 recipe
    (``Layout.fp8``), which the transformer layers' GEMMs run with."""
    m = model_cfg
    _check(m)
    common = dict(tp_group=tp_group, sequence_parallel=sequence_parallel, params_dtype=params_dtype, device=device)
    embedding = dict(init_method_std=m.init_method_std, dropout=m.hidden_dropout, vocab_size=vocab_size,
                     fp32_residual=m.fp32_residual_connection, async_grad_comm=m.async_tensor_model_parallel_allreduce,
                     **common)
    specs = [TiedLayerSpec(TIED_EMBEDDING_KEY, BertEmbedding, m.hidden_size, padded_vocab_size,
                           max_position_embeddings=m.max_position_embeddings,
                           num_tokentypes=NUM_TOKENTYPES if m.bert_binary_head else 0,
                           tied_weight_attr="word_embeddings.weight", **embedding)]
    for i in range(m.num_layers):
        specs.append(LayerSpec(ParallelTransformerLayer, m, i + 1, self_attn_mask_type="padding",
                               recompute_attention=recompute_granularity == "selective", fp8=fp8, **common))
    specs.append(LayerSpec(FinalNorm, m.normalization, m.hidden_size, m.layernorm_epsilon,
                           sequence_parallel=sequence_parallel, params_dtype=params_dtype, device=device,
                           one_plus=m.apply_layernorm_1p, fp32_input=m.fp32_residual_connection))
    specs.append(LayerSpec(BertHeads, m.hidden_size, init_method_std=m.init_method_std,
                           layernorm_epsilon=m.layernorm_epsilon, binary_head=m.bert_binary_head,
                           openai=m.openai_gelu, **common))
    specs.append(TiedLayerSpec(TIED_EMBEDDING_KEY, BertEmbedding, m.hidden_size, padded_vocab_size,
                               max_position_embeddings=None, num_tokentypes=0, forward_fn=bert_tied_logits,
                               tied_weight_attr="word_embeddings.weight", **embedding))
    specs.append(LayerSpec(BertLMBias, padded_vocab_size, tp_group=tp_group, params_dtype=params_dtype,
                           device=device))
    return specs


def bert_loss(tp_group, vocab_size: int | None, report=None):
    return functools.update_wrapper(functools.partial(bert_loss_fn, tp_group=tp_group, vocab_size=vocab_size,
                                                      report=report), bert_loss_fn)


def _specs(model_cfg, padded_vocab_size, tp_group, spec_kwargs):
    # the GPT builders' arguments that BERT has no use for (engine.model_kwargs gives them to every family)
    for unused in ("reset_attention_mask", "eod_token", "ep_size", "ep_rank"):  # (no MoE: families/bert/bert_params.py)
        spec_kwargs.pop(unused, None)
    return bert_layer_specs(model_cfg, padded_vocab_size=padded_vocab_size, tp_group=tp_group, **spec_kwargs)


def build_pipeline_bert(model_cfg: ModelConfig, topology, *, padded_vocab_size: int, tp_group, seed: int,
                        activation_checkpoint_interval: int = 0, partition_method: str = PARTITION_METHOD,
                        loss_report=None, **spec_kwargs) -> PipelineModel:
    """BERT as a DeepSpeed ``PipelineModule`` (seeded per layer as every family: ``model/pipeline_model.py``)."""
    specs = _specs(model_cfg, padded_vocab_size, tp_group, spec_kwargs)
    return PipelineModel(specs, topology=topology, seed=seed, partition_method=partition_method,
                         activation_checkpoint_interval=activation_checkpoint_interval,
                         loss_fn=bert_loss(tp_group, spec_kwargs.get("vocab_size"), loss_report))


def build_sequential_bert(model_cfg: ModelConfig, *, padded_vocab_size: int, tp_group=None, seed: int,
                          activation_checkpoint_interval: int = 0, loss_report=None, **spec_kwargs) -> SequentialModel:
    """BERT as one plain module (PP 1, --no-pipeline-parallel, references); the same weights as
    ``build_pipeline_bert`` with the same seed, under the same parameter names."""
    specs = _specs(model_cfg, padded_vocab_size, tp_group, spec_kwargs)
    return SequentialModel(specs, seed=seed, activation_checkpoint_interval=activation_checkpoint_interval,
                           loss_fn=bert_loss(tp_group, spec_kwargs.get("vocab_size"), loss_report))


def build_stage_bert(model_cfg: ModelConfig, *, num_stages: int, stage: int, padded_vocab_size: int, tp_group=None,
                     seed: int, partition_method: str = PARTITION_METHOD, activation_checkpoint_interval: int = 0,
                     loss_report=None, **spec_kwargs) -> SequentialModel:
    """What stage ``stage`` of ``build_pipeline_bert``'s model holds, without a topology (--dry-run's meta build)."""
    specs = _specs(model_cfg, padded_vocab_size, tp_group, spec_kwargs)
    return stage_of_specs(specs, num_stages=num_stages, stage=stage, seed=seed,
                          partition_method=partition_method,
                          activation_checkpoint_interval=activation_checkpoint_interval,
                          loss_fn=bert_loss(tp_group, spec_kwargs.get("vocab_size"), loss_report))
