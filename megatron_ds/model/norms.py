"""LayerNorm / RMSNorm: apex's fused kernels when importable, torch's otherwise.

Both implementations name their parameters ``weight`` (and ``bias`` for LayerNorm), so checkpoints
move freely between a machine with apex and one without.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_ds.model.kernels import apex_norm_classes
from megatron_ds.parallel.layers import set_tensor_parallel_attributes
from megatron_ds.parallel.mappings import copy_to_tensor_parallel_region, reduce_from_tensor_parallel_region


class _RMSNorm(nn.Module):
    """RMSNorm for torch < 2.4, which has no ``torch.nn.RMSNorm``. Computed in fp32 (the mean of
    squares underflows/overflows in half precision), returned in the input dtype."""

    def __init__(self, hidden_size: int, eps: float, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.type_as(x) * self.weight


class LayerNorm1P(nn.LayerNorm):
    """--apply-layernorm-1p: LayerNorm scaled by (1 + weight), the weight initialised to zero
    (Megatron's MixedFusedLayerNorm(apply_layernorm_1p=True)); weight decay then pulls towards 1."""

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.elementwise_affine:
            nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)


class Fp32InputNorm(nn.Module):
    """The norm of an fp32 residual stream (--fp32-residual-connection) in a half-precision model:
    computed in fp32 from the fp32 input, returned in the weights' dtype for the half-precision
    branch behind it. That is Megatron's MixedFusedLayerNorm, whose kernel (megatron/fused_kernels/
    layer_norm_cuda.cpp, added with the flag) allocates the output as ``gamma``'s dtype and keeps the
    statistics in fp32, with the input's gradient in the input's dtype. Here the affine part runs in
    fp32 too (one rounding, at the end). Parameters are named as the other norms' (``weight``, and
    ``bias`` for LayerNorm), so checkpoints load either way."""

    def __init__(self, kind: str, hidden_size: int, eps: float, *, params_dtype: torch.dtype, device=None,
                 one_plus: bool = False):
        super().__init__()
        self.kind, self.eps, self.one_plus = kind, eps, one_plus and kind == "layernorm"
        init = torch.zeros if self.one_plus else torch.ones
        self.weight = nn.Parameter(init(hidden_size, device=device, dtype=params_dtype))
        self.bias = nn.Parameter(torch.zeros(hidden_size, device=device, dtype=params_dtype)) \
            if kind == "layernorm" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf, weight = x.float(), self.weight.float()
        if self.kind == "rmsnorm":
            y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * weight
        else:
            weight = weight + 1 if self.one_plus else weight
            y = F.layer_norm(xf, xf.shape[-1:], weight, self.bias.float(), self.eps)
        return y.to(self.weight.dtype)


def build_norm(normalization: str, hidden_size: int, eps: float, *, sequence_parallel: bool = False,
               params_dtype: torch.dtype = torch.float32, device=None, one_plus: bool = False,
               fp32_input: bool = False) -> nn.Module:
    """A normalization layer over the last dimension; ``fp32_input``: it reads the fp32 residual
    stream of --fp32-residual-connection (``Fp32InputNorm``).

    Under sequence parallelism each tensor parallel rank normalizes a different slice of the
    sequence, so the norm's weight gradients are partial sums; the parameters are tagged
    ``sequence_parallel=True`` so their gradients are summed over the tensor parallel group
    (``megatron_ds.parallel.layers.register_sequence_parallel_grad_hooks``, installed by training).
    """
    kind = normalization.lower()
    if kind not in ("layernorm", "rmsnorm"):
        raise ValueError(f"unknown normalization {normalization!r}; use layernorm or rmsnorm")
    apex = apex_norm_classes()
    if fp32_input:  # whatever the half-precision kernels, this one reads fp32 and writes params_dtype
        norm = Fp32InputNorm(kind, hidden_size, eps, params_dtype=params_dtype, device=device, one_plus=one_plus)
    elif one_plus and kind == "layernorm":  # Megatron ignores the flag for RMSNorm; so does this
        norm = LayerNorm1P(hidden_size, eps=eps, device=device, dtype=params_dtype)
    elif apex is not None:
        fused_layernorm, fused_rmsnorm = apex
        cls = fused_layernorm if kind == "layernorm" else fused_rmsnorm
        norm = cls(hidden_size, eps=eps).to(device=device, dtype=params_dtype)
    elif kind == "layernorm":
        norm = nn.LayerNorm(hidden_size, eps=eps, device=device, dtype=params_dtype)
    else:
        rms_cls = getattr(nn, "RMSNorm", _RMSNorm)
        norm = rms_cls(hidden_size, eps=eps, device=device, dtype=params_dtype)
    for p in norm.parameters():
        p.sequence_parallel = sequence_parallel
    return norm


class ProjectionRMSNorm(nn.Module):
    """RMSNorm over a whole query or key projection split over tensor parallel ranks
    (--qk-layernorm-scope projection: OLMo 2's / OLMoE's ``q_norm`` / ``k_norm``, transformers'
    ``OlmoeAttention``: ``RMSNorm(num_heads * head_dim)`` on ``q_proj``'s output before the heads are split).
    Each rank holds ``local_size`` of the ``full_size`` channels (its heads) and that slice of the weight:
    the weight is split over TP like the projection (``tensor_model_parallel``, dim 0; checkpoint/tp.py
    reshards it). The mean of squares must be the whole projection's, so each rank's sum of squares is
    all-reduced over the TP group; its backward all-reduces too, since every rank's output depends on every
    rank's input through that sum. Computed in fp32 and cast back before the weight (``OlmoeRMSNorm``)."""

    def __init__(self, local_size: int, full_size: int, eps: float, *, tp_group=None,
                 params_dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.full_size, self.eps, self.tp_group = full_size, eps, tp_group
        self.weight = nn.Parameter(torch.ones(local_size, device=device, dtype=params_dtype))
        set_tensor_parallel_attributes(self.weight, partition_dim=0)
        self.weight.sequence_parallel = False  # each rank's gradient is whole for its slice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        squares = xf.pow(2).sum(-1, keepdim=True)
        # reduce_from (all-reduce forward) after copy_to (all-reduce backward): an all-reduce both ways
        squares = reduce_from_tensor_parallel_region(copy_to_tensor_parallel_region(squares, self.tp_group),
                                                     self.tp_group)
        y = xf * torch.rsqrt(squares / self.full_size + self.eps)
        return self.weight * y.type_as(x)
