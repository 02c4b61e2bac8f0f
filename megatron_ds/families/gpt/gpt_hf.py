"""Tensor and config mapping between the GPT family's models and Hugging Face transformers models.

Two targets, chosen by the model's shape:

- ``GPT2LMHeadModel``: learned absolute positions, LayerNorm, GeLU MLP, biases, tied embeddings,
  multi-head attention with ``kv_channels * heads == hidden``. GPT-2's ``Conv1D`` layers store
  their weights transposed (``[in, out]``), and its ``c_attn`` is ``[Q(all heads); K; V]``.
- ``MixtralForCausalLM``: a Llama-style model with DeepSpeed-MoE layers (``megatron_ds.families.gpt.mixtral_hf``).
- ``LlamaForCausalLM``: rotary positions (full head dimension, "rotate half" -- the convention of
  both ``model/rotary.py`` and HF Llama, so no permutation of q/k rows is needed), RMSNorm,
  SwiGLU, optional grouped-query attention, tied or untied output layer; biases map to Llama's
  ``attention_bias`` / ``mlp_bias``.

Our fused QKV weight is laid out per key/value group (``model/transformer.py``): for group g,
``heads_per_group`` query heads, then its key head, then its value head. Query head ``g *
heads_per_group + j`` therefore uses key/value head g, HF's grouped-query convention. SwiGLU's
``dense_h_to_4h`` is ``[gate; up]`` (the forward does ``silu(first half) * second half``).
The padding rows of the vocabulary are dropped on export (HF's vocabulary is the real one).
"""
from __future__ import annotations

import torch

from megatron_ds.checkpoint.hf_files import fuse_qkv, split_qkv
from megatron_ds.config.layout import resolve_model_config
from megatron_ds.config.moe_params import is_moe
from megatron_ds.config.schema import ModelConfig
from megatron_ds.errors import ConfigError
from megatron_ds.families.gpt import mixtral_hf as mixtral

GPT2, LLAMA, MIXTRAL = "gpt2", "llama", "mixtral"
ARCHITECTURES = {GPT2: "GPT2LMHeadModel", LLAMA: "LlamaForCausalLM", MIXTRAL: "MixtralForCausalLM"}
# GPT-2's activation_function for our MLP activations: "gelu" is the exact (erf) GeLU, "gelu_new" GPT-2's
# tanh approximation (--openai-gelu), "relu2" transformers' ReLUSquaredActivation (--squared-relu)
_GPT2_ACTIVATIONS = {"gelu": {}, "gelu_new": {"openai_gelu": True}, "gelu_pytorch_tanh": {"openai_gelu": True},
                     "relu2": {"squared_relu": True}}


def choose_architecture(m: ModelConfig) -> str:
    """The transformers class that can express ``m`` exactly; ConfigError naming what cannot."""
    if is_moe(m):
        mixtral.check_expressible(m)
        return MIXTRAL
    if m.apply_residual_connection_post_layernorm:
        raise ConfigError("--apply-residual-connection-post-layernorm: neither GPT2LMHeadModel nor LlamaForCausalLM "
                          "can express it (both add the residual from before the norm)")
    if m.position_embedding_type == "learned_absolute":
        problems = []
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
        if problems:
            raise ConfigError("learned absolute positions export as GPT2LMHeadModel, which cannot express "
                              + "; ".join(problems))
        return GPT2
    if m.position_embedding_type == "rope":
        problems = []
        if m.normalization != "rmsnorm":
            problems.append(f"--normalization {m.normalization} (LlamaForCausalLM has RMSNorm)")
        if not m.swiglu:
            problems.append("a GeLU MLP without --swiglu (LlamaForCausalLM has SwiGLU)")
        if m.rotary_percent != 1.0:
            problems.append(f"--rotary-percent {m.rotary_percent} (LlamaForCausalLM rotates whole heads)")
        if problems:
            raise ConfigError("rotary positions export as LlamaForCausalLM, which cannot express "
                              + "; ".join(problems))
        return LLAMA
    raise ConfigError(f"--position-embedding-type {m.position_embedding_type}: neither GPT2LMHeadModel "
                      f"(learned positions) nor LlamaForCausalLM (rotary) can express a model without positions")


