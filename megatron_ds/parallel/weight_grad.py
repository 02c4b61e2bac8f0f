"""Deferred weight gradients: the W pass of zero-bubble pipeline schedules (ZB-H1).

A linear layer's backward is two GEMMs: the input gradient ``grad_out @ W`` (B, which the previous
pipeline stage waits for) and the weight gradient ``grad_out^T @ x`` (W, which nobody waits for
until the optimizer step). ``LinearFunction`` computes both in backward unless a
``WeightGradStore`` is deferring: then it computes only B and hands the store a closure for W,
holding ``x`` and ``grad_out`` until the schedule runs it. Megatron-DeepSpeed's ZB-H1 does the same
by swapping the backward of its ``LinearWithGradAccumulationAndAsyncCommunication`` during a
``BackwardOnlyPass`` and running ``WeightGradStore.pop()`` at each ``WeightPass``
(``megatron/core/pipeline_parallel/deepspeed_zbh1_engine.py``).

Both paths run the same code for the weight gradient (``weight_gradient``), and a deferred gradient is
accumulated through the parameter's own ``AccumulateGrad`` node (``Tensor.backward`` on the leaf),
exactly as autograd accumulates the immediate one: same numbers, same accumulation, and the hooks
DeepSpeed registers on parameters (ZeRO's reduction hooks) see it as they see any gradient. Only
the order in which micro-batches' gradients are added is the schedule's.
"""
from __future__ import annotations

from collections import deque
from contextlib import contextmanager

import torch
import torch.nn.functional as F

# The store deferring now (during a schedule's input-gradient pass), else None. A plain global, not
# a thread-local: autograd runs a CUDA backward on its own device thread.
_active: "WeightGradStore | None" = None


class WeightGradStore:
    """Weight-gradient closures grouped per backward pass, run first in, first out."""

    def __init__(self):
        self._open: list = []
        self._groups: deque = deque()

    @contextmanager
    def deferring(self):
        """Within: ``LinearFunction`` defers weight gradients here. On exit the closures of this
        backward become one group (possibly empty: a stage without linear layers still counts it)."""
        global _active
        if _active is not None:
            raise RuntimeError("a WeightGradStore is already deferring weight gradients")
        _active = self
        try:
            yield self
        finally:
            _active = None
            self._groups.append(self._open)
            self._open = []

    def put(self, closure) -> None:
        self._open.append(closure)

    def pop(self) -> None:
        """Run the oldest group's weight gradients (one micro-batch's W)."""
        if not self._groups:
            raise RuntimeError("a weight pass with no deferred weight gradients")
        for closure in self._groups.popleft():
            closure()

    def __len__(self) -> int:
        return len(self._groups)


# Whether the linear layers build their graph so that a store can defer weight gradients: only a
# zero-bubble executor asks for it. Otherwise F.linear (the same numbers: LinearFunction's forward is
# F.linear and its backward the same two GEMMs): non-reentrant activation checkpointing stops its
# recomputation early on autograd's own nodes but not on a Function's, which recomputed one GEMM
# more per layer under full recompute (tests/families/gpt/test_flops.py counts it).
_deferrable = False


def allow_deferral(on: bool) -> None:
    """Set by the pipeline executor: True when its schedule has weight passes (ZB-H1)."""
    global _deferrable
    _deferrable = on


def weight_grad_now_or_later(weight: torch.Tensor, compute, fp32=None, *, deferrable: bool = True):
    """For an autograd Function's backward: ``compute()`` (the weight's gradient) now, or None when a
    store is deferring, which then accumulates ``compute()`` into ``weight`` at its weight pass.
    Only a parameter itself (a leaf) can take its gradient later: a cast or view of it has a graph
    that this backward frees.

    A weight with a ``main_grad`` (gradient accumulation fusion, ``fuses_into_main_grad``) gets no
    ``.grad``: ``fp32()`` (default ``compute()``), its gradient computed in fp32, is added into that
    buffer now or at the weight pass, and None is returned."""
    later = deferrable and _active is not None and weight.grad_fn is None
    if fuses_into_main_grad(weight):
        def work():
            accumulate_main_grad(weight, (fp32 or compute)())
    elif later:
        def work():  # Tensor.backward on a leaf: the gradient goes through weight's AccumulateGrad node and hooks
            weight.backward(compute())
    else:
        return compute()
    if later:
        _active.put(work)
    else:
        work()
    return None


