"""Deferred weight gradients (the zero-bubble W pass) against autograd's own linear layer."""
import pytest
import torch
import torch.nn.functional as F

from megatron_ds.parallel import weight_grad
from megatron_ds.parallel.weight_grad import WeightGradStore, linear


@pytest.fixture(autouse=True)
def _deferrable():
    """As a zero-bubble executor sets it; every other run builds plain F.linear graphs."""
    weight_grad.allow_deferral(True)
    yield
    weight_grad.allow_deferral(False)


def test_plain_linear_unless_a_schedule_defers():
    x, w = torch.randn(2, 3, requires_grad=True), torch.randn(4, 3, requires_grad=True)
    assert "LinearFunction" in type(linear(x, w).grad_fn).__name__
    weight_grad.allow_deferral(False)
    assert "LinearFunction" not in type(linear(x, w).grad_fn).__name__


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 3, 8, generator=g, requires_grad=True)
    return x, torch.randn(5, 3, 6, generator=g)


def test_same_gradients_as_torch_linear():
    weight = torch.nn.Parameter(torch.randn(6, 8, generator=torch.Generator().manual_seed(0)))
    bias = torch.nn.Parameter(torch.zeros(6))
    x, grad = _inputs(1)
    linear(x, weight, bias).backward(grad)
    ref_w, ref_b = weight.detach().clone().requires_grad_(), bias.detach().clone().requires_grad_()
    ref_x = x.detach().clone().requires_grad_()
    F.linear(ref_x, ref_w, ref_b).backward(grad)
    # another summation order than autograd's matmul: equal to rounding
    for a, b in ((x.grad, ref_x.grad), (weight.grad, ref_w.grad), (bias.grad, ref_b.grad)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_deferred_equals_immediate_bit_for_bit_and_fires_hooks():
    """Two micro-batches: immediate, then deferred with the weight pass run later. The input and
    bias gradients are there after the input backward; the weight's only after the weight pass,
    through its AccumulateGrad node (a hook registered on the parameter sees both)."""
    immediate = torch.nn.Parameter(torch.randn(6, 8, generator=torch.Generator().manual_seed(0)))
    deferred = torch.nn.Parameter(immediate.detach().clone())
    seen = []
    # (the hook also runs, with the gradient unchanged, when the input backward passes the parameter by)
    deferred.register_post_accumulate_grad_hook(lambda p: seen.append(None if p.grad is None else p.grad.clone()))
    store = WeightGradStore()
    for seed in (1, 2):
        x, grad = _inputs(seed)
        linear(x, immediate).backward(grad)
        x2 = x.detach().clone().requires_grad_()
        before = None if deferred.grad is None else deferred.grad.clone()
        with store.deferring():
            linear(x2, deferred).backward(grad)
        assert torch.equal(x2.grad, x.grad)
        # the weight gradient waits in the store
        assert len(store) == 1 and (deferred.grad is None if before is None else torch.equal(deferred.grad, before))
        store.pop()
        assert torch.equal(deferred.grad, immediate.grad) and torch.equal(seen[-1], deferred.grad)
    with pytest.raises(RuntimeError, match="no deferred weight gradients"):
        store.pop()


def test_a_non_leaf_weight_is_not_deferred():
    # e.g. a cast of the parameter: its graph is freed by the input backward, so W happens at once
    param = torch.nn.Parameter(torch.randn(6, 8, dtype=torch.float64))
    x, grad = _inputs(3)
    store = WeightGradStore()
    with store.deferring():
        linear(x, param.float()).backward(grad)
    assert param.grad is not None
    store.pop()  # an empty group: the schedule's weight pass still has its place


def test_autocast_keeps_autograds_linear():
    weight = torch.nn.Parameter(torch.randn(6, 8))
    x, grad = _inputs(4)
    store = WeightGradStore()
    with store.deferring(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = linear(x, weight)
    out.float().backward(grad)
    assert out.dtype == torch.bfloat16 and weight.grad is not None
    store.pop()  # nothing was deferred