def _transformer_layer_names(arch: str, i: int) -> dict[str, str]:
    """Our names inside transformer layer -> HF names (for Llama; GPT-2 is handled by the functions
    below because of Conv1D and the fused c_attn)."""
    p = f"model.layers.{i}."
    return {"input_layernorm.weight": p + "input_layernorm.weight",
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
    if arch == MIXTRAL:  # Llama's attention and norms, Mixtral's MoE block in place of the MLP
        out.update(mixtral.moe_to_hf(i, t))
        t = {k: v for k, v in t.items() if not k.startswith("mlp.")}
    names = _transformer_layer_names(arch, i)
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
    if arch == MIXTRAL:
        t.update(mixtral.moe_from_hf(i, m.num_experts[0], get))
    for ours, theirs in _transformer_layer_names(arch, i).items():
        x = get(theirs)
        if x is not None:
            t[ours] = x
    p = f"model.layers.{i}."
    for suffix in ("weight", "bias"):
        q = get(f"{p}self_attn.q_proj.{suffix}")
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
    # what Llama and Mixtral describe alike (Mixtral: Llama's layers with an MoE MLP)
    llama = dict(
        hidden_size=m.hidden_size, intermediate_size=m.ffn_hidden_size, num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads, num_key_value_heads=m.num_key_value_heads,
        head_dim=m.kv_channels, hidden_act="silu", max_position_embeddings=m.max_position_embeddings,
        rms_norm_eps=m.layernorm_epsilon, tie_word_embeddings=not m.untie_embeddings_and_output_weights,
        rope_parameters={"rope_type": "default", "rope_theta": m.rope_theta},
        attention_dropout=m.attention_dropout, **common)
    if arch == MIXTRAL:
        return transformers.MixtralConfig(**llama, **mixtral.config_kwargs(m))
    return transformers.LlamaConfig(**llama, attention_bias=m.add_bias_linear, mlp_bias=m.add_bias_linear)


def model_config_from_hf(d: dict) -> tuple[str, ModelConfig]:
    """(architecture, our resolved ModelConfig) from a transformers config.json dict."""
    kind = d.get("model_type")
    if kind == "gpt2":
        return GPT2, resolve_model_config(_gpt2_config(d))
    if kind == "llama":
        return LLAMA, resolve_model_config(_llama_config(d))
    if kind == "mixtral":
        return MIXTRAL, resolve_model_config(mixtral.model_config(_llama_config(d), d))
    raise ConfigError(f"model_type {kind!r}: only gpt2, llama and mixtral models import")


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


def _llama_config(d: dict) -> ModelConfig:
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ConfigError(f"rope scaling {rope.get('rope_type', rope.get('type'))!r} has no equivalent here "
                          f"(plain rotary embeddings only)")
    if d.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act {d['hidden_act']!r}: only SwiGLU (silu) Llama models import")
    if bool(d.get("attention_bias")) != bool(d.get("mlp_bias")):
        raise ConfigError("attention_bias and mlp_bias differ; here one flag (--disable-bias-linear) decides both")
    heads, positions = d["num_attention_heads"], d["max_position_embeddings"]
    theta = float(d.get("rope_theta") or rope.get("rope_theta", 10000.0))  # transformers 4 / 5 spelling
    return ModelConfig(num_layers=d["num_hidden_layers"], hidden_size=d["hidden_size"], num_attention_heads=heads,
                       num_key_value_heads=d.get("num_key_value_heads") or heads,
                       ffn_hidden_size=d["intermediate_size"],
                       kv_channels=d.get("head_dim") or d["hidden_size"] // heads,
                       seq_length=positions, max_position_embeddings=positions, position_embedding_type="rope",
                       rope_theta=theta, normalization="rmsnorm", layernorm_epsilon=d.get("rms_norm_eps", 1e-6),
                       swiglu=True, add_bias_linear=bool(d.get("attention_bias")),
                       untie_embeddings_and_output_weights=not d.get("tie_word_embeddings", False),
                       hidden_dropout=0.0, attention_dropout=float(d.get("attention_dropout", 0.0)),
                       init_method_std=d.get("initializer_range", 0.02))


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
    if m.normalization == "rmsnorm":
        f.append("--normalization rmsnorm")
    f.append(f"--norm-epsilon {m.layernorm_epsilon:g}")
    if m.swiglu:
        f.append("--swiglu")
    if m.openai_gelu or m.squared_relu:
        f.append("--openai-gelu" if m.openai_gelu else "--squared-relu")
    if not m.add_bias_linear:
        f.append("--disable-bias-linear")
    if m.untie_embeddings_and_output_weights:
        f.append("--untie-embeddings-and-output-weights")
    if is_moe(m):
        f += [f"--num-experts {' '.join(map(str, m.num_experts))}", f"--expert-interval {m.expert_interval}",
              f"--topk {m.topk}", f"--moe-loss-coeff {m.moe_loss_coeff:g}"]
        f += [flag for flag, on in (("--disable-moe-token-dropping", m.disable_moe_token_dropping),
                                    ("--disable-moe-top2-2nd-expert-sampling", m.disable_moe_top2_2nd_expert_sampling))
              if on]
    return f
