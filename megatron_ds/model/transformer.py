"""Pre-LN transformer layer with tensor parallel attention and MLP.

Activations are ``[seq, batch, hidden]`` (Megatron's layout); under sequence parallelism the
sequence dimension is split over the tensor parallel ranks outside attention/MLP, i.e. in the norm,
dropout and residual regions.

A layer's input and output are the hidden state, or ``(hidden, document_ids)`` when attention is
restricted to each document (``--reset-attention-mask``): the ``[batch, seq]`` document ids are all
a layer needs to rebuild the mask, so they, not a ``[batch, 1, seq, seq]`` mask, are what travels
with the hidden state between pipeline stages.

Bidirectional layers (``self_attn_mask_type="padding"``: BERT, T5's encoder) take the hidden state
or ``(hidden, padding_mask)`` the same way: the ``[batch, seq]`` integer mask is 1 at real tokens
and 0 at padding (Megatron's ``padding_mask`` of a BERT sample), and no position attends to padding
(``padding_attention_mask``). Integer tensors in DeepSpeed's activation tuple are sent between
stages as they are and get no gradient, as the document ids do.

In a mixture-of-experts model (``model/moe_layer.py``) every layer also carries the sum of the MoE layers'
auxiliary losses so far, a ``[1]`` fp32 tensor, last in the tuple: ``(hidden[, document_ids],
moe_loss)``, as Megatron-DeepSpeed's ParallelTransformerLayerPipe carries its "aggregated_moe_loss".
It reaches the loss function through the final norm and the output layer, so it is part of the
graph backward runs on -- across pipeline stages too (DeepSpeed's pipeline engine sends a tuple's
floating tensors and their gradients back) -- and activation recompute, which reruns a layer's
forward inside backward, cannot count it twice.

Parameter names follow Megatron-LM's GPT (``input_layernorm``, ``self_attention.query_key_value``,
``self_attention.dense``, ``post_attention_layernorm``, ``mlp.dense_h_to_4h``,
``mlp.dense_4h_to_h``) so familiar conversion tools and habits carry over.
"""
from __future__ import annotations

import contextlib
import random

import torch
import torch.nn.functional as F
from deepspeed.sequence.layer import DistributedAttention
from torch import nn

from megatron_ds import ds_compat
from megatron_ds.config.moe_selection import is_mlm_moe
from megatron_ds.config.schema import ModelConfig
from megatron_ds.model.fusions import bias_dropout_add, bias_gelu, bias_swiglu, rope_qkv, split_qkv, use_compiled
from megatron_ds.model.kernels import context_parallel_attention, sdpa_supports_gqa, sdpa_with_dropout
from megatron_ds.model.mla import MLASelfAttention
from megatron_ds.model.activations import mlp_activation
from megatron_ds.model.mlm_moe import build_mlm_moe, report_routing
from megatron_ds.model.moe_layer import DROP_FRACTION, DropCounter, build_moe
from megatron_ds.model.norms import ProjectionRMSNorm, build_norm
from megatron_ds.model.param_groups import DECAY
from megatron_ds.model.rotary import (apply_rotary, rope_scaling, rotary_cos_sin, rotary_cos_sin_of_cp_rank,
                                      rotary_dim)
from megatron_ds.parallel.fp8 import Fp8Recipe
from megatron_ds.parallel.layers import (ColumnParallelLinear, RowParallelLinear, init_method_normal,
                                         scaled_init_method_normal)
from megatron_ds.parallel.random import checkpoint, get_rng_tracker
from megatron_ds.parallel.utils import divide, tp_rank, tp_world_size


def document_causal_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """``[batch, seq]`` document ids -> ``[batch, 1, seq, seq]`` bool mask, True where a query may
    attend to a key: the key is not in the future and belongs to the same document."""
    seq = document_ids.shape[1]
    same_document = document_ids[:, None, :, None] == document_ids[:, None, None, :]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=document_ids.device).tril()
    return same_document & causal


