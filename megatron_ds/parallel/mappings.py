"""Autograd-aware communication between the tensor-parallel ranks.

Each mapping is a pair (forward op, backward op) that are each other's adjoint, so gradients are
right by construction: identity <-> all-reduce, split <-> all-gather, all-gather <-> reduce-scatter.
"Tensor parallel region" ops work on the last (hidden) dimension; "sequence parallel region" ops on
dim 0 of Megatron's [seq, batch, hidden] layout.

With `group=None` (or a group of one rank) every mapping is the identity and adds no autograd node.

Collectives run on the input's device. The single-tensor collectives (all_gather_into_tensor /
reduce_scatter_tensor) are used only where the group's backend for that device is NCCL; elsewhere
(gloo on CPU, whose support for them depends on the torch version) a list all-gather and an
all-reduce-then-keep-my-chunk give the same numbers with ops every backend has.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_ds.parallel.utils import divide, tp_rank, tp_world_size

# torch >= 2.13 renamed the single-tensor collectives; prefer the new names to avoid FutureWarnings.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _native_single_tensor_collectives(group, tensor: torch.Tensor) -> bool:
    """True when `group` talks NCCL for `tensor`'s device (backend strings look like "nccl" or
    "cpu:gloo,cuda:nccl")."""
    backend = str(dist.get_backend(group))
    if ":" in backend:
        per_device = dict(item.split(":", 1) for item in backend.split(","))
        backend = per_device.get(tensor.device.type, "")
    return backend == "nccl"


# ------------------------------------------------------------------ raw collectives (no autograd)


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    # A fresh contiguous buffer: reducing in place would clobber a tensor autograd may have saved.
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=group)
    return out


def _split_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    size = divide(x.size(-1), tp_world_size(group))
    return x.narrow(-1, tp_rank(group) * size, size).contiguous()


def _split_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    size = divide(x.size(0), tp_world_size(group))
    return x.narrow(0, tp_rank(group) * size, size).contiguous()


def all_gather_along_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    """Concatenate every rank's `x` along dim 0, in rank order (no autograd)."""
    world = tp_world_size(group)
    x = x.contiguous()
    if _native_single_tensor_collectives(group, x):
        out = torch.empty((world * x.size(0),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        _all_gather_single(out, x, group=group)
        return out
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=0)


def _all_gather_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    # Gather along dim 0 (one contiguous block per rank), then lay the blocks side by side.
    world = tp_world_size(group)
    gathered = all_gather_along_first_dim(x.unsqueeze(0), group)
    return torch.cat(gathered.unbind(0), dim=-1) if world > 1 else gathered[0]


def reduce_scatter_along_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    """Sum `x` over the ranks and keep this rank's chunk of dim 0 (no autograd)."""
    world = tp_world_size(group)
    x = x.contiguous()
    size = divide(x.size(0), world)
    if _native_single_tensor_collectives(group, x):
        out = torch.empty((size,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        _reduce_scatter_single(out, x, group=group)
        return out
    # world x the traffic of a true reduce-scatter, but correct on every backend; the fast path
    # above is what runs on GPU clusters.
    return _all_reduce(x, group).narrow(0, tp_rank(group) * size, size).contiguous()


# ------------------------------------------------------------------ started now, finished later
# Each returns a function that waits for the collective and returns its result; in between, the
# caller computes (``parallel.async_comm``: a GEMM that does not need the result). Same numbers as
# the synchronous collectives above.


def start_all_reduce(x: torch.Tensor, group):
    """All-reduce ``x`` in place (a buffer the caller owns), asynchronously."""
    work = dist.all_reduce(x, group=group, async_op=True)

    def finish() -> torch.Tensor:
        work.wait()
        return x
    return finish


def start_all_gather_along_first_dim(x: torch.Tensor, group):
    """``all_gather_along_first_dim``, asynchronously."""
    world, x = tp_world_size(group), x.contiguous()
    if _native_single_tensor_collectives(group, x):
        out = torch.empty((world * x.size(0),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        work = _all_gather_single(out, x, group=group, async_op=True)
        return lambda: (work.wait(), out)[1]
    parts = [torch.empty_like(x) for _ in range(world)]
    work = dist.all_gather(parts, x, group=group, async_op=True)
    return lambda: (work.wait(), torch.cat(parts, dim=0))[1]


def start_reduce_scatter_along_first_dim(x: torch.Tensor, group):
    """``reduce_scatter_along_first_dim`` of a buffer the caller owns, asynchronously."""
    world, x = tp_world_size(group), x.contiguous()
    size = divide(x.size(0), world)
    if _native_single_tensor_collectives(group, x):
        out = torch.empty((size,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        work = _reduce_scatter_single(out, x, group=group, async_op=True)
        return lambda: (work.wait(), out)[1]
    work = dist.all_reduce(x, group=group, async_op=True)  # as the synchronous fallback above
    return lambda: (work.wait(), x.narrow(0, tp_rank(group) * size, size).contiguous())[1]


# ------------------------------------------------------------------ autograd functions


class _CopyToTensorParallelRegion(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce (each rank's consumer saw the same input)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    """Forward: all-reduce of partial sums. Backward: identity."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTensorParallelRegion(torch.autograd.Function):
    """Forward: keep my chunk of the last dim. Backward: all-gather the last dim."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_last_dim(grad, ctx.group), None


class _GatherFromTensorParallelRegion(torch.autograd.Function):
    """Forward: all-gather the last dim. Backward: keep my chunk."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last_dim(grad, ctx.group), None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    """Forward: keep my chunk of dim 0. Backward: all-gather dim 0."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_along_first_dim(grad, ctx.group), None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """Forward: all-gather dim 0. Backward: reduce-scatter when the consumer is tensor parallel
    (each rank holds a partial gradient of the full sequence), else keep my chunk."""

    @staticmethod
    def forward(ctx, x, group, tensor_parallel_output_grad):
        ctx.group = group
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        return all_gather_along_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.tensor_parallel_output_grad:
            return reduce_scatter_along_first_dim(grad, ctx.group), None, None
        return _split_first_dim(grad, ctx.group), None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Forward: reduce-scatter dim 0. Backward: all-gather dim 0."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_along_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_along_first_dim(grad, ctx.group), None


# ------------------------------------------------------------------ public wrappers


def _single(group) -> bool:
    return tp_world_size(group) == 1


def copy_to_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    return x if _single(group) else _CopyToTensorParallelRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    return x if _single(group) else _ReduceFromTensorParallelRegion.apply(x, group)


def scatter_to_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    return x if _single(group) else _ScatterToTensorParallelRegion.apply(x, group)


def gather_from_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    return x if _single(group) else _GatherFromTensorParallelRegion.apply(x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    return x if _single(group) else _ScatterToSequenceParallelRegion.apply(x, group)


def gather_from_sequence_parallel_region(x: torch.Tensor, group,
                                         tensor_parallel_output_grad: bool = True) -> torch.Tensor:
    """`tensor_parallel_output_grad=False` when the consumer of the gathered tensor is replicated
    (its gradient is already complete on every rank), so backward only needs to split."""
    if _single(group):
        return x
    return _GatherFromSequenceParallelRegion.apply(x, group, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    return x if _single(group) else _ReduceScatterToSequenceParallelRegion.apply(x, group)
