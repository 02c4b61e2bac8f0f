"""Rotary position embeddings (RoPE), Megatron/Llama convention.

Channel ``i`` of the rotated part pairs with channel ``i + rot_dim/2`` ("rotate half", not the
interleaved even/odd pairing of the original paper), which is what Megatron-LM and Hugging Face
Llama checkpoints expect. Only the first ``rotary_percent`` of each head's channels rotate.

Positions are ``0 .. seq-1`` for every sample, as in Megatron: rotary embeddings ignore
``position_ids`` (also under ``--reset-position-ids``), which is why no position tensor needs to
travel between pipeline stages.
"""
from __future__ import annotations

import torch


def rotary_dim(kv_channels: int, rotary_percent: float) -> int:
    """Number of channels per head that rotate (must be even: they rotate in pairs)."""
    dim = int(kv_channels * rotary_percent)
    if dim <= 0 or dim % 2:
        raise ValueError(f"--rotary-percent {rotary_percent} of kv channels {kv_channels} gives {dim} rotary "
                         f"channels; it must be a positive even number")
    return dim


_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_MAX_TABLES = 16  # a sequence-length warm-up asks for many lengths: keep the latest ones


def rotary_cos_sin(seq_len: int, dim: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, fp32, shaped ``[seq, 1, 1, dim]`` to broadcast over ``[seq, batch, heads, dim]``.

    Computed as plain functions of (length, dim, base) and cached, rather than kept as module
    buffers: DeepSpeed casts modules to fp16/bf16, and angles in half precision lose whole
    positions at long sequence lengths. The cache is a plain dict, not ``functools.lru_cache``:
    dynamo (a layer compiled by ``model/compile_layers.py``) takes an entry that exists as an input
    of the layer's graph, where it traces through an lru_cache wrapper and recomputes the tables
    inside every layer's forward (and recompute); ``compile_layers`` fills the entry first.
    """
    key = (seq_len, dim, float(theta), str(torch.device(device)))
    tables = _TABLES.get(key)
    if tables is None:
        if len(_TABLES) >= _MAX_TABLES:
            _TABLES.pop(next(iter(_TABLES)))
        tables = _TABLES[key] = _cos_sin(seq_len, dim, theta, torch.device(device))
    return tables


def clear_rotary_tables() -> None:
    """Forget the cached tables (tests that made them on fake devices)."""
    _TABLES.clear()


def _cos_sin(seq_len: int, dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)[:, None, None, :]
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