def padding_attention_mask(padding_mask: torch.Tensor) -> torch.Tensor:
    """``[batch, seq]`` padding mask (1 real, 0 padding) -> ``[batch, 1, 1, seq]`` bool, True where a
    query may attend to a key: the key is a real token.

    Megatron's BERT (``bert_extended_attention_mask``, megatron/model/bert_model.py in
    Megatron-DeepSpeed) masks a query-key pair when either is padding. For a real query that is the
    same row as here. A padding query's row is all masked there, and its softmax over the equal
    -10000 fills attends uniformly to every position; here it attends to the real keys, which keeps
    SDPA free of all-masked rows (NaN). Padding positions never reach a real one (no real query sees
    a padding key) nor the loss (their loss mask is 0, the pooler reads position 0), so losses and
    every real position's output are Megatron's. It is also Hugging Face BERT's mask (keys only)."""
    return padding_mask.bool()[:, None, None, :]


def split_activation(inputs):
    """A layer's input (see the module docstring) -> ``(hidden, document_ids, moe_loss)``, None for
    what it does not carry (the ids are the integer tensor, the loss the floating one after hidden)."""
    if not isinstance(inputs, (tuple, list)):
        return inputs, None, None
    hidden, *rest = inputs
    document_ids = next((t for t in rest if not t.is_floating_point()), None)
    moe_loss = next((t for t in rest if t.is_floating_point()), None)
    return hidden, document_ids, moe_loss


def pack_activation(hidden, document_ids=None, moe_loss=None):
    """``split_activation``'s inverse: the hidden state alone when it carries nothing else."""
    extra = tuple(t for t in (document_ids, moe_loss) if t is not None)
    return (hidden, *extra) if extra else hidden


