"""Optional fast kernels, detected once, with torch-native fallbacks.

Apex is the classic source of build failures on clusters, so it is never required: when its fused
normalization extension imports, the norms use it; otherwise torch's own LayerNorm/RMSNorm (fused
CUDA kernels in recent torch anyway). Attention always goes through
``torch.nn.functional.scaled_dot_product_attention``, which picks flash / memory-efficient kernels
on GPU and the math kernel on CPU by itself. Bias-GeLU, bias-SwiGLU, bias-dropout-add and RoPE
are compiled with ``torch.compile`` (``fusions.py``), and liger-kernel's fused linear + cross entropy
replaces the output layer and loss where it applies (``liger.py``). ``describe_kernels()`` says what
is active so start-up can log it.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util

import torch
import torch.nn.functional as F

from megatron_ds.model.fusions import describe_fusions
from megatron_ds.model.liger import describe_liger
from megatron_ds.parallel.random import get_rng_tracker


@functools.lru_cache(maxsize=None)
def apex_norm_classes():
    """(FusedLayerNorm, FusedRMSNorm) from apex, or None when apex or its CUDA extension is missing.

    The import of ``apex.normalization`` succeeds even when apex was installed without its CUDA
    extensions (and PyPI's "apex" is an unrelated package); the layers would then fail on first
    use, hours into a job. So the compiled extension itself must be importable too.
    """
    if importlib.util.find_spec("apex") is None:
        return None
    try:
        from apex.normalization import FusedLayerNorm, FusedRMSNorm

        importlib.import_module("fused_layer_norm_cuda")
    except Exception:  # noqa: BLE001 - any broken apex install means "use torch"
        return None
    return FusedLayerNorm, FusedRMSNorm


@functools.lru_cache(maxsize=None)
def sdpa_supports_gqa() -> bool:
    """Whether this torch's scaled_dot_product_attention takes ``enable_gqa`` (torch >= 2.5).

    Native grouped-query attention reads each K/V head once; without it K/V are expanded with
    repeat_interleave (same numbers, more memory)."""
    q = torch.zeros(1, 2, 1, 1)
    kv = torch.zeros(1, 1, 1, 1)
    try:
        F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
    except TypeError:
        return False
    return True


def describe_kernels(model_cfg=None, tp: int = 1, loss_reason: str = "", on_cuda: bool = False) -> dict:
    """Which implementation each fused piece uses in this process (for the start-up log); given the
    (resolved) model config and tensor parallel size, for that model (``loss_reason``: why its loss
    kernel was chosen, the ``Run``'s ``fused_loss_reason``). ``on_cuda``: as a CUDA run would, from
    any host (--dry-run)."""
    apex = apex_norm_classes() is not None
    # apex is detected where the run starts: from another host a CUDA run's norms are a possibility
    maybe = "apex {} where apex's CUDA extension imports, else torch.nn.{}" if on_cuda and not apex else None
    return {
        "layernorm": maybe.format("FusedLayerNorm", "LayerNorm") if maybe else
        "apex FusedLayerNorm" if apex else "torch.nn.LayerNorm",
        "rmsnorm": maybe.format("FusedRMSNorm", "RMSNorm") if maybe else "apex FusedRMSNorm" if apex else "torch.nn.RMSNorm",
        "attention": "torch scaled_dot_product_attention (flash/efficient kernels on GPU, math on CPU)",
        "grouped_query_attention": "native (enable_gqa)" if sdpa_supports_gqa() else "repeat_interleave",
        "elementwise fusions": describe_fusions(model_cfg),
        "output layer + loss": describe_liger(model_cfg, tp, loss_reason, on_cuda=on_cuda),
        "cross_entropy": "chunked over tokens for bf16/fp16 logits (no fp32 [tokens, vocab] copy), "
                         "vocab-parallel",
    }


@torch.compiler.disable
def sdpa_with_dropout(q, k, v, mask, p: float, is_causal: bool, extra: dict) -> torch.Tensor:
    """Attention with dropout. Each rank holds different heads, so their dropout masks must differ:
    they are drawn from the tensor parallel RNG stream. Its fork sets the generators' states, which
    dynamo does not trace: in a layer compiled with --compile-layers this runs eagerly, between two
    graphs (one graph break; otherwise dynamo would break at each generator call)."""
    with get_rng_tracker().fork():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=is_causal, **extra)


@torch.compiler.disable
def context_parallel_attention(cp, q, k, v, document_ids, p: float, scale: float | None = None) -> torch.Tensor:
    """An attention core under context parallelism (``cp``: parallel/context_parallel.py's ``ContextParallel``):
    ``[b, heads, s, d]`` q, k, v -> ``[s, b, heads, dv]``. Attention dropout draws from the tensor parallel stream,
    as ``sdpa_with_dropout``. In a layer compiled with --compile-layers it runs eagerly (one graph break): the
    ring's asynchronous point-to-point exchanges and its autograd Function stay out of the graph."""
    with get_rng_tracker().fork() if p > 0.0 else contextlib.nullcontext():
        return cp.attention(q, k, v, document_ids, dropout_p=p, scale=scale).permute(2, 0, 1, 3)
