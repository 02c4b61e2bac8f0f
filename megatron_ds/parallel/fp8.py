"""FP8 matmuls for the tensor-parallel linear layers, on torchao's float8 training tensors.

``fp8_linear(x, weight, bias, recipe)`` is the one function the layers call for an FP8 linear; its
three GEMMs are ``fp8_forward``, ``fp8_input_grad`` and ``fp8_weight_grad``, which the overlapped
column-parallel backward (``parallel.async_comm``) calls in place of its bf16 ones. Each GEMM
casts its operands to float8 with a scale computed from the operand itself (torchao's *current*
scaling: ``tensor_to_scale``, per tensor or per row) and multiplies the ``Float8TrainingTensor``s,
which torchao turns into ``torch._scaled_mm`` on CUDA and into an fp32 emulation of the same
quantized product elsewhere (the CPU: same numbers up to the accumulation order). The parameters
stay the bf16/fp32 master copies the optimizers update; only the GEMM operands are float8, and the
output is in the input's dtype. A current-scaling recipe has no state; delayed scaling
(``granularity="delayed"``) keeps each layer's amax history and scales in a ``DelayedScaling`` module
(``parallel.fp8_delayed``), which the layers pass here in place of the recipe (``Fp8``): its casts use
the stored scale and record the operand's amax.

Formats (Megatron's): "e4m3" casts every operand to E4M3; "hybrid" casts the forward operands
(input, weight) to E4M3 and the gradients to E5M2 (more range, less precision: gradients span more
orders of magnitude). ``wgrad=False`` (``--no-fp8-wgrad``) computes the weight gradient in the
input's precision. The weight gradient goes through ``weight_grad_now_or_later``, so a zero-bubble
schedule defers it as it defers the bf16 one.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_ds.ds_compat import torchao_import_quiet
from megatron_ds.parallel.fp8_delayed import DelayedScaling
from megatron_ds.parallel.weight_grad import weight_grad_now_or_later

@dataclass(frozen=True)
class Fp8Recipe:
    """How the linear layers' GEMMs run in FP8 (``config/fp8_flags.py`` builds it from the flags)."""

    format: str = "hybrid"
    """"e4m3" | "hybrid" (E4M3 forward, E5M2 gradients)."""
    granularity: str = "tensorwise"
    """"tensorwise": one scale per operand; "rowwise": one per row of each GEMM's reduction (both current
    scaling); "delayed": one per operand from earlier steps' amax (``parallel.fp8_delayed``)."""
    margin: int = 0
    """Scale down by 2**margin below the largest that fits (headroom for outliers)."""
    wgrad: bool = True
    """False: the weight-gradient GEMM in the input's precision."""
    amax_history_len: int = 1
    """"delayed": how many steps' amax each scale looks back on."""
    amax_compute_algo: str = "most_recent"
    """"delayed": the amax a scale comes from, the history's "max" or its "most_recent"."""

    def __post_init__(self):
        _torchao()

    def dtypes(self) -> tuple[torch.dtype, torch.dtype]:
        """(forward operands' dtype, gradients' dtype)."""
        fwd = torch.float8_e4m3fn
        return fwd, (torch.float8_e5m2 if self.format == "hybrid" else fwd)


# what the GEMMs take: a current-scaling recipe, or a layer's delayed-scaling state (which holds its recipe)
Fp8 = Fp8Recipe | DelayedScaling

_torchao_pieces: tuple | None = None


def _torchao():
    """torchao's float8 pieces, imported once, when the first recipe is made (the package loads
    torch.compile hooks): eagerly, so that a compiled layer's trace reads them and imports nothing.
    The import logs a warning per optional C++ kernel library torchao cannot load (MXFP8, CUTLASS;
    CUDA builds of them), none of which is used here (the GEMMs are torch._scaled_mm), and torch warns
    that torchao's enums need no registration any more: held back, they say nothing about this run."""
    global _torchao_pieces
    if _torchao_pieces is None:
        with torchao_import_quiet():
            from torchao.float8 import float8_training_tensor as ftt  # noqa: PLC0415
            from torchao.float8.config import ScalingGranularity  # noqa: PLC0415
            from torchao.float8.float8_utils import tensor_to_scale  # noqa: PLC0415
        _torchao_pieces = ftt, ScalingGranularity, tensor_to_scale
    return _torchao_pieces


def _mm_config(emulate: bool):
    ftt = _torchao()[0]
    # torchao's defaults: fast accumulation only for the forward GEMM (the gradients keep full
    # accumulation), padding off (the layers' sizes are multiples of 16 at any real shape)
    return ftt.LinearMMConfig(ftt.ScaledMMConfig(emulate, True, False, False),
                              ftt.ScaledMMConfig(emulate, False, False, False),
                              ftt.ScaledMMConfig(emulate, False, False, False))