class ParallelAttention(nn.Module):
    """Self-attention; heads (query and key/value alike) are split over the tensor parallel ranks.

    The fused QKV projection is laid out per key/value group: ``heads_per_group`` query heads, then
    that group's key head, then its value head. A contiguous block of groups per rank is then
    exactly that rank's heads, for multi-head (one query head per group) and grouped-query
    attention alike.

    DeepSpeed-Ulysses (``sp_group``, SP ranks each holding ``seq / SP`` consecutive positions of
    every sequence): q, k and v of the local positions go through DeepSpeed's
    ``DistributedAttention``, whose all-to-all trades the sequence split for a head split, so each
    rank attends over the whole sequence with 1/SP of this TP rank's key/value groups (and their
    query heads), and a second all-to-all returns the context to the sequence split. RoPE rotates
    before it, at the shard's global positions.

    --add-qkv-bias (Qwen2): the QKV projection has its bias even without --add-bias-linear, laid out
    (and split over TP) as the weight's rows. --qk-layernorm (Qwen3's q_norm / k_norm, Megatron-LM's
    ``q_layernorm`` / ``k_layernorm``): each head's query and key are normalised over its ``kv_channels``
    by one weight shared by every head, after the heads are split and before RoPE (Megatron-LM's
    ``SelfAttention.get_query_key_value_tensors``, transformers' ``Qwen3Attention.forward``). Each TP rank
    sees only its heads, so those weights' gradients are partial sums over TP: they are marked
    ``sequence_parallel`` and summed over the group like the norms under --sequence-parallel
    (``parallel.layers.register_sequence_parallel_grad_hooks``; Megatron-LM's finalize_model_grads does
    the same for them). --qk-layernorm-scope projection (OLMo 2's / OLMoE's): one RMSNorm over all heads'
    queries (keys: all key/value heads') at once, ``model.norms.ProjectionRMSNorm``, whose weight is split
    over TP with the heads and whose statistic is summed over TP.
    """

    def __init__(self, cfg: ModelConfig, *, tp_group=None, sequence_parallel: bool = False,
                 params_dtype: torch.dtype = torch.float32, device=None, recompute_core: bool = False,
                 sp_group=None, causal: bool = True, fp8: Fp8Recipe | None = None, cp=None):
        super().__init__()
        tp = tp_world_size(tp_group)
        # context parallelism (parallel/context_parallel.py): this rank's two chunks of every sequence; the
        # layer hands _core the whole sequence's document ids instead of a mask
        self.cp = cp
        d = cfg.kv_channels
        self.causal = causal  # without a mask: causal (GPT) or every position (bidirectional, unpadded)
        self.kv_channels = d
        self.heads_per_group = divide(cfg.num_attention_heads, cfg.num_key_value_heads)
        # asked once here, not in forward: a compiled layer would trace the probe call into its graph
        self.native_gqa = self.heads_per_group > 1 and sdpa_supports_gqa()
        self.num_groups = divide(cfg.num_key_value_heads, tp)
        self.num_heads = self.num_groups * self.heads_per_group
        self.attention_dropout = cfg.attention_dropout
        self.recompute_core = recompute_core
        self.rope_dim = (rotary_dim(d, cfg.rotary_percent)
                         if cfg.position_embedding_type == "rope" else None)
        self.rope_theta, self.rope_scaling = cfg.rope_theta, rope_scaling(cfg)
        self.seq_length = cfg.seq_length  # the whole sequence (all SP ranks' positions): the tables' length
        self.rope_fusion, self.fusions_on_cpu = cfg.apply_rope_fusion, cfg.fusions_on_cpu
        qkv_size = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d
        common = dict(tp_group=tp_group, bias=cfg.add_bias_linear, sequence_parallel=sequence_parallel,
                      params_dtype=params_dtype, device=device, fp8=fp8)
        self.query_key_value = ColumnParallelLinear(
            cfg.hidden_size, qkv_size, gather_output=False,
            init_method=init_method_normal(cfg.init_method_std),
            async_grad_comm=cfg.async_tensor_model_parallel_allreduce,
            **dict(common, bias=cfg.add_bias_linear or cfg.add_qkv_bias))
        self.q_layernorm = self.k_layernorm = None
        self.qk_norm_projection = cfg.qk_layernorm and cfg.qk_layernorm_scope == "projection"
        if self.qk_norm_projection:  # this rank's heads' slice of the whole projection's norm
            self.q_layernorm, self.k_layernorm = (
                _qk_norm(cfg, (local * d, full * d), tp_group=tp_group, params_dtype=params_dtype, device=device)
                for local, full in ((self.num_heads, cfg.num_attention_heads),
                                    (self.num_groups, cfg.num_key_value_heads)))
        elif cfg.qk_layernorm:
            self.q_layernorm, self.k_layernorm = (_qk_norm(cfg, partial_grads=tp > 1, params_dtype=params_dtype,
                                                           device=device) for _ in range(2))
        self.bias_dropout_fusion = cfg.bias_dropout_fusion
        self.dense = RowParallelLinear(
            cfg.num_attention_heads * d, cfg.hidden_size, input_is_parallel=True,
            init_method=scaled_init_method_normal(cfg.init_method_std, cfg.num_layers), **common)
        # (the helpers read any group; None is a group of one)
        self.sp_rank, self.sp_size = tp_rank(sp_group), tp_world_size(sp_group)
        # scatter heads (dim 2 of [s, b, heads, d]), gather the sequence (dim 0); the context comes back
        # the other way. num_kv_heads: the split follows key/value groups, so GQA's query heads stay
        # with their group (this TP rank's groups, divisible by SP: config/validation.py)
        self.distributed_attention = (DistributedAttention(self._attend, sp_group, scatter_idx=2, gather_idx=0,
                                                           num_kv_heads=self.num_groups)
                                      if self.sp_size > 1 else None)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, kv_cache=None):
        """``kv_cache`` (a ``megatron_ds.model.kv_cache.LayerKVCache``, inference only): ``x`` holds
        the positions after the cached ones; they are appended and attention covers all of them.
        Returns ``(output, bias)``: the bias is not yet added when the compiled bias-dropout fusion
        runs (the layer adds it there), else None."""
        qkv, _ = self.query_key_value(x)  # [s, b, groups * (heads_per_group + 2) * d]
        s, b = qkv.shape[:2]
        qkv = qkv.view(s, b, self.num_groups, self.heads_per_group + 2, self.kv_channels)
        if (self.rope_dim is not None and self.rope_fusion and self.q_layernorm is None
                and use_compiled(qkv, self.fusions_on_cpu)):
            # one kernel splits and rotates, and its backward writes the QKV gradient in one go
            q, k, v = rope_qkv(True, qkv, *self._rotary_tables(s, qkv.device, kv_cache))
        else:
            q, k, v = split_qkv(qkv)
            if self.qk_norm_projection:  # over all of this rank's heads at once (and the other ranks')
                q = self.q_layernorm(q.reshape(*q.shape[:2], -1)).view(q.shape)
                k = self.k_layernorm(k.reshape(*k.shape[:2], -1)).view(k.shape)
            elif self.q_layernorm is not None:
                q, k = self.q_layernorm(q), self.k_layernorm(k)
            if self.rope_dim is not None:
                cos, sin = self._rotary_tables(s, qkv.device, kv_cache)
                q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if kv_cache is not None:
            k, v = kv_cache.store(k, v)
        if self.distributed_attention is not None:
            # batch_dim_idx is 1 ([s, b, ...]); no rotary tables (applied above); the mask goes to
            # _attend. (Megatron-DeepSpeed's non-flash path passes its mask as batch_dim_idx.)
            context = self.distributed_attention(q, k, v, 1, None, mask)
        else:
            context = self._attend(q, k, v, mask)
        context = context.reshape(s, b, self.num_heads * self.kv_channels)
        # with the compiled bias-dropout-add the bias is added there (Megatron's skip_bias_add)
        return self.dense(context, skip_bias_add=self.bias_dropout_fusion and use_compiled(x, self.fusions_on_cpu))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        if self.recompute_core and self.training:
            # Selective recompute: the attention core's activations (softmax inputs/outputs when
            # not fused, the dropout mask) are the s^2-sized ones; recompute only those.
            return checkpoint(self._core, q, k, v, mask)
        return self._core(q, k, v, mask)

    def fill_rotary_tables(self) -> None:
        """Make the training length's cos/sin tables before a compiled forward reads them (where they
        exist, dynamo takes them as graph inputs instead of computing them inside the graph)."""
        if self.rope_dim is not None:
            rotary_cos_sin(self.seq_length, self.rope_dim, self.rope_theta, self.query_key_value.weight.device,
                           self.rope_scaling)

    def _rotary_tables(self, s: int, device, kv_cache) -> tuple[torch.Tensor, torch.Tensor]:
        if kv_cache is None and self.cp is not None:  # the chunks' global positions
            return rotary_cos_sin_of_cp_rank(self.cp, s, self.rope_dim, self.rope_theta, device, self.rope_scaling)
        if kv_cache is None:
            # under Ulysses this rank holds positions [rank * s, (rank + 1) * s) of the sequence
            cos, sin = rotary_cos_sin(s * self.sp_size, self.rope_dim, self.rope_theta, device, self.rope_scaling)
            return cos[self.sp_rank * s:(self.sp_rank + 1) * s], sin[self.sp_rank * s:(self.sp_rank + 1) * s]
        # new positions start at the cache offset; one table for the whole generation
        cos, sin = rotary_cos_sin(kv_cache.max_length, self.rope_dim, self.rope_theta, device, self.rope_scaling)
        return cos[kv_cache.offset:kv_cache.offset + s], sin[kv_cache.offset:kv_cache.offset + s]

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """``[s, b, heads, d]`` q (k, v: key/value groups) -> the context ``[s, b, heads, d]``."""
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, d]
        if self.cp is not None:  # ``mask``: the document ids (ParallelTransformerLayer.forward) or None
            return context_parallel_attention(self.cp, q, k, v, mask, self.attention_dropout if self.training else 0.0)
        extra = {}
        if self.heads_per_group > 1:
            if self.native_gqa:
                extra["enable_gqa"] = True
            else:
                k = k.repeat_interleave(self.heads_per_group, dim=1)
                v = v.repeat_interleave(self.heads_per_group, dim=1)
        p = self.attention_dropout if self.training else 0.0
        if p > 0.0:
            out = sdpa_with_dropout(q, k, v, mask, p, self.causal and mask is None, extra)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal and mask is None,
                                                 **extra)
        return out.permute(2, 0, 1, 3)