def linear_weight_grad(weight: torch.Tensor, x: torch.Tensor, grad_out: torch.Tensor, *, deferrable: bool = True):
    """``weight_grad_now_or_later`` for ``y = x W^T``: ``grad_out^T x``, in fp32 where it is fused."""
    return weight_grad_now_or_later(weight, lambda: weight_gradient(x, grad_out),
                                    lambda: weight_gradient_fp32(x, grad_out), deferrable=deferrable)


def weight_gradient(x: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    return grad_out.reshape(-1, grad_out.size(-1)).t().matmul(x.reshape(-1, x.size(-1)))


# --- gradient accumulation fusion ------------------------------------------------------------------
# Megatron's --gradient-accumulation-fusion (its default) has the weight-gradient GEMM of a
# tensor-parallel linear layer add its fp32 result straight into the parameter's fp32 ``main_grad``
# (apex's fused_weight_gradient_mlp_cuda, beta = 1), so no 16-bit ``.grad`` is written, read back
# and added. Here ``main_grad`` is DeepSpeed's own fp32 gradient of the parameter, linked by
# ``training.engine`` where its optimizer keeps one (``ds_compat.link_main_grads``). The backward only
# adds into it (no Python side effects): torch.compile keeps it in a compiled layer's graph.


def fuses_into_main_grad(weight: torch.Tensor) -> bool:
    return getattr(weight, "main_grad", None) is not None


def weight_gradient_fp32(x: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """``grad_out^T x`` in fp32 from 16-bit operands: the products of two bf16/fp16 numbers are exact
    in fp32 and summed in fp32, with no rounding of the result to 16 bits. On CUDA one cuBLAS GEMM
    with an fp32 output (``torch.mm(..., out_dtype=)``); the CPU has no such kernel, so the operands
    are widened first, which computes the same sums."""
    g = grad_out.reshape(-1, grad_out.size(-1)).t()
    x2 = x.reshape(-1, x.size(-1)).to(g.dtype)
    if g.dtype == torch.float32:
        return g.matmul(x2)
    if g.device.type == "cuda":
        return torch.mm(g, x2, out_dtype=torch.float32)
    return g.float().matmul(x2.float())


def accumulate_main_grad(weight: torch.Tensor, grad: torch.Tensor) -> None:
    # no_grad: a zero-bubble weight pass runs this outside backward, where grad mode is on
    with torch.no_grad():
        weight.main_grad.add_(grad.view(weight.main_grad.shape))


class LinearFunction(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` whose weight gradient a deferring ``WeightGradStore`` takes
    (the W pass); otherwise computed at once, by the same code."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x = grad_out.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_w = grad_b = None
        if ctx.needs_input_grad[1]:
            grad_w = linear_weight_grad(weight, x, grad_out)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_out.reshape(-1, grad_out.size(-1)).sum(dim=0)
        return grad_x, grad_w, grad_b


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` with a deferrable weight gradient, or one added into ``weight.main_grad``
    (gradient accumulation fusion); plain ``F.linear`` where nothing needs a gradient (inference,
    evaluation) and under torch autocast (DeepSpeed's "torch_autocast" block), which casts F.linear's
    operands but would leave a Function's backward in mixed dtypes: there autograd keeps the weight
    gradient (not deferred, not fused): DeepSpeed adds it into the same buffer."""
    if not (_deferrable or fuses_into_main_grad(weight)):
        return F.linear(x, weight, bias)
    if not torch.is_grad_enabled() or not (x.requires_grad or weight.requires_grad):
        return F.linear(x, weight, bias)
    if torch.is_autocast_enabled(x.device.type):
        return F.linear(x, weight, bias)
    return LinearFunction.apply(x, weight, bias)
