"""Context parallel attention's block kernels (parallel/context_parallel.py): one block is a query chunk's
attention over one visible key chunk, returning the log-sum-exp the online-softmax merge needs.

Two operations per block:
- ``block_forward(q, k, v, kind, mask, scale, kernel)`` -> (output, LSE ``[b, h, sq]``) in the merge's
  precision (fp32; fp64 stays fp64, the tests' references);
- ``block_backward(d_out, q, k, v, out, lse, kind, mask, scale, kernel)`` -> (dq, dk, dv), where ``out`` and
  ``lse`` may be the *final merged* ones: P = exp(S - lse_final) is this block's share of the final softmax
  and rowsum(dO O_final) its correction, so each block's gradient from the merged output is exact (flash
  attention's backward, the ring's trick: Transformer Engine's ``AttnFuncWithCPAndKVP2P``).

Block kinds: ``FULL`` (every key visible), ``CAUSAL`` (a square diagonal block, sq == sk: top-left and
bottom-right alignment agree, so no kernel sees an ambiguous causal mask), ``DOCUMENT`` (``mask``: bool
``[b or 1, 1, sq, sk]``, True = visible, the causal diagonal folded in).

Kernels (``--cp-block-kernel``, ours):
- ``math``: the explicit path (scores, log-sum-exp, softmax, product in fp32) on every device.
- ``flash``: torch's fused attention operators, which return the log-sum-exp. On CUDA with fp16/bf16:
  ``aten._scaled_dot_product_flash_attention`` (FULL, CAUSAL) and ``aten._scaled_dot_product_efficient_attention``
  with an additive bias (DOCUMENT: the flash kernel takes no mask), and their backwards; fp32/fp64 and head dims
  over 256 fall back to ``math``. On the CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` (it takes the
  mask) for every block and dtype, the same code path. Both flash operators need one head dim for q, k and v:
  multi-latent attention's shorter values (or queries) are zero-padded, which changes no score (the scale is
  explicit) and no output column kept.
  Schemas: these operators' arguments are used positionally up to ``philox_offset`` / ``is_causal`` plus the
  keyword ``scale``; they read the same in this CPU build (torch 2.13) and in the stored pytorch
  ``native_functions.yaml`` and DTensor's ring attention (torch/distributed/tensor/experimental/_context_parallel
  /_attention.py), which calls them alike since torch 2.4 (the GPU machine runs 2.11).
Masked scores use a finite "minus infinity" (``MASKED``, or the dtype's lowest value where that is lower), so a
fully masked row has a finite LSE (clamped to ``MASKED``) and weight exp(MASKED - lse) = 0 in the merge: no NaN.
Attention dropout is not here: its mask would have to be redrawn in backward (context_parallel.py runs autograd
through ``math_block`` then).
"""
from __future__ import annotations

import torch

MASKED = -1e30  # a finite "minus infinity": fully masked rows keep finite LSEs and gradients (no NaN)
FULL, CAUSAL, DOCUMENT = "full", "causal", "document"
KERNELS = ("math", "flash")
_FLASH_MAX_HEAD_DIM = 256  # torch's CUDA flash and memory-efficient kernels (sdp_utils check_head_dim_size_flash)
_BIAS_ALIGNMENT = 16  # the memory-efficient kernel reads its bias rows at 16-element strides (sdpa pads it)
_LSE_ALIGNMENT = 32  # ... and pads its LSE along the queries to a multiple of 32
_aten = torch.ops.aten  # the fused operators, through one name (tests/fake_cuda records the calls there)


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _kind_mask(kind: str, mask, sq: int, device):
    """The bool mask the math path applies (None: all visible)."""
    if kind == CAUSAL:
        return torch.ones(sq, sq, dtype=torch.bool, device=device).tril()
    return mask if kind == DOCUMENT else None


def _probs(q, k, kind: str, mask, scale: float, lse=None):
    """(softmax probabilities, LSE) of ``q`` against ``k`` (both in the merge's precision) under the block's mask;
    with ``lse`` given (backward: the merged one), the probabilities are this block's share of that softmax."""
    mask = _kind_mask(kind, mask, q.shape[2], q.device)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, MASKED)
    lse = torch.logsumexp(scores, dim=-1) if lse is None else lse
    probs = torch.exp(scores - lse.unsqueeze(-1))
    return (probs if mask is None else probs * mask), lse


