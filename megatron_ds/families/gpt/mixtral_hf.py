"""A Llama-style DeepSpeed-MoE model as transformers' ``MixtralForCausalLM`` and back: what it can
express, the names of the MoE layer's tensors, and its config.

Equal logits need equal routing. DeepSpeed's top-k gate (deepspeedai/DeepSpeed
``deepspeed/moe/sharded_moe.py``, ``top2gating`` / ``topkgating``) computes the gate logits
``x @ wg^T`` in fp32 (``TopKGate.forward`` casts the input and its ``wg`` to fp32), takes the
softmax over all experts, picks the top k and divides their probabilities by their sum; Mixtral's
router (transformers ``models/mixtral/modeling_mixtral.py``, ``MixtralTopKRouter``) does the same:
softmax in fp32, top k, renormalized. That holds only where DeepSpeed's routing is deterministic
and drops nothing, so an export is refused, in one line naming each reason, for:

- top-1 gating: ``top1gating`` scales the expert's output by its softmax probability, Mixtral's
  renormalization makes a single expert's weight 1;
- token dropping (capacity factors): a token over an expert's capacity skips that expert, in
  evaluation too (``--moe-eval-capacity-factor``); Mixtral never drops;
- top-2 second-expert sampling: DeepSpeed draws the second expert with Gumbel noise
  (``top2_2nd_expert_sampling``), in evaluation as well; Mixtral takes the second largest;
- residual MoE (PR-MoE's dense MLP beside the experts), MoE on only some layers
  (``--expert-interval`` > 1, or a layer with one expert), differing expert counts per layer:
  Mixtral has experts, all alike, on every layer and nothing beside them;
- biases (Mixtral's attention and experts have none), query/key norms, GeLU experts (Mixtral's are
  SwiGLU), and
  what LlamaForCausalLM cannot express either (Mixtral's attention, norms and rotary embedding are
  Llama's).

Names (Megatron-DeepSpeed's MoE layer inside our transformer layer -> the Mixtral checkpoint
layout of the hub, ``model.layers.L.block_sparse_moe.*``, which transformers 5 converts to its
fused ``mlp.experts.gate_up_proj`` / ``down_proj`` when loading, see its ``conversion_mapping.py``):

- ``mlp.deepspeed_moe.gate.wg.weight`` -> ``block_sparse_moe.gate.weight``;
- ``mlp.deepspeed_moe.experts.deepspeed_experts.E.dense_h_to_4h.weight`` (SwiGLU ``[gate; up]``)
  -> ``block_sparse_moe.experts.E.w1.weight`` (gate) and ``...w3.weight`` (up);
- ``...deepspeed_experts.E.dense_4h_to_h.weight`` -> ``block_sparse_moe.experts.E.w2.weight``.
"""
from __future__ import annotations

import torch

from megatron_ds.checkpoint.expert_files import expert_id
from megatron_ds.config.moe_params import model_experts
from megatron_ds.config.schema import ModelConfig
from megatron_ds.errors import ConfigError

GATE = "mlp.deepspeed_moe.gate.wg.weight"
_EXPERT = "mlp.deepspeed_moe.experts.deepspeed_experts."


def _llama_problems(m: ModelConfig) -> list[str]:
    problems = []
    if m.apply_residual_connection_post_layernorm:
        problems.append("--apply-residual-connection-post-layernorm (Mixtral adds the residual from before the norm)")
    if m.position_embedding_type != "rope":
        problems.append(f"--position-embedding-type {m.position_embedding_type} (Mixtral has rotary positions)")
    elif m.rotary_percent != 1.0:
        problems.append(f"--rotary-percent {m.rotary_percent} (Mixtral rotates whole heads)")
    if m.normalization != "rmsnorm":
        problems.append(f"--normalization {m.normalization} (Mixtral has RMSNorm)")
    if not m.swiglu:
        problems.append("GeLU experts without --swiglu (Mixtral's experts are SwiGLU)")
    if m.add_bias_linear or m.add_qkv_bias:
        problems.append(f"{'biases' if m.add_bias_linear else '--add-qkv-bias'} (Mixtral's attention and experts have "
                        f"none; train with --disable-bias-linear)")
    if m.qk_layernorm:
        problems.append("--qk-layernorm (Mixtral has no query/key norms)")
    return problems


def _moe_problems(m: ModelConfig) -> list[str]:
    problems = []
    if m.mlp_type != "standard":
        problems.append(f"--mlp-type {m.mlp_type} (Mixtral has no dense MLP beside the experts)")
    per_layer = model_experts(m)
    if m.expert_interval != 1:
        problems.append(f"--expert-interval {m.expert_interval} (Mixtral has experts on every layer)")
    elif len(set(per_layer)) > 1:
        problems.append(f"--num-experts {' '.join(map(str, m.num_experts))} (Mixtral has the same experts on every "
                        f"layer{'; a layer with 1 expert is dense' if 1 in per_layer else ''})")
    if m.topk < 2:
        problems.append("--topk 1 (DeepSpeed's top-1 gate scales the expert by its probability, Mixtral's router "
                        "renormalizes it to 1)")
    if not m.disable_moe_token_dropping:
        problems.append("token dropping (tokens over an expert's capacity skip it, in evaluation too; Mixtral never "
                        "drops: train with --disable-moe-token-dropping)")
    if m.topk == 2 and not m.disable_moe_top2_2nd_expert_sampling:
        problems.append("second-expert sampling (DeepSpeed draws the 2nd expert with Gumbel noise, in evaluation too; "
                        "Mixtral takes the top 2: train with --disable-moe-top2-2nd-expert-sampling)")
    return problems


def check_expressible(m: ModelConfig, rope_problems: list[str] = ()) -> None:
    """ConfigError (one line, every reason) unless MixtralForCausalLM computes ``m``'s logits
    (``rope_problems``: what transformers' rope_parameters cannot hold, ``gpt_hf.rope_scaling_problems``)."""
    problems = _llama_problems(m) + list(rope_problems) + _moe_problems(m)
    if problems:
        raise ConfigError("a mixture-of-experts model exports as MixtralForCausalLM, which cannot express "
                          + "; ".join(problems))


def moe_to_hf(i: int, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Transformer layer ``i``'s MoE tensors (our names without the layer prefix, global expert ids)
    as Mixtral's. Every ``mlp.*`` tensor must map: one left over would be dropped from the export."""
    p = f"model.layers.{i}.block_sparse_moe."
    out = {p + "gate.weight": t[GATE]}
    for name, x in t.items():
        if not name.startswith("mlp.") or name == GATE:
            continue
        e = expert_id("." + name) if name.startswith(_EXPERT) else None
        tail = name[len(_EXPERT) + len(str(e)) + 1:] if e is not None else None
        if tail == "dense_h_to_4h.weight":
            out[f"{p}experts.{e}.w1.weight"], out[f"{p}experts.{e}.w3.weight"] = x.chunk(2, dim=0)
        elif tail == "dense_4h_to_h.weight":
            out[f"{p}experts.{e}.w2.weight"] = x
        else:
            raise ConfigError(f"layer {i + 1}: {name} has no place in MixtralForCausalLM")
    return out


def config_kwargs(m: ModelConfig) -> dict:
    """MixtralConfig's MoE fields for ``m`` (its Llama fields come from ``hf.hf_config``)."""
    return dict(num_local_experts=model_experts(m)[0], num_experts_per_tok=m.topk,
                router_aux_loss_coef=m.moe_loss_coeff,
                router_jitter_noise=0.0, output_router_logits=False)
