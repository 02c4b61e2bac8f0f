"""Tensor and config mapping between the GPT family's models and Hugging Face transformers models.

Two targets, chosen by the model's shape:

- ``GPT2LMHeadModel``: learned absolute positions, LayerNorm, GeLU MLP, biases, tied embeddings,
  multi-head attention with ``kv_channels * heads == hidden``. GPT-2's ``Conv1D`` layers store
  their weights transposed (``[in, out]``), and its ``c_attn`` is ``[Q(all heads); K; V]``.
- ``MixtralForCausalLM``, ``Qwen2MoeForCausalLM``, ``Qwen3MoeForCausalLM``, ``OlmoeForCausalLM``: Mistral's,
  Qwen2's, Qwen3's and Llama's layers (OLMoE's with RMSNorms over the whole query / key projections:
  --qk-layernorm-scope projection) with Megatron-LM's MoE layer in place of the MLP
  (``megatron_ds.families.gpt.moe_hf``, both ways);
  Mixtral also exports from DeepSpeed-MoE layers (``megatron_ds.families.gpt.mixtral_hf``).
- ``LlamaForCausalLM``: rotary positions (full head dimension, "rotate half" -- the convention of
  both ``model/rotary.py`` and HF Llama, so no permutation of q/k rows is needed), RMSNorm,
  SwiGLU, optional grouped-query attention, tied or untied output layer; biases map to Llama's
  ``attention_bias`` / ``mlp_bias``. Llama 3.1's RoPE scaling (``rope_type`` "llama3") is
  --use-rope-scaling with its factors, "linear" is --rotary-seq-len-interpolation-factor; both
  hold for the three classes below too (transformers computes every class's frequencies with
  ``modeling_rope_utils.ROPE_INIT_FUNCTIONS``).
- ``Qwen2ForCausalLM``: Llama's layers with biases on q/k/v only (--add-qkv-bias
  --disable-bias-linear).
- ``Qwen3ForCausalLM``: Llama's layers with a per-head RMSNorm of head size on queries and keys
  before the rotary embedding (--qk-layernorm: ``self_attention.q_layernorm`` / ``k_layernorm`` ->
  ``self_attn.q_norm`` / ``k_norm``), ``head_dim`` free of hidden / heads (--kv-channels).
- ``DeepseekV3ForCausalLM`` / ``DeepseekV2ForCausalLM``: --multi-latent-attention and Llama's MLP
  (``megatron_ds.families.gpt.deepseek_hf``), their MoE layers Megatron-LM's (``moe_hf``).
- ``MistralForCausalLM``: Llama's layers without biases, with ``sliding_window`` W: transformers'
  ``masking_utils.sliding_window_overlay`` lets query q see keys kv with ``kv > q - W``, i.e. W - 1
  keys back, Megatron-LM's --window-size (W - 1, 0). Qwen2/Qwen3 slide on the layers
  ``layer_types`` names ``sliding_attention``; here the window holds on every layer, which is the
  same computation because the window must cover --seq-length (it masks nothing).

Which class an export writes (``choose_architecture``): the one asked for (to_hf.py
--architecture), else the one the checkpoint was imported from (``hf_architecture`` in its
metadata) when it can express the model, else by the model's features: Megatron-LM's MoE -> DeepSeek-V2/V3
(--multi-latent-attention: softmax / sigmoid router), Qwen2-MoE (shared expert), Qwen3-MoE (--qk-layernorm),
OLMoE (--qk-layernorm-scope projection) or Mixtral; DeepSpeed-MoE -> Mixtral, multi-latent
attention -> DeepSeek-V3, learned positions -> GPT-2, --qk-layernorm -> Qwen3, --add-qkv-bias without other biases -> Qwen2,
--window-size -> Mistral, otherwise Llama. What the class cannot express is refused by flag.

Our fused QKV weight is laid out per key/value group (``model/transformer.py``): for group g,
``heads_per_group`` query heads, then its key head, then its value head. Query head ``g *
heads_per_group + j`` therefore uses key/value head g, HF's grouped-query convention. SwiGLU's
``dense_h_to_4h`` is ``[gate; up]`` (the forward does ``silu(first half) * second half``).
The padding rows of the vocabulary are dropped on export (HF's vocabulary is the real one).
"""
from __future__ import annotations

import dataclasses

import torch

from megatron_ds.checkpoint.hf_files import fuse_qkv, split_qkv
from megatron_ds.config.attention import window_size
from megatron_ds.config.layout import resolve_model_config
from megatron_ds.config import moe_selection
from megatron_ds.config.moe_selection import is_mlm_moe
from megatron_ds.config.moe_params import is_moe
from megatron_ds.config.schema import ModelConfig
from megatron_ds.errors import ConfigError
from megatron_ds.families.gpt import deepseek_hf as deepseek
from megatron_ds.families.gpt import mixtral_hf as mixtral
from megatron_ds.families.gpt import moe_hf

