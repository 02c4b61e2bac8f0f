"""Forward and backward of every mapping against explicit formulas.

Every rank can recompute every other rank's tensors (they are seeded by rank), so the expected
values are built locally from the definitions: sums, chunks, concatenations. One 4-process run
checks tensor-parallel size 4 (the world) and size 2 (two subgroups, where group rank != global
rank), through both the portable collectives and the single-tensor ones used on NCCL.
"""
import pytest
import torch
import torch.distributed as dist

from megatron_ds.parallel import mappings as M
from tests.distributed import run_distributed

SEQ, BATCH, HIDDEN = 8, 3, 8  # seq and hidden divisible by 4 and 2


def _rand(shape, seed):
    # Non-contiguous on purpose: the mappings must not assume a layout.
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tuple(reversed(shape)), generator=g).permute(*reversed(range(len(shape))))


def _assert_sum_close(actual, expected):
    # Sums of 2-4 fp32 N(0,1) values; the collective may add in another order than the reference:
    # differences are a few ulps (~1e-7 relative).
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)


def _fwd_bwd(fn, x, grad):
    x = x.detach().requires_grad_(True)
    y = fn(x)
    y.backward(grad)
    return y.detach(), x.grad


def _check_mappings(group, tag):
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    full, part = (SEQ, BATCH, HIDDEN), (SEQ, BATCH, HIDDEN // world)
    seq_part = (SEQ // world, BATCH, HIDDEN)
    per_rank = lambda shape, salt: [_rand(shape, 1000 * salt + r) for r in range(world)]  # noqa: E731
    hchunk = lambda t, r: t[..., r * (HIDDEN // world):(r + 1) * (HIDDEN // world)]  # noqa: E731
    schunk = lambda t, r: t[r * (SEQ // world):(r + 1) * (SEQ // world)]  # noqa: E731

    xs, gs = per_rank(full, 1), per_rank(full, 2)
    y, gx = _fwd_bwd(lambda x: M.copy_to_tensor_parallel_region(x, group), xs[rank], gs[rank])
    assert torch.equal(y, xs[rank]), tag
    _assert_sum_close(gx, sum(gs))

    y, gx = _fwd_bwd(lambda x: M.reduce_from_tensor_parallel_region(x, group), xs[rank], gs[rank])
    _assert_sum_close(y, sum(xs))
    assert torch.equal(gx, gs[rank]), tag

    x_full, gparts = _rand(full, 3), per_rank(part, 4)
    y, gx = _fwd_bwd(lambda x: M.scatter_to_tensor_parallel_region(x, group), x_full, gparts[rank])
    assert torch.equal(y, hchunk(x_full, rank)), tag
    assert torch.equal(gx, torch.cat(gparts, dim=-1)), tag

    xparts = per_rank(part, 5)
    y, gx = _fwd_bwd(lambda x: M.gather_from_tensor_parallel_region(x, group), xparts[rank], gs[rank])
    assert torch.equal(y, torch.cat(xparts, dim=-1)), tag
    assert torch.equal(gx, hchunk(gs[rank], rank)), tag

    gseq = per_rank(seq_part, 6)
    y, gx = _fwd_bwd(lambda x: M.scatter_to_sequence_parallel_region(x, group), x_full, gseq[rank])
    assert torch.equal(y, schunk(x_full, rank)), tag
    assert torch.equal(gx, torch.cat(gseq, dim=0)), tag

    xseq = per_rank(seq_part, 7)
    y, gx = _fwd_bwd(lambda x: M.gather_from_sequence_parallel_region(x, group), xseq[rank], gs[rank])
    assert torch.equal(y, torch.cat(xseq, dim=0)), tag
    _assert_sum_close(gx, schunk(sum(gs), rank))  # consumer is tensor parallel: grads are partial

    y, gx = _fwd_bwd(lambda x: M.gather_from_sequence_parallel_region(x, group, tensor_parallel_output_grad=False),
                     xseq[rank], gs[rank])
    assert torch.equal(y, torch.cat(xseq, dim=0)), tag
    assert torch.equal(gx, schunk(gs[rank], rank)), tag  # consumer replicated: grad already complete

    y, gx = _fwd_bwd(lambda x: M.reduce_scatter_to_sequence_parallel_region(x, group), xs[rank], gseq[rank])
    _assert_sum_close(y, schunk(sum(xs), rank))
    assert torch.equal(gx, torch.cat(gseq, dim=0)), tag

    # The input is never changed by a mapping (in-place collectives would corrupt saved tensors).
    x = xs[rank].clone()
    M.reduce_from_tensor_parallel_region(x, group)
    M.reduce_scatter_to_sequence_parallel_region(x, group)
    assert torch.equal(x, xs[rank]), tag


def _gloo_has_single_tensor_collectives():
    try:
        out = torch.empty(1)
        M._reduce_scatter_single(out, torch.ones(dist.get_world_size()))
        M._all_gather_single(torch.empty(dist.get_world_size()), torch.ones(1))
        return True
    except (RuntimeError, NotImplementedError):
        return False


def _all_mapping_checks(rank, world_size):
    groups = [(world_size, dist.group.WORLD), (2, dist.new_subgroups(2)[0])]
    for tp, group in groups:
        _check_mappings(group, f"portable collectives, tp={tp}")
    native = _gloo_has_single_tensor_collectives()
    if native:
        M._native_single_tensor_collectives = lambda group, tensor: True  # this child process only
        for tp, group in groups:
            _check_mappings(group, f"single-tensor collectives, tp={tp}")
    return native


def test_mappings_forward_backward_tp2_tp4():
    native = run_distributed(_all_mapping_checks, 4)
    if not all(native):
        pytest.skip("this torch's gloo lacks single-tensor collectives; only the portable path was checked")


def test_no_group_is_identity_without_autograd_node():
    x = torch.randn(4, 2, 6, requires_grad=True)
    for fn in (M.copy_to_tensor_parallel_region, M.reduce_from_tensor_parallel_region,
               M.scatter_to_tensor_parallel_region, M.gather_from_tensor_parallel_region,
               M.scatter_to_sequence_parallel_region, M.gather_from_sequence_parallel_region,
               M.reduce_scatter_to_sequence_parallel_region):
        assert fn(x, None) is x


def test_backend_detection_reads_the_group_backend(monkeypatch):
    cpu, gpu = torch.empty(1), torch.empty(1, device="meta")
    monkeypatch.setattr(dist, "get_backend", lambda group: "nccl")
    assert M._native_single_tensor_collectives(None, cpu)
    monkeypatch.setattr(dist, "get_backend", lambda group: "gloo")
    assert not M._native_single_tensor_collectives(None, cpu)
    # Mixed backends are per device type.
    monkeypatch.setattr(dist, "get_backend", lambda group: "cpu:gloo,meta:nccl")
    assert not M._native_single_tensor_collectives(None, cpu)
    assert M._native_single_tensor_collectives(None, gpu)
