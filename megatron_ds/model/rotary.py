"""Rotary position embeddings (RoPE), Megatron/Llama convention.

Channel ``i`` of the rotated part pairs with channel ``i + rot_dim/2`` ("rotate half", not the
interleaved even/odd pairing of the original paper), which is what Megatron-LM and Hugging Face
Llama checkpoints expect. Only the first ``rotary_percent`` of each head's channels rotate.

Positions are ``0 .. seq-1`` for every sample, as in Megatron: rotary embeddings ignore
``position_ids`` (also under ``--reset-position-ids``), which is why no position tensor needs to
travel between pipeline stages.

Long-context variants (``RopeScaling``): Llama 3.1's frequency scaling (--use-rope-scaling) changes the
inverse frequencies, linear interpolation (--rotary-seq-len-interpolation-factor) the positions, as
Megatron-LM's RotaryEmbedding does (megatron/core/models/common/embeddings/rotary_pos_embedding.py:
``_apply_scaling`` and ``get_freqs_non_repeated``); both may be on at once there and here.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch


class RopeScaling(NamedTuple):
    """What changes the tables besides (length, dim, base): part of their cache key. ``factor`` None:
    no Llama 3.1 scaling; ``linear`` None: positions as they are; ``yarn_factor`` None: no YaRN (multi-latent
    attention's, ``model/mla.py``: its frequencies and its concentration factor from ``mscale`` /
    ``mscale_all_dim``)."""
    factor: float | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 8192
    linear: float | None = None
    yarn_factor: float | None = None
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


# MLATransformerConfig's YaRN fields that no Megatron-LM flag sets for multi-latent attention (model/mla.py)
YARN_ORIGINAL_MAX_POSITIONS, YARN_BETA_FAST, YARN_BETA_SLOW = 4096, 32.0, 1.0


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """Megatron-LM's ``_yarn_get_mscale`` (DeepSeek's ``yarn_get_mscale``)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inverse_frequencies(inv_freq: torch.Tensor, dim: int, base: float, factor: float) -> torch.Tensor:
    """``YarnRotaryEmbedding.get_emb``'s frequencies: extrapolated (``base``'s) below the correction range,
    interpolated (divided by ``factor``) above it, linearly blended across it."""
    def correction_dim(rotations: float) -> float:  # _yarn_find_correction_dim
        return dim * math.log(YARN_ORIGINAL_MAX_POSITIONS / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(YARN_BETA_FAST)), 0)
    high = min(math.ceil(correction_dim(YARN_BETA_SLOW)), dim - 1)
    if low == high:
        high += 0.001  # _yarn_linear_ramp_mask's guard
    ramp = torch.arange(dim // 2, dtype=torch.float32, device=inv_freq.device)
    keep = 1.0 - ((ramp - low) / (high - low)).clamp(0, 1)
    return inv_freq / factor * (1 - keep) + inv_freq * keep


def rope_scaling(cfg) -> RopeScaling | None:
    """A ``ModelConfig``'s scaling (None: plain RoPE, the tables' key as before scaling existed)."""
    if not cfg.use_rope_scaling and cfg.rotary_seq_len_interpolation_factor is None:
        return None
    return RopeScaling(float(cfg.rope_scaling_factor) if cfg.use_rope_scaling else None,
                       float(cfg.rope_scaling_low_freq_factor), float(cfg.rope_scaling_high_freq_factor),
                       int(cfg.rope_scaling_original_max_position_embeddings),
                       None if cfg.rotary_seq_len_interpolation_factor is None
                       else float(cfg.rotary_seq_len_interpolation_factor))


def rotary_dim(kv_channels: int, rotary_percent: float) -> int:
    """Number of channels per head that rotate (must be even: they rotate in pairs)."""
    dim = int(kv_channels * rotary_percent)
    if dim <= 0 or dim % 2:
        raise ValueError(f"--rotary-percent {rotary_percent} of kv channels {kv_channels} gives {dim} rotary "
                         f"channels; it must be a positive even number")
    return dim


_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_MAX_TABLES = 16  # a sequence-length warm-up asks for many lengths: keep the latest ones


def rotary_cos_sin_of_cp_rank(cp, s: int, dim: int, theta: float, device,
                              scaling: RopeScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``rotary_cos_sin``'s rows at a context parallel rank's global positions (``cp``:
    parallel/context_parallel.py's ``ContextParallel``; its two chunks of a sequence of ``s`` x CP), as Megatron-LM's
    rotary embeddings take them (``get_pos_emb_on_this_cp_rank``)."""
    cos, sin = rotary_cos_sin(s * cp.size, dim, theta, device, scaling)
    positions = cp.positions(s * cp.size, cos.device)
    return cos[positions], sin[positions]


def rotary_cos_sin(seq_len: int, dim: int, theta: float, device,
                   scaling: RopeScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, fp32, shaped ``[seq, 1, 1, dim]`` to broadcast over ``[seq, batch, heads, dim]``.

    Computed as plain functions of (length, dim, base) and cached, rather than kept as module
    buffers: DeepSpeed casts modules to fp16/bf16, and angles in half precision lose whole
    positions at long sequence lengths. The cache is a plain dict, not ``functools.lru_cache``:
    dynamo (a layer compiled by ``model/compile_layers.py``) takes an entry that exists as an input
    of the layer's graph, where it traces through an lru_cache wrapper and recomputes the tables
    inside every layer's forward (and recompute); ``compile_layers`` fills the entry first.
    """
    key = (seq_len, dim, float(theta), str(torch.device(device)), scaling)
    tables = _TABLES.get(key)
    if tables is None:
        if len(_TABLES) >= _MAX_TABLES:
            _TABLES.pop(next(iter(_TABLES)))
        tables = _TABLES[key] = _cos_sin(seq_len, dim, theta, torch.device(device), scaling)
    return tables


def clear_rotary_tables() -> None:
    """Forget the cached tables (tests that made them on fake devices)."""
    _TABLES.clear()


def inverse_frequencies(dim: int, theta: float, scaling: RopeScaling | None = None, device=None) -> torch.Tensor:
    """The ``dim / 2`` rotation frequencies, fp32, with Llama 3.1's scaling where ``scaling.factor`` is set:
    Megatron-LM's ``RotaryEmbedding._apply_scaling`` (from transformers' ``_compute_llama3_parameters``):
    wavelengths above ``original / low_freq_factor`` slow down by ``factor``, those under ``original /
    high_freq_factor`` stay, those between blend the two by ``original / wavelength``."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    if scaling is not None and scaling.yarn_factor is not None:
        return _yarn_inverse_frequencies(inv_freq, dim, theta, scaling.yarn_factor)
    if scaling is None or scaling.factor is None:
        return inv_freq
    factor, low, high, original = (scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor,
                                   scaling.original_max_positions)
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < original / high) & ~(wavelen > original / low)
    return torch.where(medium, smoothed, scaled)


def rotary_positions(seq_len: int, scaling: RopeScaling | None = None, device=None) -> torch.Tensor:
    """Positions 0 .. seq-1, fp32; linear interpolation multiplies them by ``1 / scaling.linear`` (Megatron-LM's
    ``seq *= 1 / self.seq_len_interpolation_factor``)."""
    seq = torch.arange(seq_len, dtype=torch.float32, device=device)
    if scaling is not None and scaling.linear is not None:
        seq *= 1 / scaling.linear
    return seq


def _cos_sin(seq_len: int, dim: int, theta: float, device: torch.device,
             scaling: RopeScaling | None) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.outer(rotary_positions(seq_len, scaling, device), inverse_frequencies(dim, theta, scaling, device))
    angles = torch.cat((angles, angles), dim=-1)[:, None, None, :]
    if scaling is not None and scaling.yarn_factor is not None:  # YaRN's concentration factor
        c = yarn_mscale(scaling.yarn_factor, scaling.mscale) / yarn_mscale(scaling.yarn_factor, scaling.mscale_all_dim)
        return angles.cos() * c, angles.sin() * c
    return angles.cos(), angles.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``t`` of shape ``[seq, batch, heads, head_dim]`` by the tables from ``rotary_cos_sin``."""
    dim = cos.shape[-1]
    t_rot, t_pass = t[..., :dim], t[..., dim:]
    t_rot = t_rot * cos.to(t.dtype) + _rotate_half(t_rot) * sin.to(t.dtype)
    return t_rot if t_pass.shape[-1] == 0 else torch.cat((t_rot, t_pass), dim=-1)
