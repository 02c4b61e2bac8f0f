"""``DeepseekV3ForCausalLM`` (transformers models/deepseek_v3) and ``DeepseekV2ForCausalLM`` (models/deepseek_v2:
the same attention, MLP, tensor names and YaRN, its RoPE on the interleaved pairs as complex numbers, which is
V3's ``rope_interleave``): its multi-latent attention is ours (``model/mla.py``), its dense MLP Llama's SwiGLU; its MoE
layers (after the first ``first_k_dense_replace``) are Megatron-LM's MoE layer with shared experts and group-limited
top-k (``moe_hf``).

Tensor names: ``self_attn.q_proj`` (``q_lora_rank`` None) or ``q_a_proj`` + ``q_a_layernorm`` + ``q_b_proj``,
``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``; same rows and columns as Megatron-LM's
``linear_q_proj`` / ``linear_q_down_proj`` / ``q_layernorm`` / ``linear_q_up_proj`` / ``linear_kv_down_proj`` /
``kv_layernorm`` / ``linear_kv_up_proj`` / ``linear_proj`` (its own HF converter maps them one to one). The rotary
channels are DeepSeek's interleaved pairs (``rope_interleave`` true, Megatron-LM's ``mla_rotary_interleaved``).

RoPE: ``rope_type`` "default" is --rope-type rope; "yarn" is --rope-type yarn with its factor, mscale and
mscale_all_dim, at Megatron-LM's fixed original context 4096 and betas 32/1 (``model/mla.py``), which other
values cannot follow. transformers scales cos/sin by ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)``
only when both are given (``_compute_yarn_parameters``), Megatron-LM always: a config with mscale but no
mscale_all_dim is refused.
"""
from __future__ import annotations

from megatron_ds.config.schema import ModelConfig
from megatron_ds.errors import ConfigError
from megatron_ds.model.rotary import YARN_BETA_FAST, YARN_BETA_SLOW, YARN_ORIGINAL_MAX_POSITIONS

CLASS, V2_CLASS = "DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"

_ATTENTION = {"linear_q_proj": "q_proj", "linear_q_down_proj": "q_a_proj", "q_layernorm": "q_a_layernorm",
              "linear_q_up_proj": "q_b_proj", "linear_kv_down_proj": "kv_a_proj_with_mqa",
              "kv_layernorm": "kv_a_layernorm", "linear_kv_up_proj": "kv_b_proj", "dense": "o_proj"}


def layer_names(i: int) -> dict[str, str]:
    """Our names inside transformer layer ``i`` (0-based) -> HF names (the MLP's SwiGLU is gpt_hf's)."""
    p = f"model.layers.{i}."
    names = {f"self_attention.{ours}.weight": f"{p}self_attn.{theirs}.weight" for ours, theirs in _ATTENTION.items()}
    return {**names, "input_layernorm.weight": p + "input_layernorm.weight",
            "post_attention_layernorm.weight": p + "post_attention_layernorm.weight",
            "mlp.dense_4h_to_h.weight": p + "mlp.down_proj.weight"}


def problems(m: ModelConfig, name: str = CLASS) -> list[str]:
    """What DeepseekV3ForCausalLM (or ``name``: DeepseekV2ForCausalLM, the same attention and MLP) cannot express of
    ``m``, by flag."""
    out = []
    if not m.multi_latent_attention:
        out.append(f"no --multi-latent-attention ({name} has DeepSeek's multi-latent attention)")
    if m.position_embedding_type != "rope":
        out.append(f"--position-embedding-type {m.position_embedding_type} ({name} adds no learned positions: rope)")
    if m.normalization != "rmsnorm":
        out.append(f"--normalization {m.normalization} ({name} has RMSNorm)")
    if not m.swiglu:
        out.append(f"a GeLU MLP without --swiglu ({name} has SwiGLU)")
    if m.add_bias_linear:
        out.append(f"biases (no --disable-bias-linear; {name}'s MLP has none)")
    if (m.rope_type or "yarn") == "yarn" and m.mscale != 1.0 and m.mscale_all_dim == 0.0:
        out.append(f"--mscale {m.mscale:g} without --mscale-all-dim (transformers' YaRN then ignores mscale)")
    return out


def _rope_parameters(m: ModelConfig) -> dict:
    if (m.rope_type or "yarn") == "rope":
        return {"rope_type": "default", "rope_theta": m.rope_theta}
    return {"rope_type": "yarn", "rope_theta": m.rope_theta, "factor": m.rotary_scaling_factor,
            "original_max_position_embeddings": YARN_ORIGINAL_MAX_POSITIONS, "beta_fast": YARN_BETA_FAST,
            "beta_slow": YARN_BETA_SLOW, "mscale": m.mscale, "mscale_all_dim": m.mscale_all_dim}


