"""The column-parallel layers' backward overlaps the input gradient's communication with the
weight-gradient GEMM (``megatron_ds/parallel/async_comm.py``), and computes the same numbers.

The link is made slow on purpose: every asynchronous all-reduce (the input gradient's; on gloo the
reduce-scatter under sequence parallelism is one too) completes no earlier than DELAY seconds after
it was issued. The timeline of one backward then shows the overlap: the weight-gradient GEMM starts
after the collective was issued and long before it can have finished. With
``async_grad_comm=False`` (``--no-async-tensor-model-parallel-allreduce``) the collective blocks,
and the gradients are the same bit for bit: the same GEMMs on the same
operands, the same sums over the same ranks.
"""
import time

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_distributed

DELAY = 0.3  # seconds: far longer than the tiny GEMMs, far shorter than the test's patience


def _timeline(layer, x):
    """(events, grads) of one backward: events are (name, time) in the order they happened."""
    from megatron_ds.parallel import weight_grad

    events = []
    real_all_reduce, real_weight_gradient = dist.all_reduce, weight_grad.weight_gradient

    class SlowWork:
        def __init__(self, work):
            self.work, self.issued = work, time.monotonic()

        def wait(self):
            time.sleep(max(0.0, self.issued + DELAY - time.monotonic()))
            self.work.wait()
            events.append(("collective done", time.monotonic()))
            return True

    def all_reduce(tensor, *args, async_op=False, **kwargs):
        events.append(("collective issued", time.monotonic()))
        work = real_all_reduce(tensor, *args, async_op=async_op, **kwargs)
        if not async_op:
            events.append(("collective done", time.monotonic()))
            return work
        return SlowWork(work)

    def weight_gradient(*args):
        events.append(("weight GEMM", time.monotonic()))
        return real_weight_gradient(*args)

    dist.all_reduce, weight_grad.weight_gradient = all_reduce, weight_gradient
    try:
        out, _ = layer(x)
        out.square().sum().backward()
    finally:
        dist.all_reduce, weight_grad.weight_gradient = real_all_reduce, real_weight_gradient
    return events, (x.grad.clone(), layer.weight.grad.clone(), layer.bias.grad.clone())


def overlap_worker(rank, world_size, sequence_parallel):
    from megatron_ds.parallel.layers import ColumnParallelLinear, init_method_normal

    group = dist.new_group(list(range(world_size)))
    seq = 8 // world_size if sequence_parallel else 8
    out = {}
    for overlap in (True, False):
        torch.manual_seed(0)
        layer = ColumnParallelLinear(16, 32, tp_group=group, gather_output=False, init_method=init_method_normal(0.5),
                                     sequence_parallel=sequence_parallel, async_grad_comm=overlap)
        # every rank's own shard under sequence parallelism, the same replicated input otherwise
        x = torch.randn(seq, 2, 16, generator=torch.Generator().manual_seed(rank if sequence_parallel else 0))
        out[overlap] = _timeline(layer, x.requires_grad_())
    return out


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["all_reduce", "sequence_parallel"])
def test_weight_gemm_runs_while_the_input_gradient_travels(sequence_parallel):
    for rank_result in run_distributed(overlap_worker, 2, sequence_parallel, timeout=120):
        (events, grads), (sync_events, sync_grads) = rank_result[True], rank_result[False]
        names = [name for name, _ in events]
        assert names == ["collective issued", "weight GEMM", "collective done"], names
        issued, gemm, done = (t for _, t in events)
        assert gemm - issued < DELAY / 3 and done - issued >= DELAY  # the GEMM did not wait for the bytes
        # the synchronous path: a blocking all-reduce (copy_to_tensor_parallel_region's backward, after
        # autograd's own GEMMs; under sequence parallelism the reduce-scatter's gloo fallback, before the
        # weight GEMM, which waits for it)
        assert [name for name, _ in sync_events] == ["collective issued", "collective done"] + (
            ["weight GEMM"] if sequence_parallel else [])
        for a, b in zip(grads, sync_grads):
            assert torch.equal(a, b)