GPT2, LLAMA, MIXTRAL, QWEN2, QWEN3, MISTRAL = "gpt2", "llama", "mixtral", "qwen2", "qwen3", "mistral"
DEEPSEEK_V3, DEEPSEEK_V2 = "deepseek_v3", "deepseek_v2"
_DEEPSEEK = (DEEPSEEK_V3, DEEPSEEK_V2)  # the same multi-latent attention and MLP; their MoE routers differ
QWEN2_MOE, QWEN3_MOE, OLMOE = moe_hf.QWEN2_MOE, moe_hf.QWEN3_MOE, moe_hf.OLMOE
ARCHITECTURES = {GPT2: "GPT2LMHeadModel", LLAMA: "LlamaForCausalLM", MIXTRAL: "MixtralForCausalLM",
                 QWEN2: "Qwen2ForCausalLM", QWEN3: "Qwen3ForCausalLM", MISTRAL: "MistralForCausalLM",
                 DEEPSEEK_V3: deepseek.CLASS, DEEPSEEK_V2: deepseek.V2_CLASS, **moe_hf.CLASSES}
# the classes a Megatron-LM MoE model exports to, with the dense class whose attention and norms each has
# (Mixtral's are Mistral's: no biases, an optional sliding window; Qwen2-MoE's q/k/v biases are optional: Llama's)
_MOE_ATTENTION = {MIXTRAL: MISTRAL, QWEN2_MOE: QWEN2, QWEN3_MOE: QWEN3, DEEPSEEK_V3: DEEPSEEK_V3,
                  DEEPSEEK_V2: DEEPSEEK_V2, OLMOE: OLMOE}  # (OLMoE's attention: no dense class here)
# GPT-2's activation_function for our MLP activations: "gelu" is the exact (erf) GeLU, "gelu_new" GPT-2's
# tanh approximation (--openai-gelu), "relu2" transformers' ReLUSquaredActivation (--squared-relu)
_GPT2_ACTIVATIONS = {"gelu": {}, "gelu_new": {"openai_gelu": True}, "gelu_pytorch_tanh": {"openai_gelu": True},
                     "relu2": {"squared_relu": True}}
# Megatron-LM's Llama 3.1 constants (rotary_pos_embedding.py, RotaryEmbedding._apply_scaling): its flags
# set only the factor, so the others are printed only where a checkpoint differs
_LLAMA3_FIXED = {name: ModelConfig.__dataclass_fields__[name].default for name in (
    "rope_scaling_low_freq_factor", "rope_scaling_high_freq_factor", "rope_scaling_original_max_position_embeddings")}


def architecture_key(name: str) -> str:
    """A class name (``Qwen3ForCausalLM``) or model type (``qwen3``) -> our key; ConfigError if unknown."""
    for key, cls in ARCHITECTURES.items():
        if name in (key, cls):
            return key
    raise ConfigError(f"--architecture {name}: one of {', '.join(ARCHITECTURES.values())}")


def sliding_window(m: ModelConfig) -> int | None:
    """HF's sliding_window W of --window-size "(W-1,0)" (None: no window; a negative left side is
    Megatron-LM's unbounded one)."""
    window = window_size(m)
    if window is None:
        return None
    left, right = window
    if right != 0:
        raise ConfigError(f"--window-size {m.window_size}: causal models have no right window (HF has none)")
    return None if left < 0 else left + 1


def choose_architecture(m: ModelConfig, *, asked: str | None = None, recorded: str | None = None) -> str:
    """The transformers class that can express ``m`` exactly (``asked``: to_hf.py --architecture;
    ``recorded``: the class the checkpoint was imported from, taken where it can express ``m``);
    ConfigError naming what cannot."""
    if is_mlm_moe(m) and is_moe(m):
        return _choose_mlm_moe(m, asked, recorded)
    if asked is not None:
        arch = architecture_key(asked)
    elif is_moe(m):
        arch = MIXTRAL
    elif m.multi_latent_attention:  # V2's and V3's dense layers are alike: the class imported from
        arch = DEEPSEEK_V2 if recorded == deepseek.V2_CLASS else DEEPSEEK_V3
    elif m.position_embedding_type == "learned_absolute":
        arch = GPT2
    elif recorded is not None and recorded in ARCHITECTURES.values() \
            and not _problems(architecture_key(recorded), m):
        arch = architecture_key(recorded)
    elif m.qk_layernorm:
        arch = QWEN3
    elif m.add_qkv_bias and not m.add_bias_linear:
        arch = QWEN2
    elif m.window_size is not None:
        arch = MISTRAL
    else:
        arch = LLAMA
    if arch in moe_hf.CLASSES:
        raise ConfigError(f"{ARCHITECTURES[arch]} needs Megatron-LM's MoE layers (--num-experts N --moe-router-topk K"
                          f" ..., docs/moe.md)")
    if (arch == MIXTRAL) != is_moe(m):
        raise ConfigError("MixtralForCausalLM needs mixture-of-experts layers (--num-experts)" if arch == MIXTRAL else
                          f"--num-experts: DeepSpeed-MoE layers export as MixtralForCausalLM only, not as "
                          f"{ARCHITECTURES[arch]}")
    if arch == MIXTRAL:
        mla = ["--multi-latent-attention (MixtralForCausalLM has Llama's attention)"] if m.multi_latent_attention else []
        mixtral.check_expressible(m, rope_scaling_problems(m) + mla)
        return MIXTRAL
    if m.apply_residual_connection_post_layernorm:
        raise ConfigError("--apply-residual-connection-post-layernorm: neither GPT2LMHeadModel nor the Llama-style "
                          "classes can express it (they add the residual from before the norm)")
    if m.position_embedding_type == "none":
        raise ConfigError(f"--position-embedding-type none: {ARCHITECTURES[arch]} cannot express a model without "
                          f"positions")
    problems = _problems(arch, m)
    if problems:
        what = "learned absolute positions" if m.position_embedding_type == "learned_absolute" else "rotary positions"
        raise ConfigError(f"{what} export as {ARCHITECTURES[arch]}, which cannot express " + "; ".join(problems))
    return arch