def hf_config(m: ModelConfig, common: dict, moe: dict | None = None, *, v2: bool = False):
    """``moe``: the MoE layers' fields (``moe_hf.config_kwargs``); without, every layer is dense. ``v2``:
    DeepseekV2Config, whose rotary channels are always DeepSeek's interleaved pairs (its complex-number RoPE)."""
    import transformers  # noqa: PLC0415 - optional dependency, needed only here

    cls, interleave = (transformers.DeepseekV2Config, {}) if v2 else (transformers.DeepseekV3Config,
                                                                       {"rope_interleave": True})
    return cls(**interleave,
        hidden_size=m.hidden_size, intermediate_size=m.ffn_hidden_size, num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads, **(moe or {"first_k_dense_replace": m.num_layers}),
        num_key_value_heads=m.num_attention_heads, q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank,
        qk_nope_head_dim=m.qk_head_dim, qk_rope_head_dim=m.qk_pos_emb_head_dim, v_head_dim=m.v_head_dim,
        hidden_act="silu", max_position_embeddings=m.max_position_embeddings, rms_norm_eps=m.layernorm_epsilon,
        tie_word_embeddings=not m.untie_embeddings_and_output_weights, rope_parameters=_rope_parameters(m),
        attention_bias=False, attention_dropout=m.attention_dropout, **common)


def _rope_config(d: dict) -> dict:
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    theta = float(d.get("rope_theta") or rope.get("rope_theta", 10000.0))
    if kind == "default":
        return dict(rope_type="rope", rope_theta=theta)
    if kind != "yarn":
        raise ConfigError(f"rope_scaling rope_type {kind!r}: DeepSeek models import with 'default' or 'yarn'")
    fixed = dict(original_max_position_embeddings=YARN_ORIGINAL_MAX_POSITIONS, beta_fast=YARN_BETA_FAST,
                 beta_slow=YARN_BETA_SLOW)
    other = {k: rope[k] for k, v in fixed.items() if k in rope and float(rope[k]) != v}
    if other or rope.get("attention_factor") is not None:
        raise ConfigError(f"rope_scaling {other or {'attention_factor': rope['attention_factor']}}: Megatron-LM's "
                          f"multi-latent attention fixes YaRN's original context at 4096 and betas at 32/1, with "
                          f"the attention factor from mscale / mscale_all_dim")
    mscale, mscale_all_dim = float(rope.get("mscale") or 1.0), float(rope.get("mscale_all_dim") or 0.0)
    if rope.get("mscale") is not None and not rope.get("mscale_all_dim"):
        mscale = 1.0  # transformers ignores mscale alone (module docstring): so does the model it computes
    return dict(rope_type="yarn", rope_theta=theta, rotary_scaling_factor=float(rope["factor"]), mscale=mscale,
                mscale_all_dim=mscale_all_dim)


def model_config(d: dict) -> ModelConfig:
    """Our ModelConfig (unresolved) from a deepseek_v3 config.json dict; ConfigError for what has no equivalent."""
    n = d["num_hidden_layers"]
    if d.get("hidden_act", "silu") != "silu" or d.get("attention_bias") or d.get("mlp_bias"):
        raise ConfigError("hidden_act other than silu, attention_bias or mlp_bias true: no equivalent here")
    if not d.get("rope_interleave", True):
        raise ConfigError("rope_interleave false: Megatron-LM's multi-latent attention rotates DeepSeek's "
                          "interleaved channel pairs only")
    heads = d["num_attention_heads"]
    if d.get("num_key_value_heads", heads) != heads:
        raise ConfigError(f"num_key_value_heads {d['num_key_value_heads']} != num_attention_heads {heads}: no "
                          f"equivalent in multi-latent attention")
    positions = d["max_position_embeddings"]
    return ModelConfig(num_layers=n, hidden_size=d["hidden_size"], num_attention_heads=heads,
                       ffn_hidden_size=d["intermediate_size"], seq_length=positions, max_position_embeddings=positions,
                       position_embedding_type="rope", normalization="rmsnorm",
                       layernorm_epsilon=d.get("rms_norm_eps", 1e-6), swiglu=True, add_bias_linear=False,
                       multi_latent_attention=True, q_lora_rank=d.get("q_lora_rank"), kv_lora_rank=d["kv_lora_rank"],
                       qk_head_dim=d["qk_nope_head_dim"], qk_pos_emb_head_dim=d["qk_rope_head_dim"],
                       v_head_dim=d["v_head_dim"],
                       untie_embeddings_and_output_weights=not d.get("tie_word_embeddings", False),
                       hidden_dropout=0.0, attention_dropout=float(d.get("attention_dropout", 0.0)),
                       init_method_std=d.get("initializer_range", 0.02), **_rope_config(d))


def model_flags(m: ModelConfig) -> list[str]:
    """The multi-latent attention flags of ``m`` (gpt_hf.model_flags prints the rest)."""
    f = ["--multi-latent-attention"] + ([] if m.q_lora_rank is None else [f"--q-lora-rank {m.q_lora_rank}"])
    f += [f"--kv-lora-rank {m.kv_lora_rank}", f"--qk-head-dim {m.qk_head_dim}",
          f"--qk-pos-emb-head-dim {m.qk_pos_emb_head_dim}", f"--v-head-dim {m.v_head_dim}",
          f"--rope-type {m.rope_type or 'yarn'}"]
    if (m.rope_type or "yarn") == "yarn":
        f += [f"--rotary-scaling-factor {m.rotary_scaling_factor:g}", f"--mscale {m.mscale:g}",
              f"--mscale-all-dim {m.mscale_all_dim:g}"]
    return f