def _qk_norm(cfg: ModelConfig, projection: tuple[int, int] | None = None, *, partial_grads: bool = False,
             tp_group=None, params_dtype: torch.dtype, device) -> nn.Module:
    """One of --qk-layernorm's norms (``ParallelAttention``): the --normalization kind over a head's
    channels. ``partial_grads``: its gradient is a partial sum over TP (marked as ``build_norm`` marks the
    norms under sequence parallelism). ``projection`` (--qk-layernorm-scope projection): (this rank's,
    all ranks') channels of an RMSNorm over the whole projection, its weight split over ``tp_group``.
    --apply-wd-to-qk-layernorm marks its parameters for weight decay (``model/param_groups.py``)."""
    if projection is not None:
        norm = ProjectionRMSNorm(*projection, cfg.layernorm_epsilon, tp_group=tp_group, params_dtype=params_dtype,
                                 device=device)
    else:
        norm = build_norm(cfg.normalization, cfg.kv_channels, cfg.layernorm_epsilon, sequence_parallel=partial_grads,
                          params_dtype=params_dtype, device=device, one_plus=cfg.apply_layernorm_1p)
    for p in norm.parameters():
        setattr(p, DECAY, cfg.apply_wd_to_qk_layernorm)
    return norm


class ParallelMLP(nn.Module):
    """hidden -> ffn (GeLU, or SwiGLU with a fused gate/up projection) -> hidden.

    ``expert``: an MoE expert (``model/moe_layer.py``); DeepSpeed keeps only the first of the pair it returns,
    so the output bias is always added here (Megatron-DeepSpeed's expert RowParallelLinear adds it too)."""

    def __init__(self, cfg: ModelConfig, *, tp_group=None, sequence_parallel: bool = False,
                 params_dtype: torch.dtype = torch.float32, device=None, expert: bool = False,
                 fp8: Fp8Recipe | None = None):
        super().__init__()
        self.expert = expert
        self.swiglu = cfg.swiglu
        # gated MLPs: --swiglu (silu gate) or T5's --geglu (tanh-GeLU gate, HF T5's "gated-gelu")
        self.gated = cfg.swiglu or cfg.geglu
        # GeLU without a bias has nothing to fuse; SwiGLU's gate product fuses with or without one.
        self.activation = mlp_activation(cfg)
        # (Megatron-DeepSpeed never fuses --openai-gelu / --squared-relu either: ParallelMLP.__init__)
        self.fuse_activation = cfg.bias_swiglu_fusion if cfg.swiglu else \
            cfg.bias_gelu_fusion and cfg.add_bias_linear and self.activation is F.gelu and not cfg.geglu
        self.bias_dropout_fusion, self.fusions_on_cpu = cfg.bias_dropout_fusion, cfg.fusions_on_cpu
        ffn = cfg.ffn_hidden_size
        common = dict(tp_group=tp_group, bias=cfg.add_bias_linear, sequence_parallel=sequence_parallel,
                      params_dtype=params_dtype, device=device, fp8=fp8)
        # SwiGLU fuses [gate; up] into one projection. Every rank needs its slice of the gate AND
        # the matching slice of up, so the rows are split with stride 2: rank r holds
        # [gate_r; up_r] (Megatron's layout), and the full matrix is the same at any TP size.
        self.dense_h_to_4h = ColumnParallelLinear(
            cfg.hidden_size, 2 * ffn if self.gated else ffn, gather_output=False,
            init_method=init_method_normal(cfg.init_method_std), stride=2 if self.gated else 1,
            async_grad_comm=cfg.async_tensor_model_parallel_allreduce, **common)
        self.dense_4h_to_h = RowParallelLinear(
            ffn, cfg.hidden_size, input_is_parallel=True,
            init_method=scaled_init_method_normal(cfg.init_method_std, cfg.num_layers), **common)

    def forward(self, x: torch.Tensor):
        """Returns ``(output, bias)`` as ``ParallelAttention.forward``."""
        compiled = use_compiled(x, self.fusions_on_cpu)
        fuse = self.fuse_activation and compiled
        # fused: the column-parallel bias is added inside the compiled function (skip_bias_add)
        x, bias = self.dense_h_to_4h(x, skip_bias_add=fuse)
        if fuse:
            x = bias_swiglu(True, x, bias) if self.swiglu else bias_gelu(True, x, bias)
        else:
            x = self.activation(x)
        return self.dense_4h_to_h(x, skip_bias_add=self.bias_dropout_fusion and compiled and not self.expert)