def _choose_mlm_moe(m: ModelConfig, asked: str | None, recorded: str | None) -> str:
    """choose_architecture for Megatron-LM's MoE layers: the class asked for, else the recorded one where it can
    express ``m``, else by features (multi-latent attention: DeepSeek-V2 or V3 by the router's score function; a
    shared expert: Qwen2-MoE; --qk-layernorm: Qwen3-MoE; else Mixtral)."""
    if asked is not None:
        arch = architecture_key(asked)
    elif recorded in ARCHITECTURES.values() and architecture_key(recorded) in _MOE_ATTENTION \
            and not _moe_problems(architecture_key(recorded), m):
        arch = architecture_key(recorded)
    elif m.multi_latent_attention:  # DeepSeek-V2's router is a softmax, V3's a sigmoid
        arch = DEEPSEEK_V2 if m.moe_router_score_function == "softmax" else DEEPSEEK_V3
    elif m.moe_shared_expert_intermediate_size:
        arch = QWEN2_MOE
    elif m.qk_layernorm:  # per-head norms: Qwen3-MoE's; over the whole projection: OLMoE's
        arch = OLMOE if m.qk_layernorm_scope == "projection" else QWEN3_MOE
    else:
        arch = MIXTRAL
    if arch not in _MOE_ATTENTION:
        raise ConfigError(f"--num-experts: {ARCHITECTURES[arch]} has no mixture of experts "
                          f"({', '.join(ARCHITECTURES[a] for a in _MOE_ATTENTION)} have)")
    problems = _moe_problems(arch, m)
    if problems:
        raise ConfigError(f"a mixture-of-experts model exports as {ARCHITECTURES[arch]}, which cannot express "
                          + "; ".join(problems))
    return arch


def _moe_problems(arch: str, m: ModelConfig) -> list[str]:
    base = _MOE_ATTENTION[arch]
    if arch == QWEN2_MOE and not m.add_qkv_bias:
        base = LLAMA  # Qwen2MoeConfig's qkv_bias false: no biases at all
    return _problems(base, m, name=ARCHITECTURES[arch]) + moe_hf.problems(arch, m)


def _problems(arch: str, m: ModelConfig, name: str | None = None) -> list[str]:
    """What ``arch`` (a dense class; ``name``: the class named in the reasons, else ``arch``'s) cannot express
    of ``m``, by flag."""
    name = name or ARCHITECTURES[arch]
    if arch in _DEEPSEEK:
        return deepseek.problems(m, name)
    if m.multi_latent_attention:
        return [f"--multi-latent-attention ({name} has no multi-latent attention; DeepseekV3ForCausalLM has)"]
    if arch == GPT2:
        problems = []
        if m.position_embedding_type != "learned_absolute":
            problems.append(f"--position-embedding-type {m.position_embedding_type} (GPT2LMHeadModel has learned "
                            f"absolute positions)")
        if m.normalization != "layernorm":
            problems.append(f"--normalization {m.normalization} (GPT2LMHeadModel has LayerNorm)")
        if m.swiglu:
            problems.append("--swiglu (GPT2LMHeadModel has a GeLU MLP)")
        if not m.add_bias_linear:
            problems.append("--disable-bias-linear (GPT2LMHeadModel's linear layers have biases)")
        if m.untie_embeddings_and_output_weights:
            problems.append("--untie-embeddings-and-output-weights (GPT2LMHeadModel ties them)")
        if m.num_key_value_heads != m.num_attention_heads:
            problems.append(f"--num-key-value-heads {m.num_key_value_heads} (GPT2LMHeadModel has no "
                            f"grouped-query attention)")
        if m.kv_channels * m.num_attention_heads != m.hidden_size:
            problems.append(f"--kv-channels {m.kv_channels} (GPT2LMHeadModel needs kv channels x heads = hidden)")
        return problems + _rope_free_problems(name, m)
    problems = []
    if m.position_embedding_type != "rope":
        problems.append(f"--position-embedding-type {m.position_embedding_type} ({name} has rotary positions)")
    if m.normalization != "rmsnorm":
        problems.append(f"--normalization {m.normalization} ({name} has RMSNorm)")
    if not m.swiglu:
        problems.append(f"a GeLU MLP without --swiglu ({name} has SwiGLU)")
    if m.rotary_percent != 1.0:
        problems.append(f"--rotary-percent {m.rotary_percent} ({name} rotates whole heads)")
    problems += rope_scaling_problems(m)
    if m.qk_layernorm != (arch in (QWEN3, OLMOE)):
        problems.append(f"--qk-layernorm ({name} has no query/key norms)" if m.qk_layernorm else
                        f"no --qk-layernorm ({name} normalizes every head's queries and keys)")
    elif m.qk_layernorm and (m.qk_layernorm_scope == "projection") != (arch == OLMOE):
        problems.append(f"--qk-layernorm-scope {m.qk_layernorm_scope} ({name} normalizes "
                        + ("the whole query and key projections: --qk-layernorm-scope projection)" if arch == OLMOE
                           else "each head: --qk-layernorm-scope head)"))
    if arch == OLMOE and m.kv_channels * m.num_attention_heads != m.hidden_size:
        problems.append(f"--kv-channels {m.kv_channels} ({name}'s heads are hidden / heads channels: its q_norm is "
                        f"of hidden size)")
    qkv_only = m.add_qkv_bias and not m.add_bias_linear
    if arch == LLAMA and qkv_only:
        problems.append("--add-qkv-bias without --add-bias-linear (LlamaForCausalLM's attention_bias puts a bias "
                        "on the output projection too; Qwen2ForCausalLM has q/k/v biases only)")
    if arch == QWEN2 and not qkv_only:
        problems.append("biases on the output projection and MLP (Qwen2ForCausalLM has q/k/v biases only: "
                        "--disable-bias-linear --add-qkv-bias)" if m.add_bias_linear else
                        "no --add-qkv-bias (Qwen2ForCausalLM's q/k/v projections have biases)")
    if arch in (QWEN3, MISTRAL, OLMOE) and (m.add_bias_linear or m.add_qkv_bias):
        why = "has attention biases on q/k/v and the output projection together, none in the MLP" \
            if arch == QWEN3 else "has no biases"
        problems.append(f"{'--add-qkv-bias' if qkv_only else 'biases (no --disable-bias-linear)'} ({name} {why})")
    if arch in (LLAMA, OLMOE) and m.window_size is not None:
        problems.append(f"--window-size {m.window_size} (LlamaForCausalLM has no sliding window; "
                        f"MistralForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM have)")
    return problems


