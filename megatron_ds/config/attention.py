"""The attention variants of open models (Llama 3.x, Qwen2.5/Qwen3, Mistral) as the flags ask for them:
their checks and the words --dry-run and the start-up line say about them (``Layout.summary``).
The layers themselves are ``model/transformer.py``'s and ``model/rotary.py``'s.
"""
from __future__ import annotations

from megatron_ds.config.schema import ModelConfig
from megatron_ds.errors import ConfigError


def window_size(m: ModelConfig) -> tuple[int, int] | None:
    """--window-size "(left,right)" as Megatron-LM's ``tuple_type`` reads it (megatron/training/arguments.py):
    the parentheses stripped, integers split at commas."""
    if m.window_size is None:
        return None
    try:
        left, right = (int(i) for i in m.window_size.strip().strip("()").split(","))
    except ValueError:
        raise ConfigError(f"--window-size {m.window_size!r}: expected two integers \"(left,right)\", e.g. "
                          f"\"(4095,0)\"") from None
    return left, right


def check_attention(m: ModelConfig) -> None:
    """Refuse what the attention cannot run: a sliding window that would mask anything (``m`` resolved:
    its seq_length set) and RoPE scaling factors outside their formula's domain. (The families other
    than the GPT refuse these flags: ``layout.gpt_only_refusals``.)

    A query at position i sees keys i - left .. i + right (Megatron-LM's get_sliding_window_causal_mask,
    megatron/core/transformer/utils.py, which replaces the causal mask). Over --seq-length positions the
    window is then the GPT's causal mask when left >= seq - 1 and right == 0; any other window would need
    a banded mask, which this attention (SDPA's causal kernel) does not build. -1 is Transformer Engine's
    "no limit" (Megatron-LM's default --transformer-impl passes the window to its attention as it is)."""
    window = window_size(m)
    if window is not None:
        full = m.seq_length - 1
        left, right = (full if w == -1 else w for w in window)
        if left < full or right != 0:
            raise ConfigError(f"--window-size {m.window_size}: sliding-window attention narrower than --seq-length "
                              f"is not supported; use a window that covers the {m.seq_length} positions "
                              f"(--window-size \"({full},0)\" or wider, which masks nothing) or drop the flag")
    if m.qk_layernorm_scope == "projection" and not m.qk_layernorm:
        raise ConfigError("--qk-layernorm-scope projection chooses what --qk-layernorm normalizes; add "
                          "--qk-layernorm or drop it")
    if m.qk_layernorm_scope == "projection" and m.normalization.lower() != "rmsnorm":
        raise ConfigError(f"--qk-layernorm-scope projection is an RMSNorm (OLMo 2's / OLMoE's); with --normalization "
                          f"{m.normalization} use --qk-layernorm-scope head")
    if m.use_rope_scaling and m.rope_scaling_high_freq_factor <= m.rope_scaling_low_freq_factor:
        raise ConfigError(f"--rope-scaling-high-freq-factor {m.rope_scaling_high_freq_factor} must exceed "
                          f"--rope-scaling-low-freq-factor {m.rope_scaling_low_freq_factor} (Llama 3.1's 4 and 1)")


def check_mla(m: ModelConfig, *, ulysses: int, fp8: bool) -> None:
    """Refuse --rope-type yarn without --multi-latent-attention (Megatron-LM's argument_utils asserts the same),
    and with it what multi-latent attention (``model/mla.py``) does not read or run, each in one line."""
    if not m.multi_latent_attention:
        if m.rope_type == "yarn":
            raise ConfigError("--rope-type yarn applies to --multi-latent-attention only (Megatron-LM's other "
                              "attention takes rope only); drop it or add --multi-latent-attention")
        return
    unread = {"--group-query-attention / --num-key-value-heads (MLA's heads share one latent instead)":
              m.num_key_value_heads != m.num_attention_heads,
              "--qk-layernorm": m.qk_layernorm, "--add-qkv-bias": m.add_qkv_bias, "--window-size": m.window_size,
              "--use-rope-scaling": m.use_rope_scaling,
              "--rotary-seq-len-interpolation-factor": m.rotary_seq_len_interpolation_factor is not None,
              "--rotary-percent other than 1": m.rotary_percent != 1.0,
              "FP8 (--fp8-format)": fp8,
              "--ds-sequence-parallel-size > 1 (DeepSpeed-Ulysses)": ulysses > 1}
    bad = [flag for flag, on in unread.items() if on]
    if bad:
        raise ConfigError(f"--multi-latent-attention does not support {', '.join(bad)}; drop it")
    if m.qk_pos_emb_head_dim % 2 or m.qk_pos_emb_head_dim <= 0:
        raise ConfigError(f"--qk-pos-emb-head-dim {m.qk_pos_emb_head_dim}: rotary channels rotate in pairs; use a "
                          f"positive even number")


def describe_attention(m: ModelConfig) -> str:
    """The attention's variants in a few words ("" for none), for the model's summary line."""
    if m.multi_latent_attention:
        q = "q plain" if m.q_lora_rank is None else f"q rank {m.q_lora_rank}"
        rope = (f"YaRN x{m.rotary_scaling_factor:g} (mscale {m.mscale:g}, all dim {m.mscale_all_dim:g})"
                if (m.rope_type or "yarn") == "yarn" else "RoPE")
        return (f"multi-latent attention ({q}, kv rank {m.kv_lora_rank}, head dims qk {m.qk_head_dim} + rope "
                f"{m.qk_pos_emb_head_dim}, v {m.v_head_dim}; {rope})")
    parts = []
    if m.kv_channels * m.num_attention_heads != m.hidden_size:
        parts.append(f"head dim {m.kv_channels} (heads x head dim {m.kv_channels * m.num_attention_heads} != "
                     f"hidden {m.hidden_size})")
    if m.add_qkv_bias and not m.add_bias_linear:
        parts.append("QKV bias")
    if m.qk_layernorm:
        scope = "over the whole projection" if m.qk_layernorm_scope == "projection" else "per head"
        parts.append(f"QK {m.normalization} {scope} ({'with' if m.apply_wd_to_qk_layernorm else 'no'} weight decay)")
    if m.position_embedding_type == "rope":
        if m.use_rope_scaling:
            parts.append(f"RoPE llama3 scaling x{m.rope_scaling_factor:g} (low {m.rope_scaling_low_freq_factor:g}, "
                         f"high {m.rope_scaling_high_freq_factor:g}, original "
                         f"{m.rope_scaling_original_max_position_embeddings} positions)")
        if m.rotary_seq_len_interpolation_factor is not None:
            parts.append(f"RoPE positions / {m.rotary_seq_len_interpolation_factor:g} (linear)")
    window = window_size(m)
    if window is not None:
        parts.append(f"window {window} covers seq {m.seq_length}: masks nothing")
    return "; ".join(parts)
