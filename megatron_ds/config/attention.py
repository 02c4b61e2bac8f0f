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
    if m.use_rope_scaling and m.rope_scaling_high_freq_factor <= m.rope_scaling_low_freq_factor:
        raise ConfigError(f"--rope-scaling-high-freq-factor {m.rope_scaling_high_freq_factor} must exceed "
                          f"--rope-scaling-low-freq-factor {m.rope_scaling_low_freq_factor} (Llama 3.1's 4 and 1)")


def describe_attention(m: ModelConfig) -> str:
    """The attention's variants in a few words ("" for none), for the model's summary line."""
    parts = []
    if m.kv_channels * m.num_attention_heads != m.hidden_size:
        parts.append(f"head dim {m.kv_channels} (heads x head dim {m.kv_channels * m.num_attention_heads} != "
                     f"hidden {m.hidden_size})")
    if m.add_qkv_bias and not m.add_bias_linear:
        parts.append("QKV bias")
    if m.qk_layernorm:
        parts.append(f"QK {m.normalization} per head ({'with' if m.apply_wd_to_qk_layernorm else 'no'} weight decay)")
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