def rope_scaling_problems(m: ModelConfig) -> list[str]:
    """transformers' ``rope_parameters`` holds one scaling: both of ours at once have no equivalent."""
    if m.use_rope_scaling and m.rotary_seq_len_interpolation_factor is not None:
        return [f"--use-rope-scaling with --rotary-seq-len-interpolation-factor "
                f"{m.rotary_seq_len_interpolation_factor:g} (rope_parameters has one rope_type)"]
    return []


def _rope_free_problems(name: str, m: ModelConfig) -> list[str]:
    """What a class without rotary embeddings or attention variants (GPT-2) cannot express."""
    flags = [("--add-qkv-bias", m.add_qkv_bias and not m.add_bias_linear), ("--qk-layernorm", m.qk_layernorm),
             (f"--window-size {m.window_size}", m.window_size is not None)]
    return [f"{flag} ({name} has no such variant)" for flag, on in flags if on]


def _rope_parameters(m: ModelConfig) -> dict:
    """transformers 5's ``rope_parameters`` of ``m`` (modeling_rope_utils: _compute_llama3_parameters,
    _compute_linear_scaling_rope_parameters)."""
    if m.use_rope_scaling:
        return {"rope_type": "llama3", "rope_theta": m.rope_theta, "factor": m.rope_scaling_factor,
                "low_freq_factor": m.rope_scaling_low_freq_factor,
                "high_freq_factor": m.rope_scaling_high_freq_factor,
                "original_max_position_embeddings": m.rope_scaling_original_max_position_embeddings}
    if m.rotary_seq_len_interpolation_factor is not None:
        return {"rope_type": "linear", "rope_theta": m.rope_theta, "factor": m.rotary_seq_len_interpolation_factor}
    return {"rope_type": "default", "rope_theta": m.rope_theta}


def _transformer_layer_names(arch: str, i: int) -> dict[str, str]:
    """Our names inside transformer layer -> HF names (for Llama; GPT-2 is handled by the functions
    below because of Conv1D and the fused c_attn)."""
    p = f"model.layers.{i}."
    return {"input_layernorm.weight": p + "input_layernorm.weight",
            "self_attention.q_layernorm.weight": p + "self_attn.q_norm.weight",  # Qwen3 (--qk-layernorm)
            "self_attention.k_layernorm.weight": p + "self_attn.k_norm.weight",
            "post_attention_layernorm.weight": p + "post_attention_layernorm.weight",
            "self_attention.dense.weight": p + "self_attn.o_proj.weight",
            "self_attention.dense.bias": p + "self_attn.o_proj.bias",
            "mlp.dense_4h_to_h.weight": p + "mlp.down_proj.weight",
            "mlp.dense_4h_to_h.bias": p + "mlp.down_proj.bias"}


