"""parallel/fp8.py's GEMMs against an independent quantize-dequantize reference.

Current scaling, as torchao computes it: scale = finfo(dtype).max / amax (per tensor, or per row of the
GEMM's reduction for rowwise), 2^-margin below that with a margin; the operand is rounded to float8 at
``x * scale`` (saturating) and the product of the rounded operands is divided by both scales. The CPU
emulation multiplies the dequantized operands in fp32, so it must equal the reference up to fp32
summation order (1e-6 relative); the output, input gradient and weight gradient are each checked."""
from __future__ import annotations

import pytest
import torch

from megatron_ds.parallel.fp8 import Fp8Recipe, fp8_linear
from megatron_ds.parallel.weight_grad import WeightGradStore

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _q(t: torch.Tensor, dtype: torch.dtype, rowwise_dim: int | None, margin: int) -> torch.Tensor:
    """``t`` rounded to ``dtype`` under its current scale, back in fp32."""
    t = t.float()
    amax = t.abs().amax(dim=rowwise_dim, keepdim=True) if rowwise_dim is not None else t.abs().max()
    scale = torch.finfo(dtype).max / amax.double().clamp(min=1e-12) / 2.0 ** margin
    scale = scale.float()
    return (t * scale).clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max).to(dtype).float() / scale


def _reference(x, w, g, recipe: Fp8Recipe):
    """(y, grad_x, grad_w) with every GEMM operand quantized as the recipe says."""
    fwd, bwd = E4M3, (E5M2 if recipe.format == "hybrid" else E4M3)
    row = recipe.granularity == "rowwise"
    m = recipe.margin
    y = _q(x, fwd, -1 if row else None, m) @ _q(w, fwd, -1 if row else None, m).t()
    grad_x = _q(g, bwd, -1 if row else None, m) @ _q(w, fwd, 0 if row else None, m)
    grad_w = (_q(g, bwd, 0 if row else None, m).t() @ _q(x, fwd, 0 if row else None, m) if recipe.wgrad
              else g.t() @ x)
    return y, grad_x, grad_w


@pytest.mark.parametrize("recipe", [Fp8Recipe("hybrid"), Fp8Recipe("e4m3"), Fp8Recipe("e4m3", "rowwise"),
                                    Fp8Recipe("hybrid", margin=3), Fp8Recipe("hybrid", wgrad=False)])
def test_gemms_equal_the_quantized_reference(recipe):
    gen = torch.Generator().manual_seed(0)
    # rows of very different magnitude: rowwise and tensorwise scales then round differently
    x = (torch.randn(24, 64, generator=gen) * torch.logspace(-2, 1, 24)[:, None]).requires_grad_()
    w = torch.randn(32, 64, generator=gen).requires_grad_()
    g = torch.randn(24, 32, generator=gen)
    y = fp8_linear(x, w, None, recipe)
    y.backward(g)
    want_y, want_gx, want_gw = _reference(x.detach(), w.detach(), g, recipe)
    for got, want in ((y, want_y), (x.grad, want_gx), (w.grad, want_gw)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * want.abs().max().item())
    # and FP8 did round: the exact product is further away than the summation order could explain
    assert (y - x.detach() @ w.detach().t()).abs().max() > 1e-3


def test_weight_gradient_deferred_by_a_zero_bubble_store():
    """The W pass of ZB-H1 takes FP8's weight gradient as it takes the bf16 one: none in backward,
    the same numbers when the store runs it."""
    gen = torch.Generator().manual_seed(1)
    x, g = torch.randn(8, 16, generator=gen, requires_grad=True), torch.randn(8, 16, generator=gen)
    w = torch.nn.Parameter(torch.randn(16, 16, generator=gen))
    fp8_linear(x, w, None, Fp8Recipe()).backward(g)
    immediate, x.grad, w.grad = w.grad.clone(), None, None
    store = WeightGradStore()
    with store.deferring():
        fp8_linear(x, w, None, Fp8Recipe()).backward(g)
    assert w.grad is None and x.grad is not None
    store.pop()
    assert torch.equal(w.grad, immediate)


def _overlap_worker(rank, world_size, sequence_parallel):
    import torch.distributed as dist

    from megatron_ds.parallel.layers import ColumnParallelLinear, init_method_normal

    group = dist.new_group(list(range(world_size)))
    grads = {}
    for overlap in (True, False):
        torch.manual_seed(0)
        layer = ColumnParallelLinear(16, 32, tp_group=group, gather_output=False, init_method=init_method_normal(0.5),
                                     sequence_parallel=sequence_parallel, async_grad_comm=overlap, fp8=Fp8Recipe())
        seed = rank if sequence_parallel else 0  # a shard of the sequence per rank, else the replicated input
        x = torch.randn(4 if sequence_parallel else 8, 2, 16, generator=torch.Generator().manual_seed(seed))
        x.requires_grad_()
        out, _ = layer(x)
        out.square().sum().backward()
        grads[overlap] = (out.detach(), x.grad, layer.weight.grad, layer.bias.grad)
    return grads


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["all_reduce", "sequence_parallel"])
def test_overlapped_tp_backward_runs_the_same_fp8_gemms(sequence_parallel):
    """At TP 2 the overlapped column-parallel backward (parallel/async_comm.py) and the synchronous one
    (--no-async-tensor-model-parallel-allreduce) give the same FP8 numbers bit for bit."""
    from tests.distributed import run_distributed

    for grads in run_distributed(_overlap_worker, 2, sequence_parallel, timeout=120):
        for a, b in zip(grads[True], grads[False]):
            assert torch.equal(a, b)


def test_torch_compile_traces_the_fp8_linear_whole():
    """On CUDA the layers are compiled by default (--compile-layers): dynamo must take the FP8 linear
    into its graph, torchao's float8 tensors included, with no graph break and the eager numbers.
    aot_eager stops before code generation (no C++ compiler needed) after the tracing that matters."""
    from torch._dynamo.utils import counters

    def f(x, w):
        return torch.nn.functional.gelu(fp8_linear(x, w, None, Fp8Recipe()))

    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(32, 64, generator=gen, requires_grad=True), torch.randn(48, 64, generator=gen, requires_grad=True)
    f(x, w).sum().backward()
    eager = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    torch._dynamo.reset()
    counters.clear()
    torch.compile(f, backend="aot_eager", fullgraph=True)(x, w).sum().backward()
    assert not counters["graph_break"]
    assert torch.equal(x.grad, eager[0]) and torch.equal(w.grad, eager[1])
    torch._dynamo.reset()