def hidden_dropout(x: torch.Tensor, p: float, training: bool, sequence_parallel: bool) -> torch.Tensor:
    """Dropout on the (replicated or sequence-sharded) hidden state.

    Replicated activations must get the same mask on every tensor parallel rank: the default
    generator, seeded identically across TP ranks. Sequence-sharded activations are different
    tokens on each rank and should get independent masks: the tensor parallel stream (as Megatron).
    """
    if not training or p == 0.0:
        return x
    with hidden_dropout_stream(sequence_parallel):
        return F.dropout(x, p, True)


def hidden_dropout_stream(sequence_parallel: bool):
    """The generator hidden-state dropout draws from (see ``hidden_dropout``), as a context."""
    return get_rng_tracker().fork() if sequence_parallel else contextlib.nullcontext()


class ParallelTransformerLayer(nn.Module):
    """One pre-LN block: ``x + drop(attn(norm(x)))``, then ``x + drop(mlp(norm(x)))``.

    ``self_attn_mask_type``: "causal" (GPT; the optional second input is document ids) or "padding"
    (bidirectional, Megatron's ``AttnMaskType.padding``; the optional second input is the padding
    mask, see the module docstring).

    The class name is what the pipeline partitioner balances on
    (``megatron_ds.model.pipeline_model.PARTITION_METHOD``); keep the two in sync.

    ``num_experts > 1``: the MLP is DeepSpeed's MoE (``model/moe_layer.py``), or Megatron-LM's
    (``model/mlm_moe.py``) where ``config/moe_selection.py`` resolved the model for it, holding this rank's
    share of the experts (``ep_size``, ``ep_rank``); its auxiliary loss is added to the one the input carries.
    ``carry_moe_loss`` (every layer of an MoE model): the output carries that sum (module docstring);
    ``loss_report`` gets the fraction of routes the gate dropped (``moe.DROP_FRACTION``).
    ``fp8``: the run's FP8 recipe (``Layout.fp8``, resolved once from the flags), which every linear layer
    of the block (experts included) runs its GEMMs with; None: the weights' precision. ``expert_tp``: the ranks
    each of Megatron-LM's MoE experts is split over (--expert-tensor-parallel-size, ``model/mlm_moe.py``).
    """

    def __init__(self, cfg: ModelConfig, layer_number: int, *, tp_group=None, sequence_parallel: bool = False,
                 params_dtype: torch.dtype = torch.float32, device=None, recompute_attention: bool = False,
                 sp_group=None, num_experts: int = 1, ep_size: int = 1, ep_rank: int = 0,
                 carry_moe_loss: bool = False, loss_report=None, self_attn_mask_type: str = "causal",
                 fp8: Fp8Recipe | None = None, cp=None, expert_tp: int = 1):
        super().__init__()
        if self_attn_mask_type not in ("causal", "padding"):
            raise ValueError(f"self_attn_mask_type must be 'causal' or 'padding', got {self_attn_mask_type!r}")
        self.padding = self_attn_mask_type == "padding"
        self.layer_number = layer_number
        self.num_experts, self.carry_moe_loss, self.loss_report = num_experts, carry_moe_loss, loss_report
        self.dropout_p = cfg.hidden_dropout
        self.sequence_parallel = sequence_parallel
        self.bias_dropout_fusion, self.fusions_on_cpu = cfg.bias_dropout_fusion, cfg.fusions_on_cpu
        norm = dict(sequence_parallel=sequence_parallel, params_dtype=params_dtype, device=device)
        parallel = dict(tp_group=tp_group, sequence_parallel=sequence_parallel, params_dtype=params_dtype,
                        device=device, fp8=fp8)
        norm["one_plus"] = cfg.apply_layernorm_1p
        # --fp32-residual-connection: the stream between layers is fp32; the norms read it in fp32 and
        # hand the branches the weights' dtype (Megatron's MixedFusedLayerNorm, model/norms.py)
        self.fp32_residual = norm["fp32_input"] = cfg.fp32_residual_connection
        # --apply-residual-connection-post-layernorm: the residual is the norm's output (Megatron's layer)
        self.residual_after_norm = cfg.apply_residual_connection_post_layernorm
        self.input_layernorm = build_norm(cfg.normalization, cfg.hidden_size, cfg.layernorm_epsilon, **norm)
        if cfg.multi_latent_attention:  # DeepSeek's (model/mla.py)
            if fp8 is not None or tp_world_size(sp_group) > 1:  # (config/attention.py check_mla refuses both)
                raise ValueError("multi-latent attention runs without FP8 and DeepSpeed-Ulysses")
            self.self_attention = MLASelfAttention(cfg, recompute_core=recompute_attention, causal=not self.padding,
                                                   cp=cp, **{k: v for k, v in parallel.items() if k != "fp8"})
        else:
            self.self_attention = ParallelAttention(cfg, recompute_core=recompute_attention, sp_group=sp_group,
                                                    causal=not self.padding, cp=cp, **parallel)
        self.post_attention_layernorm = build_norm(cfg.normalization, cfg.hidden_size, cfg.layernorm_epsilon,
                                                   **norm)
        self.mlm_moe = num_experts > 1 and is_mlm_moe(cfg)
        self.moe_per_layer_logging = cfg.moe_per_layer_logging
        if self.mlm_moe:
            self.mlp = build_mlm_moe(cfg, num_experts, ep_size=ep_size, ep_rank=ep_rank,
                                     sequence_parallel=sequence_parallel, tp_group=tp_group, expert_tp=expert_tp,
                                     cp_group=cp.group if cp is not None else None, params_dtype=params_dtype,
                                     device=device)
        elif num_experts > 1:
            self.mlp = self._build_moe(cfg, num_experts, ep_size, ep_rank, parallel)
            self.drops = DropCounter(self.mlp)
        else:
            self.mlp = ParallelMLP(cfg, **parallel)

    @staticmethod
    def _build_moe(cfg: ModelConfig, num_experts: int, ep_size: int, ep_rank: int, parallel: dict):
        """DeepSpeed's MoE around our expert MLP, with Megatron-DeepSpeed's arguments
        (megatron/model/transformer.py ParallelTransformerLayer.__init__)."""
        if parallel["sequence_parallel"]:
            raise ValueError("MoE layers do not combine with (Megatron) sequence parallelism: DeepSpeed's MoE "
                             "expects every tensor parallel rank to hold the same tokens")
        expert_tp = cfg.enable_expert_tensor_parallelism
        if tp_world_size(parallel["tp_group"]) > 1:  # DeepSpeed's MoE then gathers tokens over TP
            ds_compat.gather_flat_on_gloo(parallel["tp_group"])
        expert = dict(parallel, tp_group=parallel["tp_group"] if expert_tp else None)
        # the experts' seeds follow this layer's seed (the generators are seeded just before each layer
        # is built: model/pipeline_model.py), drawn by Python's generator, not torch's: a build on fake tensors
        # (tests/fake_cuda/test_gpu_paths_moe.py) or on the meta device has no tensor value to read back
        seed = random.Random(torch.initial_seed()).randrange(2 ** 31 - 1 - num_experts)
        return build_moe(cfg.hidden_size, lambda: ParallelMLP(cfg, expert=True, **expert), num_experts=num_experts,
                         ep_size=ep_size, ep_rank=ep_rank, seed=seed, topk=cfg.topk,
                         residual=cfg.mlp_type == "residual", train_capacity_factor=cfg.moe_train_capacity_factor,
                         eval_capacity_factor=cfg.moe_eval_capacity_factor, min_capacity=cfg.moe_min_capacity,
                         drop_tokens=not cfg.disable_moe_token_dropping,
                         top2_2nd_expert_sampling=not cfg.disable_moe_top2_2nd_expert_sampling,
                         expert_tensor_parallel=expert_tp)

    def forward(self, inputs, kv_cache=None):
        # the integer tensor: document ids, or the padding mask of a bidirectional layer (self.padding)
        hidden, document_ids, moe_loss = split_activation(inputs)
        # context parallel attention builds its blocks' masks from the ids (an attention module without a
        # ``cp`` attribute runs without context parallelism)
        if document_ids is None or getattr(self.self_attention, "cp", None) is not None:
            mask = document_ids
        else:
            mask = padding_attention_mask(document_ids) if self.padding else document_causal_mask(document_ids)
        if kv_cache is not None:  # inference (megatron_ds.model.kv_cache): its mask covers padding too
            mask, kv_cache = kv_cache.mask, kv_cache.layer(self.layer_number)
        normed = self.input_layernorm(hidden)
        hidden = self._residual(*self.self_attention(normed, mask, kv_cache),
                                normed if self.residual_after_norm else hidden)
        normed = self.post_attention_layernorm(hidden)
        residual = normed if self.residual_after_norm else hidden
        if self.num_experts > 1:
            out, l_aux = self._moe(normed)
            hidden = self._residual(out, None, residual)
            l_aux = l_aux.float().reshape(1)
            moe_loss = l_aux if moe_loss is None else moe_loss + l_aux
        else:
            hidden = self._residual(*self.mlp(normed), residual)
        if self.carry_moe_loss and moe_loss is None:  # the first layer, dense: the sum starts at 0
            # a leaf that requires grad: DeepSpeed's pipeline engine runs backward on every floating
            # tensor a stage sends
            moe_loss = torch.zeros(1, device=hidden.device, requires_grad=torch.is_grad_enabled())
        return pack_activation(hidden, document_ids, moe_loss if self.carry_moe_loss else None)

    @torch.compiler.disable
    def _moe(self, normed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSpeed's MoE or Megatron-LM's: (output, auxiliary loss); reports the dropped routes. Both size
        their buffers by the routing's values (DeepSpeed's gate reads ``.item()``), which would split a compiled
        layer into many graphs recompiled per value: in a layer compiled with --compile-layers it runs eagerly,
        one graph break (``model/compile_layers.py``)."""
        if self.mlm_moe:
            out, l_aux = self.mlp(normed)
            if self.loss_report:
                report_routing(self.loss_report, self.mlp, self.layer_number if self.moe_per_layer_logging else None)
            return out, l_aux
        out, l_aux, _ = self.mlp(normed)  # (output, auxiliary loss, expert counts)
        if self.loss_report:
            self.loss_report.add(DROP_FRACTION, self.drops.last)
        return out, l_aux

    def _residual(self, x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor) -> torch.Tensor:
        """``residual + dropout(x + bias)``; ``bias`` is None unless the compiled bias-dropout-add runs.
        Where the fusions are not compiled (the CPU by default) this is the unfused path, so the
        numbers are bit for bit those without fusion there.

        With --fp32-residual-connection the add promotes to fp32 (the half-precision ``x + bias`` and
        dropout stay in half, as in Megatron-DeepSpeed's ParallelTransformerLayer.forward, whose
        bias_dropout_add gets the fp32 residual: megatron/model/transformer.py); a residual
        taken from a norm's output (--apply-residual-connection-post-layernorm) is widened first, so
        the stream stays fp32 where Megatron's layer would fall back to half precision."""
        if self.fp32_residual:
            residual = residual.float()
        if not (self.bias_dropout_fusion and use_compiled(x, self.fusions_on_cpu)):
            return residual + hidden_dropout(x, self.dropout_p, self.training, self.sequence_parallel)
        p = self.dropout_p if self.training else 0.0
        if bias is None and p == 0.0:  # one add: nothing to fuse
            return residual + x
        with hidden_dropout_stream(self.sequence_parallel and p > 0.0):  # the mask is drawn in there
            return bias_dropout_add(True, x, bias, residual, p)