def layer_to_hf(arch: str, m: ModelConfig, i: int, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Transformer layer ``i`` (0-based) from our names (without the layer prefix) to HF tensors."""
    out = {}
    if arch == GPT2:
        p = f"transformer.h.{i}."
        for ours, theirs in (("input_layernorm", "ln_1"), ("post_attention_layernorm", "ln_2")):
            out[p + theirs + ".weight"], out[p + theirs + ".bias"] = t[ours + ".weight"], t[ours + ".bias"]
        out[p + "attn.c_attn.weight"] = torch.cat(split_qkv(t["self_attention.query_key_value.weight"], m)).t()
        out[p + "attn.c_attn.bias"] = torch.cat(split_qkv(t["self_attention.query_key_value.bias"], m))
        for ours, theirs in (("self_attention.dense", "attn.c_proj"), ("mlp.dense_h_to_4h", "mlp.c_fc"),
                             ("mlp.dense_4h_to_h", "mlp.c_proj")):
            out[p + theirs + ".weight"] = t[ours + ".weight"].t()  # Conv1D: [in, out]
            out[p + theirs + ".bias"] = t[ours + ".bias"]
        return one_plus(m, out)
    if moe_hf.ROUTER in t:  # Megatron-LM's MoE layer: the class's MoE block in place of the MLP
        out.update(moe_hf.moe_to_hf(arch, i, t))
        t = {k: v for k, v in t.items() if not k.startswith("mlp.")}
    elif arch == MIXTRAL:  # DeepSpeed-MoE: Llama's attention and norms, Mixtral's MoE block in place of the MLP
        out.update(mixtral.moe_to_hf(i, t))
        t = {k: v for k, v in t.items() if not k.startswith("mlp.")}
    names = deepseek.layer_names(i) if arch in _DEEPSEEK else _transformer_layer_names(arch, i)
    fused = {f"{a}.{s}" for a in ("self_attention.query_key_value", "mlp.dense_h_to_4h") for s in ("weight", "bias")}
    unknown = sorted(set(t) - set(names) - fused)
    if unknown:  # would be dropped from the export: the model is not the one the class computes
        raise ConfigError(f"layer {i + 1} has parameters {unknown} that {ARCHITECTURES[arch]} cannot hold")
    out.update({names[k]: v for k, v in t.items() if k in names})
    p = f"model.layers.{i}."
    for suffix in ("weight", "bias"):
        qkv = t.get(f"self_attention.query_key_value.{suffix}")
        if qkv is not None:
            for name, x in zip(("q_proj", "k_proj", "v_proj"), split_qkv(qkv, m)):
                out[f"{p}self_attn.{name}.{suffix}"] = x
        fc = t.get(f"mlp.dense_h_to_4h.{suffix}")
        if fc is not None:
            gate, up = fc.chunk(2, dim=0)
            out[f"{p}mlp.gate_proj.{suffix}"], out[f"{p}mlp.up_proj.{suffix}"] = gate, up
    return out


def one_plus(m: ModelConfig, hf_tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """--apply-layernorm-1p: the norm scales by 1 + weight, which a plain LayerNorm holds as its weight."""
    if not (m.apply_layernorm_1p and m.normalization == "layernorm"):
        return hf_tensors
    return {k: v + 1 if k.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")) else v for k, v in hf_tensors.items()}


def layer_from_hf(arch: str, m: ModelConfig, i: int, get) -> dict[str, torch.Tensor]:
    """Inverse of ``layer_to_hf``: ``get(hf_name)`` returns a tensor (or None if absent)."""
    t = {}
    if arch == GPT2:
        p = f"transformer.h.{i}."
        for ours, theirs in (("input_layernorm", "ln_1"), ("post_attention_layernorm", "ln_2")):
            t[ours + ".weight"], t[ours + ".bias"] = get(p + theirs + ".weight"), get(p + theirs + ".bias")
        w = get(p + "attn.c_attn.weight").t()
        t["self_attention.query_key_value.weight"] = fuse_qkv(*w.chunk(3, dim=0), m)
        t["self_attention.query_key_value.bias"] = fuse_qkv(*get(p + "attn.c_attn.bias").chunk(3), m)
        for ours, theirs in (("self_attention.dense", "attn.c_proj"), ("mlp.dense_h_to_4h", "mlp.c_fc"),
                             ("mlp.dense_4h_to_h", "mlp.c_proj")):
            t[ours + ".weight"] = get(p + theirs + ".weight").t()
            t[ours + ".bias"] = get(p + theirs + ".bias")
        return t
    if is_mlm_moe(m) and moe_selection.layer_freq(m.moe_layer_freq, m.num_layers)[i]:
        t.update(moe_hf.moe_from_hf(arch, i, m.num_experts[0], get))
    for ours, theirs in (deepseek.layer_names(i) if arch in _DEEPSEEK else _transformer_layer_names(arch, i)).items():
        x = get(theirs)
        if x is not None:
            t[ours] = x
    p = f"model.layers.{i}."
    for suffix in ("weight", "bias"):
        q = get(f"{p}self_attn.q_proj.{suffix}") if arch not in _DEEPSEEK else None  # (DeepSeek's: deepseek_hf)
        if q is not None:
            t[f"self_attention.query_key_value.{suffix}"] = fuse_qkv(
                q, get(f"{p}self_attn.k_proj.{suffix}"), get(f"{p}self_attn.v_proj.{suffix}"), m)
        gate = get(f"{p}mlp.gate_proj.{suffix}")
        if gate is not None:
            t[f"mlp.dense_h_to_4h.{suffix}"] = torch.cat([gate, get(f"{p}mlp.up_proj.{suffix}")])
    return t


def embedding_names(arch: str) -> dict[str, str]:
    """Our embedding / final norm / output names (without the layer prefix) -> HF names."""
    if arch == GPT2:
        return {"word_embeddings.weight": "transformer.wte.weight",
                "position_embeddings.weight": "transformer.wpe.weight",
                "final_layernorm.weight": "transformer.ln_f.weight", "final_layernorm.bias": "transformer.ln_f.bias"}
    return {"word_embeddings.weight": "model.embed_tokens.weight", "final_layernorm.weight": "model.norm.weight",
            "output_layer.weight": "lm_head.weight"}


def hf_config(arch: str, m: ModelConfig, vocab_size: int, *, bos: int | None, eos: int | None, dtype: torch.dtype):
    """The transformers config object for ``m`` (``choose_architecture`` first)."""
    import transformers  # noqa: PLC0415 - optional dependency, needed only here

    common = dict(vocab_size=vocab_size, bos_token_id=bos, eos_token_id=eos, initializer_range=m.init_method_std,
                  dtype=dtype, architectures=[ARCHITECTURES[arch]])
    if arch == GPT2:
        # "gelu": our MLP uses the exact erf GeLU (F.gelu), not GPT-2's default tanh "gelu_new" (--openai-gelu)
        act = "gelu_new" if m.openai_gelu else "relu2" if m.squared_relu else "gelu"
        return transformers.GPT2Config(
            n_positions=m.max_position_embeddings, n_embd=m.hidden_size, n_layer=m.num_layers,
            n_head=m.num_attention_heads, n_inner=m.ffn_hidden_size, activation_function=act,
            resid_pdrop=m.hidden_dropout, embd_pdrop=m.hidden_dropout, attn_pdrop=m.attention_dropout,
            layer_norm_epsilon=m.layernorm_epsilon, tie_word_embeddings=True, **common)
    if arch in _DEEPSEEK:
        return deepseek.hf_config(m, common, moe_hf.config_kwargs(arch, m) if is_mlm_moe(m) and is_moe(m) else None,
                                  v2=arch == DEEPSEEK_V2)
    # what Llama, Qwen2/3, Mistral and Mixtral describe alike (Llama's layers)
    llama = dict(
        hidden_size=m.hidden_size, intermediate_size=m.ffn_hidden_size, num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads, num_key_value_heads=m.num_key_value_heads,
        head_dim=m.kv_channels, hidden_act="silu", max_position_embeddings=m.max_position_embeddings,
        rms_norm_eps=m.layernorm_epsilon, tie_word_embeddings=not m.untie_embeddings_and_output_weights,
        rope_parameters=_rope_parameters(m), attention_dropout=m.attention_dropout, **common)
    window = sliding_window(m)
    if is_mlm_moe(m) and arch in _MOE_ATTENTION:
        llama.update(moe_hf.config_kwargs(arch, m))
        if arch == MIXTRAL:
            return transformers.MixtralConfig(**llama, sliding_window=window)
        if arch == QWEN3_MOE:
            return transformers.Qwen3MoeConfig(**llama, attention_bias=False)
        if arch == OLMOE:  # head_dim: hidden / heads (choose_architecture checked)
            del llama["head_dim"]
            return transformers.OlmoeConfig(**llama, attention_bias=False)
        if m.kv_channels * m.num_attention_heads == m.hidden_size:  # as Qwen2Config below
            del llama["head_dim"]
        return transformers.Qwen2MoeConfig(**llama)
    if arch == MIXTRAL:
        return transformers.MixtralConfig(**llama, **mixtral.config_kwargs(m), sliding_window=window)
    if arch == MISTRAL:
        return transformers.MistralConfig(**llama, sliding_window=window)
    if arch in (QWEN2, QWEN3):  # max_window_layers 0: every layer slides (layer_types from it)
        qwen = dict(use_sliding_window=window is not None, sliding_window=window,
                    max_window_layers=0 if window is not None else m.num_layers)
        if arch == QWEN2:  # Qwen2Config has no head_dim field; modeling_qwen2.py reads one that config.json has
            if m.kv_channels * m.num_attention_heads == m.hidden_size:
                del llama["head_dim"]
            return transformers.Qwen2Config(**llama, **qwen)
        return transformers.Qwen3Config(**llama, **qwen, attention_bias=False)
    return transformers.LlamaConfig(**llama, attention_bias=m.add_bias_linear, mlp_bias=m.add_bias_linear)


def model_config_from_hf(d: dict) -> tuple[str, ModelConfig]:
    """(architecture, our resolved ModelConfig) from a transformers config.json dict."""
    kind = d.get("model_type")
    if kind == "gpt2":
        return GPT2, resolve_model_config(_gpt2_config(d))
    if kind in (LLAMA, QWEN2, QWEN3, MISTRAL):
        return kind, resolve_model_config(_llama_config(d, kind))
    if kind in (MIXTRAL, QWEN2_MOE, QWEN3_MOE, moe_hf.OLMOE):
        moe_hf.check_importable(d, kind)
        return kind, resolve_model_config(moe_hf.model_config(kind, _moe_attention(d, kind), d))
    if kind in _DEEPSEEK:
        m = deepseek.model_config(d)
        if any(moe_hf.layer_pattern(d, kind)):
            m = moe_hf.model_config(kind, m, d)
        return kind, resolve_model_config(m)
    raise ConfigError(f"model_type {kind!r}: only {', '.join(ARCHITECTURES)} models import")


def _moe_attention(d: dict, kind: str) -> ModelConfig:
    """The Llama-like part of an MoE class's config: Mixtral's is Mistral's; Qwen2-MoE's and Qwen3-MoE's are
    Qwen2's and Qwen3's, with head_dim hidden / heads unless given (``Qwen3MoeAttention``) and Qwen2-MoE's
    q/k/v biases only with qkv_bias (default true)."""
    if kind == MIXTRAL:
        return _llama_config(d, kind)
    if kind == OLMOE:  # Llama's attention without biases; its q/k norms: moe_hf.model_config
        return _llama_config(d, LLAMA)
    d = {**d, "head_dim": d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]}
    base = _llama_config(d, QWEN2 if kind == QWEN2_MOE else QWEN3)
    return dataclasses.replace(base, add_qkv_bias=False) if not d.get("qkv_bias", True) else base


def _gpt2_config(d: dict) -> ModelConfig:
    act = d.get("activation_function", "gelu_new")
    if act not in _GPT2_ACTIVATIONS:
        raise ConfigError(f"activation_function {act!r}: only GPT-2 models with activation_function "
                          f"{', '.join(map(repr, _GPT2_ACTIVATIONS))} import exactly")
    if d.get("scale_attn_by_inverse_layer_idx") or d.get("reorder_and_upcast_attn") or not d.get(
            "scale_attn_weights", True):
        raise ConfigError("GPT-2 attention variants (scale_attn_by_inverse_layer_idx, reorder_and_upcast_attn, "
                          "scale_attn_weights false) have no equivalent here")
    h = d["n_embd"]
    return ModelConfig(num_layers=d["n_layer"], hidden_size=h, num_attention_heads=d["n_head"],
                       ffn_hidden_size=d.get("n_inner") or 4 * h, seq_length=d["n_positions"],
                       max_position_embeddings=d["n_positions"], layernorm_epsilon=d.get("layer_norm_epsilon", 1e-5),
                       hidden_dropout=d.get("resid_pdrop", 0.1), attention_dropout=d.get("attn_pdrop", 0.1),
                       init_method_std=d.get("initializer_range", 0.02), **_GPT2_ACTIVATIONS[act])


def _rope_config(d: dict) -> dict:
    """Our rotary fields of a config's ``rope_parameters`` (transformers 5) or ``rope_scaling`` +
    ``rope_theta`` (the hub's config.json files of transformers 4)."""
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    theta = float(d.get("rope_theta") or rope.get("rope_theta", 10000.0))
    if rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ConfigError(f"partial_rotary_factor {rope.get('partial_rotary_factor', d.get('partial_rotary_factor'))}:"
                          f" only whole-head rotary embeddings import")
    if kind == "default":
        return dict(rope_theta=theta)
    if kind == "linear":
        return dict(rope_theta=theta, rotary_seq_len_interpolation_factor=float(rope["factor"]))
    if kind == "llama3":
        return dict(rope_theta=theta, use_rope_scaling=True, rope_scaling_factor=float(rope["factor"]),
                    rope_scaling_low_freq_factor=float(rope["low_freq_factor"]),
                    rope_scaling_high_freq_factor=float(rope["high_freq_factor"]),
                    rope_scaling_original_max_position_embeddings=int(rope["original_max_position_embeddings"]))
    raise ConfigError(f"rope_scaling rope_type {kind!r}: only 'default', 'linear' (--rotary-seq-len-interpolation-"
                      f"factor) and 'llama3' (--use-rope-scaling) have an equivalent here")


def _hf_window(d: dict, kind: str) -> int | None:
    """The sliding window a config applies (transformers' defaults where a field is absent), None without."""
    if kind in (MISTRAL, MIXTRAL):  # every layer slides when sliding_window is set (Mistral's default 4096)
        return d.get("sliding_window", 4096 if kind == MISTRAL else None)
    if kind not in (QWEN2, QWEN3) or not d.get("use_sliding_window") or d.get("sliding_window") is None:
        return None  # Qwen2Config / Qwen3Config.__post_init__: no window without use_sliding_window
    n, first = d["num_hidden_layers"], d.get("max_window_layers", 28)
    types = d.get("layer_types") or ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    return d["sliding_window"] if "sliding_attention" in types else None


def _biases(d: dict, kind: str) -> dict:
    """--add-bias-linear / --add-qkv-bias of a Llama-like config (each class's own bias layout)."""
    if kind == QWEN2:  # modeling_qwen2.py: q/k/v with biases, o_proj and the MLP without
        return dict(add_bias_linear=False, add_qkv_bias=True)
    if kind == QWEN3 and d.get("attention_bias"):
        raise ConfigError("attention_bias true: Qwen3's biases on q/k/v and o_proj without MLP biases have no "
                          "equivalent here (--add-bias-linear puts them on every linear layer)")
    if kind == LLAMA and bool(d.get("attention_bias")) != bool(d.get("mlp_bias")):
        raise ConfigError("attention_bias and mlp_bias differ; here one flag (--disable-bias-linear) decides both")
    return dict(add_bias_linear=kind == LLAMA and bool(d.get("attention_bias")))


def _llama_config(d: dict, kind: str) -> ModelConfig:
    if d.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act {d['hidden_act']!r}: only SwiGLU (silu) models import")
    heads, positions = d["num_attention_heads"], d["max_position_embeddings"]
    head_dim = d.get("head_dim") or (128 if kind == QWEN3 else d["hidden_size"] // heads)  # Qwen3Config's default
    window, seq = _hf_window(d, kind), positions
    if window is not None:
        # our window must cover --seq-length (then it masks nothing): train at most at the window
        seq = min(positions, window)
    return ModelConfig(num_layers=d["num_hidden_layers"], hidden_size=d["hidden_size"], num_attention_heads=heads,
                       num_key_value_heads=d.get("num_key_value_heads") or heads,
                       ffn_hidden_size=d["intermediate_size"], kv_channels=head_dim,
                       seq_length=seq, max_position_embeddings=positions, position_embedding_type="rope",
                       normalization="rmsnorm", layernorm_epsilon=d.get("rms_norm_eps", 1e-6),
                       swiglu=True, qk_layernorm=kind == QWEN3,
                       window_size=None if window is None else f"({window - 1},0)",
                       untie_embeddings_and_output_weights=not d.get("tie_word_embeddings", False),
                       hidden_dropout=0.0, attention_dropout=float(d.get("attention_dropout", 0.0)),
                       init_method_std=d.get("initializer_range", 0.02), **_rope_config(d), **_biases(d, kind))


def model_flags(m: ModelConfig) -> list[str]:
    """pretrain_gpt.py flags that give model ``m`` (printed by the import tool)."""
    f = [f"--num-layers {m.num_layers}", f"--hidden-size {m.hidden_size}",
         f"--num-attention-heads {m.num_attention_heads}", f"--ffn-hidden-size {m.ffn_hidden_size}",
         f"--seq-length {m.seq_length}", f"--max-position-embeddings {m.max_position_embeddings}"]
    if m.num_key_value_heads != m.num_attention_heads:
        f.append(f"--num-key-value-heads {m.num_key_value_heads}")
    if m.kv_channels * m.num_attention_heads != m.hidden_size:
        f.append(f"--kv-channels {m.kv_channels}")
    if m.position_embedding_type == "rope":
        f += ["--use-rotary-position-embeddings", f"--rotary-base {m.rope_theta:g}"]
    if m.use_rope_scaling:
        f += ["--use-rope-scaling", f"--rope-scaling-factor {m.rope_scaling_factor:g}"]
        f += [f"--{k.replace('_', '-')} {getattr(m, k):g}" for k, v in _LLAMA3_FIXED.items() if getattr(m, k) != v]
    if m.rotary_seq_len_interpolation_factor is not None:
        f.append(f"--rotary-seq-len-interpolation-factor {m.rotary_seq_len_interpolation_factor:g}")
    if m.multi_latent_attention:
        f += deepseek.model_flags(m)
    if m.normalization == "rmsnorm":
        f.append("--normalization rmsnorm")
    f.append(f"--norm-epsilon {m.layernorm_epsilon:g}")
    if m.swiglu:
        f.append("--swiglu")
    if m.openai_gelu or m.squared_relu:
        f.append("--openai-gelu" if m.openai_gelu else "--squared-relu")
    if not m.add_bias_linear:
        f.append("--disable-bias-linear")
    if m.add_qkv_bias and not m.add_bias_linear:
        f.append("--add-qkv-bias")
    if m.qk_layernorm:
        f.append("--qk-layernorm")
    if m.qk_layernorm and m.qk_layernorm_scope != "head":
        f.append(f"--qk-layernorm-scope {m.qk_layernorm_scope}")
    if m.window_size is not None:  # Megatron-LM's tuple_type reads "L,R" as well as "(L,R)"
        f.append(f"--window-size {m.window_size.strip('()')}")
    if m.untie_embeddings_and_output_weights:
        f.append("--untie-embeddings-and-output-weights")
    if is_moe(m) and is_mlm_moe(m):
        f += moe_hf.model_flags(m)
    elif is_moe(m):
        f += [f"--num-experts {' '.join(map(str, m.num_experts))}", f"--expert-interval {m.expert_interval}",
              f"--topk {m.topk}", f"--moe-loss-coeff {m.moe_loss_coeff:g}"]
        f += [flag for flag, on in (("--disable-moe-token-dropping", m.disable_moe_token_dropping),
                                    ("--disable-moe-top2-2nd-expert-sampling", m.disable_moe_top2_2nd_expert_sampling))
              if on]
    return f