def math_block(q, k, v, kind: str, mask, scale: float, dropout_p: float = 0.0):
    """Softmax attention of ``[b, h, sq, d]`` q over ``[b, h, sk, d]`` k and ``[b, h, sk, dv]`` v; returns
    (output ``[b, h, sq, dv]``, LSE ``[b, h, sq]``) in fp32. A row with nothing visible gets output 0 and an LSE of
    about ``MASKED``. Dropout drops (and rescales) the probabilities after the LSE is taken: the merge only
    rescales whole blocks, so that is dropout of the final softmax, as SDPA's. Differentiable (autograd)."""
    acc = _acc(q.dtype)
    probs, lse = _probs(q.to(acc), k.to(acc), kind, mask, scale)
    if dropout_p > 0.0:
        probs = torch.nn.functional.dropout(probs, dropout_p)
    return torch.matmul(probs, v.to(acc)), lse


def _math_backward(d_out, q, k, v, out, lse, kind, mask, scale):
    acc = _acc(q.dtype)
    qa, ka, va, d_out = q.to(acc), k.to(acc), v.to(acc), d_out.to(acc)
    probs, _ = _probs(qa, ka, kind, mask, scale, lse)
    d_v = torch.matmul(probs.transpose(-1, -2), d_out)
    delta = (d_out * out.to(acc)).sum(-1, keepdim=True)  # rowsum(dO O)
    d_scores = probs * (torch.matmul(d_out, va.transpose(-1, -2)) - delta) * scale
    return torch.matmul(d_scores, ka), torch.matmul(d_scores.transpose(-1, -2), qa), d_v


def uses_kernel(kernel: str, q: torch.Tensor) -> bool:
    """Whether ``flash`` runs torch's fused operators for ``q`` (else the math path): on the CPU always, on
    CUDA for fp16/bf16 (``block_forward`` / ``block_backward`` also keep head dims over 256 on the math path)."""
    if kernel != "flash":
        return False
    if q.device.type == "cpu":
        return True
    return q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16)


def _pad_to(t: torch.Tensor, d: int) -> torch.Tensor:
    return t if t.shape[-1] == d else torch.nn.functional.pad(t, (0, d - t.shape[-1]))


