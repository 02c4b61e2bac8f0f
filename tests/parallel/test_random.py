"""RNG tracker and activation checkpointing.

Dropout masks are compared exactly: they are the same or different bits, there is no rounding.
Checkpointing is compared with torch.equal as well: the recomputation runs the same ops on the same
inputs with the same random masks, so every gradient must be bit-identical to the plain run.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint

from megatron_ds.parallel.layers import ColumnParallelLinear, RowParallelLinear, init_method_normal
from megatron_ds.parallel.random import (
    TENSOR_PARALLEL_RNG,
    RNGStatesTracker,
    checkpoint,
    get_rng_tracker,
    set_parallel_seeds,
)
from tests.distributed import run_distributed

HIDDEN, FFN = 8, 16


def _dropout_masks(device="cpu"):
    ones = torch.ones(64, device=device)
    outside = F.dropout(ones, 0.5, training=True) != 0
    with get_rng_tracker().fork():
        inside = F.dropout(ones, 0.5, training=True) != 0
    return outside, inside


class _Block(torch.nn.Module):
    """An MLP with dropout inside the tensor-parallel region (tracker stream) and after it
    (default stream), as in a transformer layer."""

    def __init__(self, group, device=None):
        super().__init__()
        init = init_method_normal(0.3)
        self.fc1 = ColumnParallelLinear(HIDDEN, FFN, tp_group=group, gather_output=False, init_method=init,
                                        device=device)
        self.fc2 = RowParallelLinear(FFN, HIDDEN, tp_group=group, input_is_parallel=True, init_method=init,
                                     device=device)

    def forward(self, x, scale, offset):  # scale: a Python float; offset: a tensor without grad
        h, _ = self.fc1(x)
        with get_rng_tracker().fork():
            h = F.dropout(h, 0.5, training=True)
        y, _ = self.fc2(F.gelu(h) * scale + offset)
        return F.dropout(y, 0.3, training=True) + x


def _run_blocks(group, tp_rank, checkpoint_fn, device="cpu"):
    """Two blocks, forward + backward; returns the output, every gradient, and the next draws of
    both RNG streams (the checkpointed run must leave them where the plain run does)."""
    torch.manual_seed(0)
    blocks = [_Block(group, device), _Block(group, device)]
    x = torch.randn(4, 2, HIDDEN, generator=torch.Generator().manual_seed(1)).to(device).requires_grad_(True)
    offset = torch.full((FFN // (dist.get_world_size(group) if group else 1),), 0.1, device=device)
    set_parallel_seeds(1234, tp_rank)
    h = x
    for block in blocks:
        h = checkpoint_fn(block, h, 2.0, offset) if checkpoint_fn else block(h, 2.0, offset)
    h.square().sum().backward()
    grads = [x.grad] + [p.grad for b in blocks for p in b.parameters()]
    after = _dropout_masks(device)
    return h.detach(), grads, after


def _assert_bit_identical(plain, ckpt):
    out_a, grads_a, after_a = plain
    out_b, grads_b, after_b = ckpt
    assert torch.equal(out_a, out_b)
    assert len(grads_a) == len(grads_b)
    for a, b in zip(grads_a, grads_b):
        assert torch.equal(a, b)
    for a, b in zip(after_a, after_b):
        assert torch.equal(a, b)


def _tensor_parallel_rng_checks(rank, world_size):
    group = dist.group.WORLD
    set_parallel_seeds(1234, tp_rank=rank)
    outside, inside = _dropout_masks()
    gathered = [None] * world_size
    dist.all_gather_object(gathered, (outside, inside))
    assert torch.equal(gathered[0][0], gathered[1][0])  # replicated region: same mask on every rank
    assert not torch.equal(gathered[0][1], gathered[1][1])  # tensor-parallel region: masks differ

    _assert_bit_identical(_run_blocks(group, rank, None), _run_blocks(group, rank, checkpoint))
    return True


def test_tracker_and_checkpointing_tp2():
    assert run_distributed(_tensor_parallel_rng_checks, 2) == [True, True]


def test_checkpointing_bit_identical_tp1():
    _assert_bit_identical(_run_blocks(None, 0, None), _run_blocks(None, 0, checkpoint))


def test_plain_torch_checkpoint_would_not_replay_tracker():
    # The control for the test above: torch alone restores only the default generators, so the
    # recomputed tensor-parallel dropout differs and the gradients change.
    def torch_only(fn, *args):
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)

    plain, ckpt = _run_blocks(None, 0, None), _run_blocks(None, 0, torch_only)
    assert not all(torch.equal(a, b) for a, b in zip(plain[1], ckpt[1]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_streams_and_checkpointing():
    set_parallel_seeds(1234, tp_rank=0)
    outside0, inside0 = _dropout_masks("cuda")
    set_parallel_seeds(1234, tp_rank=1)
    outside1, inside1 = _dropout_masks("cuda")
    assert torch.equal(outside0, outside1) and not torch.equal(inside0, inside1)
    _assert_bit_identical(_run_blocks(None, 0, None, "cuda"), _run_blocks(None, 0, checkpoint, "cuda"))


def test_checkpoint_handles_non_tensor_args_and_inputs_without_grad():
    set_parallel_seeds(7, 0)
    w = torch.randn(3, 3, requires_grad=True)
    x = torch.randn(2, 3)  # does not require grad: only w gets a gradient

    def fn(inp, mode, extra):
        assert mode == "relu" and extra is None
        with get_rng_tracker().fork():
            return F.dropout(torch.relu(inp @ w), 0.5, training=True)

    checkpoint(fn, x, "relu", None).sum().backward()
    grad_ckpt = w.grad.clone()
    w.grad = None
    set_parallel_seeds(7, 0)
    fn(x, "relu", None).sum().backward()
    assert torch.equal(w.grad, grad_ckpt)


def test_fork_switches_streams_and_restores_default():
    set_parallel_seeds(3, tp_rank=0)
    default_state = torch.get_rng_state()
    with get_rng_tracker().fork():
        first = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), default_state)  # default generator untouched
    with get_rng_tracker().fork(TENSOR_PARALLEL_RNG):
        second = torch.rand(4)
    assert not torch.equal(first, second)  # the stream continues, it does not restart
    # The stream is the one a generator seeded with seed + 2718 + tp_rank produces.
    g = torch.Generator().manual_seed(3 + 2718 + 0)
    assert torch.equal(torch.cat([first, second]), torch.rand(8, generator=g))
    # And the default stream is seeded with the plain seed.
    assert torch.equal(torch.rand(4), torch.rand(4, generator=torch.Generator().manual_seed(3)))


def test_states_round_trip_for_checkpoints():
    tracker = get_rng_tracker()
    set_parallel_seeds(11, tp_rank=1)
    saved = tracker.get_states()
    with tracker.fork():
        a = torch.rand(5)
    tracker.set_states(saved)
    with tracker.fork():
        b = torch.rand(5)
    assert torch.equal(a, b)


def test_tracker_errors():
    tracker = RNGStatesTracker()
    tracker.add("a", 1)
    with pytest.raises(ValueError, match="already exists"):
        tracker.add("a", 2)
    with pytest.raises(ValueError, match="already used"):
        tracker.add("b", 1)
    with pytest.raises(KeyError, match="set_parallel_seeds"):
        with tracker.fork("missing"):
            pass
    with pytest.raises(ValueError):
        set_parallel_seeds(-1, 0)


def test_rewound_puts_the_streams_back_and_an_open_fork_still_saves():
    """A compiler's probe run draws inside ``rewound()``: afterwards every stream is where it was, and
    a fork open around it still records its own draws when it ends."""
    set_parallel_seeds(5, 0)
    tracker = get_rng_tracker()
    with tracker.fork():
        with tracker.rewound():
            with tracker.fork():
                torch.rand(3)
        first = torch.rand(3)
    with tracker.fork():
        second = torch.rand(3)
    set_parallel_seeds(5, 0)
    with tracker.fork():
        want = torch.rand(6)
    assert torch.equal(torch.cat([first, second]), want)