def _cast(t: torch.Tensor, dtype: torch.dtype, role: str, axis: int, fp8: "Fp8", mm_config, record: bool = True):
    """``t`` as a Float8TrainingTensor: scaled by its current amax (over ``axis`` when rowwise: each slice
    along the other dim, the GEMM's rows or columns, gets its own scale), or under delayed scaling by
    the layer's stored scale for ``role``, the operand's amax recorded for the next update (``record``)."""
    ftt, granularity, tensor_to_scale = _torchao()
    if isinstance(fp8, DelayedScaling):
        if record:
            fp8.record(role, t)
        return ftt.hp_tensor_and_scale_to_float8(t, fp8.scale_for(role), dtype, mm_config, ftt.GemmInputRole(role))
    recipe = fp8
    rowwise = recipe.granularity == "rowwise"
    scale = tensor_to_scale(t, dtype, scaling_granularity=granularity.AXISWISE if rowwise else granularity.TENSORWISE,
                            axiswise_dim=axis if rowwise else None)
    if recipe.margin:
        scale = scale / (2.0 ** recipe.margin)
    return ftt.hp_tensor_and_scale_to_float8(t, scale, dtype, mm_config, ftt.GemmInputRole(role),
                                             axis if rowwise else None)


def _recipe(fp8: "Fp8") -> Fp8Recipe:
    return fp8.recipe if isinstance(fp8, DelayedScaling) else fp8


def fp8_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fp8: Fp8,
                record: bool = True) -> torch.Tensor:
    """The output GEMM, ``x W^T (+ b)``, on FP8 operands (no autograd: for a Function's forward).
    ``record``: delayed scaling records the operands' amax (training; evaluation leaves the history alone)."""
    mm = _mm_config(emulate=x.device.type != "cuda")
    fwd, _ = _recipe(fp8).dtypes()
    x2 = x.reshape(-1, x.size(-1))
    out = torch.mm(_cast(x2, fwd, "input", -1, fp8, mm, record), _cast(weight.t(), fwd, "weight", 0, fp8, mm, record))
    out = out.reshape(*x.shape[:-1], out.size(-1))
    return out + bias if bias is not None else out


def fp8_input_grad(grad_out: torch.Tensor, weight: torch.Tensor, fp8: Fp8) -> torch.Tensor:
    """The input-gradient GEMM, ``grad_out W``: the gradient in the recipe's gradient dtype (the weight
    cast as in the forward: the same scale, its amax already recorded)."""
    mm = _mm_config(emulate=grad_out.device.type != "cuda")
    fwd, bwd = _recipe(fp8).dtypes()
    g2 = grad_out.reshape(-1, grad_out.size(-1))
    grad_x = torch.mm(_cast(g2, bwd, "grad_output", -1, fp8, mm), _cast(weight, fwd, "weight", 0, fp8, mm, False))
    return grad_x.reshape(*grad_out.shape[:-1], grad_x.size(-1))


def fp8_weight_grad(x: torch.Tensor, grad_out: torch.Tensor, fp8: Fp8) -> torch.Tensor:
    """The weight-gradient GEMM, ``grad_out^T x`` (in the input's precision with ``wgrad=False``). Under
    delayed scaling the gradient's amax is recorded here too: a layer whose input needs no gradient has
    no input-gradient GEMM."""
    recipe = _recipe(fp8)
    x2, g2 = x.reshape(-1, x.size(-1)), grad_out.reshape(-1, grad_out.size(-1))
    if not recipe.wgrad:
        return g2.t().matmul(x2.to(g2.dtype))
    mm = _mm_config(emulate=x.device.type != "cuda")
    fwd, bwd = recipe.dtypes()
    grad = torch.mm(_cast(g2.t(), bwd, "grad_output", -1, fp8, mm), _cast(x2, fwd, "input", 0, fp8, mm, False))
    return grad.to(x.dtype)


class _Fp8LinearFunction(torch.autograd.Function):
    """y = x W^T + b with the three GEMMs (output, input gradient, weight gradient) in FP8."""

    @staticmethod
    def forward(ctx, x, weight, bias, fp8: Fp8, record: bool):
        ctx.save_for_backward(x, weight)
        ctx.recipe, ctx.has_bias = fp8, bias is not None
        return fp8_forward(x, weight, bias, fp8, record)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        recipe = ctx.recipe
        grad_x = fp8_input_grad(grad_out, weight, recipe) if ctx.needs_input_grad[0] else None
        grad_w = grad_b = None
        if ctx.needs_input_grad[1]:
            grad_w = weight_grad_now_or_later(weight, lambda: fp8_weight_grad(x, grad_out, recipe))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_out.reshape(-1, grad_out.size(-1)).sum(dim=0)
        return grad_x, grad_w, grad_b, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fp8: Fp8) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with FP8 GEMMs as ``fp8`` says (forward-only under no_grad too:
    evaluation sees the numbers training does; under delayed scaling it records no amax)."""
    return _Fp8LinearFunction.apply(x, weight, bias, fp8, torch.is_grad_enabled())