def _head_dim(q, v) -> int:
    """One head dim for q, k and v (the fused operators need it), a multiple of 8 on CUDA (16-byte rows)."""
    d = max(q.shape[-1], v.shape[-1])
    return d if q.device.type == "cpu" else -(-d // 8) * 8


def _bias(mask: torch.Tensor, q: torch.Tensor, sk: int, aligned: bool) -> torch.Tensor:
    """``mask`` as an additive bias in q's dtype, expanded to ``[b, h, sq, sk]``; ``aligned``: its rows start at
    16-element strides (the memory-efficient kernel's requirement, which SDPA meets by padding: attention.cpp
    ``preprocess_mask``)."""
    b, h, sq = q.shape[0], q.shape[1], q.shape[2]
    low = max(MASKED, torch.finfo(q.dtype).min)
    width = -(-sk // _BIAS_ALIGNMENT) * _BIAS_ALIGNMENT if aligned else sk
    bias = torch.zeros(mask.shape[0], 1, sq, width, dtype=q.dtype, device=q.device)
    bias[..., :sk].masked_fill_(~mask, low)
    return bias[..., :sk].expand(b, h, sq, sk)


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """The LSE as the merge needs it: fp32 (fp64 stays), ``[b, h, sq]`` contiguous (the CPU operator's is laid
    out [b, sq, h]), a fully masked row's -inf clamped to ``MASKED``."""
    return lse.to(_acc(lse.dtype)).clamp_min(MASKED).contiguous()


def block_forward(q, k, v, kind: str, mask, scale: float, kernel: str = "math"):
    """One block (module docstring): (output, LSE) in the merge's precision."""
    if not uses_kernel(kernel, q):
        return math_block(q, k, v, kind, mask, scale)
    dv, d = v.shape[-1], _head_dim(q, v)
    if d > _FLASH_MAX_HEAD_DIM and q.device.type == "cuda":
        return math_block(q, k, v, kind, mask, scale)
    qp, kp, vp = (_pad_to(t, d) for t in (q, k, v))
    causal = kind == CAUSAL
    if q.device.type == "cpu":
        attn_mask = _bias(mask, q, k.shape[2], False) if kind == DOCUMENT else None
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
            qp, kp, vp, 0.0, causal, attn_mask=attn_mask, scale=scale)
    elif kind == DOCUMENT:
        out, lse = _aten._scaled_dot_product_efficient_attention(
            qp, kp, vp, _bias(mask, q, k.shape[2], True), True, 0.0, False, scale=scale)[:2]
        lse = lse[:, :, :q.shape[2]]  # padded along the queries to a multiple of 32
    else:
        out, lse = _aten._scaled_dot_product_flash_attention(qp, kp, vp, 0.0, causal, False, scale=scale)[:2]
    return out[..., :dv].to(_acc(q.dtype)), _finite(lse)


def block_backward(d_out, q, k, v, out, lse, kind: str, mask, scale: float, kernel: str = "math"):
    """The block's (dq, dk, dv) from ``d_out`` and the output and LSE it is part of (the merged ones, or its own);
    dq, dk, dv in the merge's precision."""
    if not uses_kernel(kernel, q):
        return _math_backward(d_out, q, k, v, out, lse, kind, mask, scale)
    dqk, dv, d = q.shape[-1], v.shape[-1], _head_dim(q, v)
    if d > _FLASH_MAX_HEAD_DIM and q.device.type == "cuda":
        return _math_backward(d_out, q, k, v, out, lse, kind, mask, scale)
    qp, kp, vp, d_out, out = (_pad_to(t.to(q.dtype), d) for t in (q, k, v, d_out, out))
    causal, sq, sk = kind == CAUSAL, q.shape[2], k.shape[2]
    lse = lse.float().contiguous() if q.device.type == "cuda" else lse.to(_acc(q.dtype)).contiguous()
    if q.device.type == "cpu":
        attn_mask = _bias(mask, q, sk, False) if kind == DOCUMENT else None
        grads = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            d_out, qp, kp, vp, out, lse, 0.0, causal, attn_mask=attn_mask, scale=scale)
    elif kind == DOCUMENT:
        # its backward reads the LSE as its forward wrote it: padded along the queries to a multiple of 32
        padded = lse.new_full((*lse.shape[:2], -(-sq // _LSE_ALIGNMENT) * _LSE_ALIGNMENT), MASKED)
        padded[:, :, :sq] = lse
        seed = offset = torch.zeros((), dtype=torch.long, device=q.device)  # read only with dropout
        grads = _aten._scaled_dot_product_efficient_attention_backward(
            d_out, qp, kp, vp, _bias(mask, q, sk, True), out, padded, seed, offset, 0.0,
            [True, True, True, False], False, scale=scale)[:3]
    else:
        # cum_seq_q/k None: not variable-length; the RNG state is read only with dropout
        seed, offset = (torch.zeros(shape, dtype=torch.uint64, device=q.device) for shape in ((2,), ()))
        grads = _aten._scaled_dot_product_flash_attention_backward(
            d_out, qp, kp, vp, out, lse, None, None, sq, sk, 0.0, causal, seed, offset, scale=scale)
    acc = _acc(q.dtype)
    d_q, d_k, d_v = grads
    return d_q[..., :dqk].to(acc), d_k[..., :dqk].to(acc), d_v[..., :dv].to(acc)


def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
          lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Online softmax: two blocks' attention over disjoint keys -> the attention over their union (fp32)."""
    lse = torch.logaddexp(lse_a, lse_b)
    out = out_a * torch.exp(lse_a - lse).unsqueeze(-1) + out_b * torch.exp(lse_b - lse).unsqueeze(-1)
    return out, lse
