"""DeepSeek's multi-latent attention (MLA, DeepSeek-V2 paper section 2.1), as Megatron-LM builds it
(megatron/core/transformer/multi_latent_attention.py ``MLASelfAttention``, tag core_v0.19.0).

Per token ``x``: the query is ``W_q x`` (``--q-lora-rank`` None) or ``W_qu norm(W_qd x)``; the keys' and
values' latent ``c = norm(W_kvd x)[:kv_lora_rank]`` and one rotary key ``k_r = RoPE(W_kvd x[kv_lora_rank:])``
shared by every head come from one down projection; ``W_kvu c`` gives each head's key without positions and its
value. A head's query ``[q_nope; RoPE(q_r)]`` meets the key ``[k_nope; k_r]``, softmax scaled by
``mscale^2 / sqrt(qk_head_dim + qk_pos_emb_head_dim)``.

Tensor parallelism (Megatron-LM's split): the up projections are column parallel over heads, the output
projection row parallel; the down projections and the latents' norms are replicated on every TP rank. Their
gradients are complete on every rank where the ranks hold the same tokens: what reaches the latents from the
column-parallel up projections is all-reduced there (reduce-scattered under --sequence-parallel), and the
rotary key passes through a copy (a gather of the sequence under --sequence-parallel) whose backward sums its
heads' gradients over TP. Under --sequence-parallel each rank projects its own tokens, so these parameters are
marked ``sequence_parallel`` and their gradients summed over TP as the norms' are
(``parallel.layers.register_sequence_parallel_grad_hooks``).

RoPE: the rotary channels are de-interleaved (even channels, then odd) and rotated by halves, Megatron-LM's
``mla_rotary_interleaved`` (rope_utils ``_apply_rotary_pos_emb_bshd``), DeepSeek's checkpoints' pairing.
YaRN's tables are ``YarnRotaryEmbedding``'s (yarn_rotary_pos_embedding.py): frequencies blended between the
original and the divided-by-factor ones by a linear ramp over the correction range, cos/sin multiplied by the
concentration factor ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)``. Megatron-LM reads the original
context and the betas from ``MLATransformerConfig`` (4096, 32, 1), which no flag sets for MLA (its --yarn-*
flags reach only the non-MLA YaRN position embedding: training/argument_utils.py _apply_yarn_config_from_args).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megatron_ds.config.schema import ModelConfig
from megatron_ds.model.fusions import use_compiled
from megatron_ds.model.kernels import context_parallel_attention, sdpa_with_dropout
from megatron_ds.model.norms import build_norm
from megatron_ds.model.rotary import (RopeScaling, apply_rotary, rotary_cos_sin, rotary_cos_sin_of_cp_rank,
                                      yarn_mscale)
from megatron_ds.parallel.layers import (ColumnParallelLinear, RowParallelLinear, init_method_normal,
                                         scaled_init_method_normal)
from megatron_ds.parallel.mappings import copy_to_tensor_parallel_region, gather_from_sequence_parallel_region
from megatron_ds.parallel.random import checkpoint
from megatron_ds.parallel.utils import divide, tp_world_size

def softmax_scale(m: ModelConfig) -> float:
    """``MultiLatentAttention.__init__``'s: mscale(factor, mscale_all_dim)^2 / sqrt(query head dim), whatever
    the --rope-type."""
    return yarn_mscale(m.rotary_scaling_factor, m.mscale_all_dim) ** 2 / math.sqrt(m.qk_head_dim + m.qk_pos_emb_head_dim)


def deinterleave(t: torch.Tensor) -> torch.Tensor:
    """Even channels, then odd ones (``mla_rotary_interleaved``): DeepSeek rotates channel pairs (2i, 2i+1)."""
    return torch.cat((t[..., 0::2], t[..., 1::2]), dim=-1)


class MLASelfAttention(nn.Module):
    """Multi-latent self-attention (module docstring); ``forward`` as ``transformer.ParallelAttention``'s.
    Parameter names are Megatron-LM's (``linear_q_proj`` or ``linear_q_down_proj`` + ``q_layernorm`` +
    ``linear_q_up_proj``, ``linear_kv_down_proj``, ``kv_layernorm``, ``linear_kv_up_proj``) but for the output
    projection, ``dense`` as in ``ParallelAttention`` (Megatron-LM's ``linear_proj``)."""

    def __init__(self, cfg: ModelConfig, *, tp_group=None, sequence_parallel: bool = False,
                 params_dtype: torch.dtype = torch.float32, device=None, recompute_core: bool = False,
                 causal: bool = True, cp=None):
        super().__init__()
        # context parallelism (parallel/context_parallel.py): this rank's two chunks of every sequence; the layer
        # hands _core the whole sequence's document ids instead of a mask (as ParallelAttention)
        self.cp = cp
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel and tp_world_size(tp_group) > 1
        self.num_heads = divide(cfg.num_attention_heads, tp_world_size(tp_group))
        self.qk_head_dim, self.rope_dim, self.v_head_dim = cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim
        self.kv_lora_rank, self.causal, self.recompute_core = cfg.kv_lora_rank, causal, recompute_core
        self.attention_dropout, self.scale = cfg.attention_dropout, softmax_scale(cfg)
        self.rope_theta = cfg.rope_theta
        self.rope_scaling = RopeScaling(yarn_factor=float(cfg.rotary_scaling_factor), mscale=float(cfg.mscale),
                                        mscale_all_dim=float(cfg.mscale_all_dim)) \
            if (cfg.rope_type or "yarn") == "yarn" else None
        self.seq_length = cfg.seq_length
        self.bias_dropout_fusion, self.fusions_on_cpu = cfg.bias_dropout_fusion, cfg.fusions_on_cpu
        q_head_dim = self.qk_head_dim + self.rope_dim
        init = init_method_normal(cfg.init_method_std)
        split = dict(tp_group=tp_group, bias=False, gather_output=False, init_method=init,
                     sequence_parallel=sequence_parallel, params_dtype=params_dtype, device=device)
        heads = cfg.num_attention_heads
        if cfg.q_lora_rank is None:
            self.linear_q_proj = ColumnParallelLinear(cfg.hidden_size, heads * q_head_dim, **split)
        else:
            self.linear_q_down_proj = self._replicated(cfg.hidden_size, cfg.q_lora_rank, split)
            self.linear_q_up_proj = ColumnParallelLinear(cfg.q_lora_rank, heads * q_head_dim, **split)
        self.linear_kv_down_proj = self._replicated(cfg.hidden_size, cfg.kv_lora_rank + self.rope_dim, split)
        self.linear_kv_up_proj = ColumnParallelLinear(cfg.kv_lora_rank, heads * (self.qk_head_dim + self.v_head_dim),
                                                      **split)
        norm = dict(sequence_parallel=self.sequence_parallel, params_dtype=params_dtype, device=device,
                    one_plus=cfg.apply_layernorm_1p)
        self.q_layernorm = (None if cfg.q_lora_rank is None else
                            build_norm(cfg.normalization, cfg.q_lora_rank, cfg.layernorm_epsilon, **norm))
        self.kv_layernorm = build_norm(cfg.normalization, cfg.kv_lora_rank, cfg.layernorm_epsilon, **norm)
        self.dense = RowParallelLinear(
            heads * self.v_head_dim, cfg.hidden_size, tp_group=tp_group, bias=cfg.add_bias_linear,
            input_is_parallel=True, init_method=scaled_init_method_normal(cfg.init_method_std, cfg.num_layers),
            sequence_parallel=sequence_parallel, params_dtype=params_dtype, device=device)

    def _replicated(self, inputs: int, outputs: int, split: dict) -> ColumnParallelLinear:
        """A down projection, whole on every TP rank: initialised from the same generator as the split layers'
        full matrices (so a model is the same at any TP size), not a tensor parallel parameter (gradient norms
        count it once), its gradient summed over TP under sequence parallelism (module docstring)."""
        layer = ColumnParallelLinear(inputs, outputs, **dict(split, tp_group=None, sequence_parallel=False))
        layer.weight.tensor_model_parallel = False
        layer.weight.sequence_parallel = self.sequence_parallel
        return layer

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, kv_cache=None):
        """``x`` ``[s, b, hidden]`` (this rank's ``s / TP`` positions under --sequence-parallel) -> ``(output,
        bias)`` as ``ParallelAttention.forward``, ``kv_cache`` as there (it keeps the heads' keys and values)."""
        if self.q_layernorm is None:
            q, _ = self.linear_q_proj(x)
        else:
            q, _ = self.linear_q_up_proj(self.q_layernorm(self.linear_q_down_proj(x)[0]))
        s, b = q.shape[:2]  # the whole sequence
        q_nope, q_rope = q.view(s, b, self.num_heads, -1).split([self.qk_head_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.linear_kv_down_proj(x)[0].split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv, _ = self.linear_kv_up_proj(self.kv_layernorm(latent))
        k_nope, v = kv.view(s, b, self.num_heads, -1).split([self.qk_head_dim, self.v_head_dim], dim=-1)
        # every head of this rank reads the shared rotary key: its backward sums their gradients over TP
        k_rope = (gather_from_sequence_parallel_region(k_rope, self.tp_group) if self.sequence_parallel
                  else copy_to_tensor_parallel_region(k_rope, self.tp_group))
        cos, sin = self._rotary_tables(s, q.device, kv_cache)
        q_rope = apply_rotary(deinterleave(q_rope), cos, sin)
        k_rope = apply_rotary(deinterleave(k_rope)[:, :, None], cos, sin)
        q = torch.cat((q_nope, q_rope), dim=-1)
        k = torch.cat((k_nope, k_rope.expand(-1, -1, self.num_heads, -1)), dim=-1)
        if kv_cache is not None:
            k, v = kv_cache.store(k, v)
        if self.recompute_core and self.training:
            context = checkpoint(self._core, q, k, v, mask)
        else:
            context = self._core(q, k, v, mask)
        context = context.reshape(s, b, self.num_heads * self.v_head_dim)
        return self.dense(context, skip_bias_add=self.bias_dropout_fusion and use_compiled(x, self.fusions_on_cpu))

    def fill_rotary_tables(self) -> None:
        """The training length's tables, made before a compiled forward reads them (``compile_layers``)."""
        self._rotary_tables(self.seq_length, self.linear_kv_down_proj.weight.device, None)

    def _rotary_tables(self, s: int, device, kv_cache) -> tuple[torch.Tensor, torch.Tensor]:
        if kv_cache is None and self.cp is not None:  # the chunks' global positions
            return rotary_cos_sin_of_cp_rank(self.cp, s, self.rope_dim, self.rope_theta, device, self.rope_scaling)
        length, start = (s, 0) if kv_cache is None else (kv_cache.max_length, kv_cache.offset)
        cos, sin = rotary_cos_sin(length, self.rope_dim, self.rope_theta, device, self.rope_scaling)
        return cos[start:start + s], sin[start:start + s]

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """``[s, b, heads, d]`` q, k, v -> the context ``[s, b, heads, v_head_dim]``."""
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        p = self.attention_dropout if self.training else 0.0
        if self.cp is not None:  # ``mask``: the document ids or None; K and V keep their own head dims
            return context_parallel_attention(self.cp, q, k, v, mask, p, self.scale)
        is_causal = self.causal and mask is None
        if p > 0.0:
            out = sdpa_with_dropout(q, k, v, mask, p, is_causal, {"scale": self.scale})
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=self.scale)
        return out.permute(2, 0, 1, 3)
