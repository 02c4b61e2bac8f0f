"""LayerNorm / RMSNorm: apex's fused kernels when importable, torch's otherwise.

Both implementations name their parameters ``weight`` (and ``bias`` for LayerNorm), so checkpoints
move freely between a machine with apex and one without.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_ds.model.kernels import apex_norm_classes


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


def build_norm(normalization: str, hidden_size: int, eps: float, *, sequence_parallel: bool = False,
               params_dtype: torch.dtype = torch.float32, device=None, one_plus: bool = False) -> nn.Module:
    """A normalization layer over the last dimension.

    Under sequence parallelism each tensor parallel rank normalizes a different slice of the
    sequence, so the norm's weight gradients are partial sums; the parameters are tagged
    ``sequence_parallel=True`` so their gradients are summed over the tensor parallel group
    (``megatron_ds.parallel.layers.register_sequence_parallel_grad_hooks``, installed by training).
    """
    kind = normalization.lower()
    if kind not in ("layernorm", "rmsnorm"):
        raise ValueError(f"unknown normalization {normalization!r}; use layernorm or rmsnorm")
    apex = apex_norm_classes()
    if one_plus and kind == "layernorm":  # Megatron ignores the flag for RMSNorm; so does this
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
