"""Column-parallel linear layers whose backward hides the input gradient's communication behind the
weight-gradient GEMM, as Megatron's ``LinearWithGradAccumulationAndAsyncCommunication``
(``megatron/core/tensor_parallel/layers.py``).

A column-parallel layer's backward is two GEMMs, the input gradient ``grad_out @ W`` and the weight
gradient ``grad_out^T @ x``, and one collective on the input gradient: every TP rank holds a partial
sum of it, which an all-reduce completes (a reduce-scatter along the sequence under sequence
parallelism). Only the previous layer waits for that collective; the weight gradient needs nothing
from it. So the collective is started asynchronously right after the input-gradient GEMM and
waited for after the weight-gradient GEMM, which runs while the bytes travel. Under sequence
parallelism the forward's all-gather of the input is re-issued asynchronously first (the gathered
input is not kept for backward: that is the memory sequence parallelism saves), overlapping the
input-gradient GEMM, which does not need it.

On NCCL the collectives run on their own CUDA stream; Megatron sets ``CUDA_DEVICE_MAX_CONNECTIONS=1``
so that the collective's kernel is queued before the GEMM's and the two really run at once. On gloo
the collective runs on gloo's thread while this one multiplies. The numbers are those of the
synchronous path: the same GEMMs on the same operands, the same collectives.

On with ``--async-tensor-model-parallel-allreduce`` (Megatron's default; off here until a GPU
measurement shows a gain). Off (the default, or ``--no-async-tensor-model-parallel-allreduce``), the
layers compute through ``copy_to_tensor_parallel_region`` and ``weight_grad.linear``, a collective
after the GEMMs. A
zero-bubble schedule deferring weight gradients (``weight_grad``) finds nothing to overlap: the
collective is then waited for at once.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_ds.parallel.fp8 import Fp8, fp8_forward, fp8_input_grad, fp8_weight_grad
from megatron_ds.parallel.mappings import start_all_gather_along_first_dim, start_all_reduce, \
    start_reduce_scatter_along_first_dim
from megatron_ds.parallel.weight_grad import linear_weight_grad, weight_grad_now_or_later


def _forward(x, weight, bias, fp8: Fp8 | None):
    return F.linear(x, weight, bias) if fp8 is None else fp8_forward(x, weight, bias, fp8)


def _input_grad(grad_out, weight, fp8: Fp8 | None):
    return grad_out.matmul(weight) if fp8 is None else fp8_input_grad(grad_out, weight, fp8)


def _weight_grad(x, grad_out, fp8: Fp8 | None, weight):
    """The weight's gradient now or at a zero-bubble weight pass, or added into its ``main_grad``."""
    if fp8 is not None:
        return weight_grad_now_or_later(weight, lambda: fp8_weight_grad(x, grad_out, fp8))
    return linear_weight_grad(weight, x, grad_out)


class _OverlappedColumnLinear(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` on the replicated input of a column-parallel layer; backward
    all-reduces the input gradient over ``group`` during the weight-gradient GEMM."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, fp8):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.has_bias, ctx.fp8 = group, bias is not None, fp8
        return _forward(x, weight, bias, fp8)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        pending = None
        if ctx.needs_input_grad[0]:
            pending = start_all_reduce(_input_grad(grad_out, weight, ctx.fp8), ctx.group)
        grad_w = grad_b = None
        if ctx.needs_input_grad[1]:
            grad_w = _weight_grad(x, grad_out, ctx.fp8, weight)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_out.reshape(-1, grad_out.size(-1)).sum(dim=0)
        return (pending() if pending else None), grad_w, grad_b, None, None


class _OverlappedSequenceParallelLinear(torch.autograd.Function):
    """y = all_gather_seq(x) @ W^T + b keeping only the local sequence shard of x; backward
    re-gathers x during the input-gradient GEMM and reduce-scatters the input gradient during the
    weight-gradient GEMM."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, fp8):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.has_bias, ctx.fp8 = group, bias is not None, fp8
        gathered = start_all_gather_along_first_dim(x, group)()
        return _forward(gathered, weight, bias, fp8)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        gather = start_all_gather_along_first_dim(x, ctx.group) if ctx.needs_input_grad[1] else None
        scatter = None
        if ctx.needs_input_grad[0]:
            # every rank holds a partial gradient of the whole sequence: sum them, keep my shard
            scatter = start_reduce_scatter_along_first_dim(_input_grad(grad_out, weight, ctx.fp8), ctx.group)
        grad_w = grad_b = None
        if gather is not None:
            total = gather()
            grad_w = _weight_grad(total, grad_out, ctx.fp8, weight)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_out.reshape(-1, grad_out.size(-1)).sum(dim=0)
        return (scatter() if scatter else None), grad_w, grad_b, None, None


def overlapped_column_linear(x: torch.Tensor, weight: torch.Tensor, bias, group, *, sequence_parallel: bool,
                             fp8: Fp8 | None = None):
    """ColumnParallelLinear's product at TP > 1 with the overlapped backward, its GEMMs in FP8 with a
    recipe (``parallel.fp8``). Under torch autocast (DeepSpeed's "torch_autocast" block) a Function's
    backward would see mixed dtypes: the caller takes the synchronous path there, as
    ``weight_grad.linear`` does."""
    cls = _OverlappedSequenceParallelLinear if sequence_parallel else _OverlappedColumnLinear
    return cls.apply(x, weight, bias, group, fp8)


def overlap_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a backward will run (training), autocast is off and this is not traced by torch.compile:
    else the synchronous path (the same numbers; in inference there is no backward to overlap).
    Dynamo does not trace ``async_op=True`` collectives (a graph break per layer): a compiled layer
    (``model/compile_layers.py``) keeps its collectives in the graph, synchronous."""
    return (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
            and not torch.is_autocast_enabled(x.device.type) and not torch.compiler.is_compiling()
            and dist.is_initialized())
