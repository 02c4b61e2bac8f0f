"""Tensor-parallel layers against the dense single-process computation.

The dense reference uses the full master weight (created with the same seed and init method as the
layer), plain matmuls and torch's embedding, and autograd for the gradients; each rank compares
its shard of outputs, input grads and weight grads. Tensor-parallel size 1 runs in this process
(tp_group=None); sizes 4 and 2 run in one 4-process job (2 = two subgroups, whose group ranks
differ from the global ranks).

Tolerance for anything that went through a matmul or a reduction: rtol = atol = 1e-5. The values
are fp32 dot products of length <= 12 with O(1) terms; splitting them over ranks (partial sums
added by the all-reduce) or letting the kernel block them differently changes the summation order,
which moves results by a few ulps (~1e-7 relative). A wrong shard, a missing or doubled reduction,
or a misplaced bias is an O(1) error. Lookups and copies are compared exactly.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_ds.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    register_sequence_parallel_grad_hooks,
    init_method_normal,
    scaled_init_method_normal,
)
from megatron_ds.parallel.utils import pad_vocab_size, tp_rank, tp_world_size
from tests.distributed import run_distributed

SEQ, BATCH = 8, 2  # SEQ divisible by every tensor-parallel size tested
INIT = init_method_normal(0.5)
TOL = dict(rtol=1e-5, atol=1e-5)  # see the module docstring


def _rand(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _master(shape, seed, init=INIT):
    torch.manual_seed(seed)
    w = torch.empty(shape)
    init(w)
    return w


def _chunk(t, dim, group):
    return t.chunk(tp_world_size(group), dim=dim)[tp_rank(group)]


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


def _check_column(group, gather_output, skip_bias_add, sequence_parallel):
    tag = f"column gather={gather_output} skip_bias={skip_bias_add} sp={sequence_parallel}"
    in_size, out_size = 8, 12
    torch.manual_seed(1)
    layer = ColumnParallelLinear(in_size, out_size, tp_group=group, gather_output=gather_output, init_method=INIT,
                                 skip_bias_add=skip_bias_add, sequence_parallel=sequence_parallel)
    w = _master((out_size, in_size), 1)
    assert torch.equal(layer.weight.detach(), _chunk(w, 0, group)), tag  # master-weight slice, bit for bit
    b = _rand((out_size,), 2)
    layer.bias.data.copy_(_chunk(b, 0, group))
    x, g = _rand((SEQ, BATCH, in_size), 3), _rand((SEQ, BATCH, out_size), 4)

    xd, wd, bd = _leaf(x), _leaf(w), _leaf(b)
    yd = xd @ wd.t() + (0 if skip_bias_add else bd)
    (yd * g).sum().backward()

    x_in = _leaf(_chunk(x, 0, group) if sequence_parallel else x)
    y, out_bias = layer(x_in)
    expected, g_local = (yd, g) if gather_output else (_chunk(yd, -1, group), _chunk(g, -1, group))
    torch.testing.assert_close(y, expected.detach(), **TOL, msg=tag)
    assert out_bias is (layer.bias if skip_bias_add else None), tag
    (y * g_local).sum().backward()

    expected_xgrad = _chunk(xd.grad, 0, group) if sequence_parallel else xd.grad
    torch.testing.assert_close(x_in.grad, expected_xgrad, **TOL, msg=tag)
    torch.testing.assert_close(layer.weight.grad, _chunk(wd.grad, 0, group), **TOL, msg=tag)
    if not skip_bias_add:
        torch.testing.assert_close(layer.bias.grad, _chunk(bd.grad, 0, group), **TOL, msg=tag)


def _check_row(group, input_is_parallel, skip_bias_add, sequence_parallel):
    tag = f"row input_parallel={input_is_parallel} skip_bias={skip_bias_add} sp={sequence_parallel}"
    in_size, out_size = 12, 8
    torch.manual_seed(5)
    layer = RowParallelLinear(in_size, out_size, tp_group=group, input_is_parallel=input_is_parallel,
                              init_method=INIT, skip_bias_add=skip_bias_add, sequence_parallel=sequence_parallel)
    w = _master((out_size, in_size), 5)
    assert torch.equal(layer.weight.detach(), _chunk(w, 1, group)), tag
    b = _rand((out_size,), 6)
    layer.bias.data.copy_(b)  # replicated, not split
    x, g = _rand((SEQ, BATCH, in_size), 7), _rand((SEQ, BATCH, out_size), 8)

    xd, wd, bd = _leaf(x), _leaf(w), _leaf(b)
    y_nobias = xd @ wd.t()
    ((y_nobias + bd) * g).sum().backward()

    register_sequence_parallel_grad_hooks(layer, group)  # what training does at start-up
    x_in = _leaf(_chunk(x, -1, group) if input_is_parallel else x)
    y, out_bias = layer(x_in)
    expected = y_nobias if skip_bias_add else y_nobias + bd
    g_local = g
    if sequence_parallel:  # output is this rank's part of the sequence
        expected, g_local = _chunk(expected, 0, group), _chunk(g, 0, group)
    torch.testing.assert_close(y, expected.detach(), **TOL, msg=tag)
    if skip_bias_add:
        assert out_bias is layer.bias, tag
        y = y + out_bias  # what the caller (e.g. a fused bias-dropout-add) does
    else:
        assert out_bias is None, tag
    (y * g_local).sum().backward()
    if sequence_parallel:
        assert layer.bias.sequence_parallel, tag

    expected_xgrad = _chunk(xd.grad, -1, group) if input_is_parallel else xd.grad
    torch.testing.assert_close(x_in.grad, expected_xgrad, **TOL, msg=tag)
    torch.testing.assert_close(layer.weight.grad, _chunk(wd.grad, 1, group), **TOL, msg=tag)
    torch.testing.assert_close(layer.bias.grad, bd.grad, **TOL, msg=tag)


def _boundary_ids(vocab, world, extra_seed):
    per = vocab // world
    ids = [i for r in range(world) for i in (r * per, (r + 1) * per - 1)]  # first/last id of each shard
    ids += torch.randint(0, vocab, (8,), generator=torch.Generator().manual_seed(extra_seed)).tolist()
    ids += [ids[0], ids[-1]]  # repeats: their gradients must accumulate
    return torch.tensor(ids[: len(ids) // 2 * 2]).view(2, -1)


def _check_embedding(group, orig_vocab, divisible_by):
    world = tp_world_size(group)
    vocab = pad_vocab_size(orig_vocab, divisible_by, world)
    tag = f"embedding vocab={orig_vocab}->{vocab}"
    dim = 4
    init = init_method_normal(1.0)
    torch.manual_seed(9)
    emb = VocabParallelEmbedding(vocab, dim, tp_group=group, init_method=init)
    e = _master((vocab, dim), 9, init)
    assert torch.equal(emb.weight.detach(), _chunk(e, 0, group)), tag

    ids = _boundary_ids(vocab, world, 10)
    g = _rand(tuple(ids.shape) + (dim,), 11)
    ed = _leaf(e)
    out_d = F.embedding(ids, ed)
    (out_d * g).sum().backward()

    out = emb(ids)
    assert torch.equal(out, out_d.detach()), tag  # one non-zero term per row: the all-reduce is exact
    (out * g).sum().backward()
    torch.testing.assert_close(emb.weight.grad, _chunk(ed.grad, 0, group), **TOL, msg=tag)


def _check_tied_output_layer(group, sequence_parallel):
    """GPT's output layer: logits = hidden @ word_embedding^T with the embedding's weight passed in."""
    tag = f"tied output sp={sequence_parallel}"
    world = tp_world_size(group)
    vocab, hidden = pad_vocab_size(37, 2, world), 8
    torch.manual_seed(12)
    emb = VocabParallelEmbedding(vocab, hidden, tp_group=group, init_method=INIT)
    head = ColumnParallelLinear(hidden, vocab, tp_group=group, bias=False, gather_output=False,
                                skip_weight_param_allocation=True, sequence_parallel=sequence_parallel)
    assert head.weight is None
    e = _master((vocab, hidden), 12)
    x, g = _rand((SEQ, BATCH, hidden), 13), _rand((SEQ, BATCH, vocab), 14)
    xd, ed = _leaf(x), _leaf(e)
    (xd @ ed.t() * g).sum().backward()

    x_in = _leaf(_chunk(x, 0, group) if sequence_parallel else x)
    logits, _ = head(x_in, weight=emb.weight)
    torch.testing.assert_close(logits, _chunk((x @ e.t()), -1, group), **TOL, msg=tag)
    (logits * _chunk(g, -1, group)).sum().backward()
    torch.testing.assert_close(emb.weight.grad, _chunk(ed.grad, 0, group), **TOL, msg=tag)
    expected_xgrad = _chunk(xd.grad, 0, group) if sequence_parallel else xd.grad
    torch.testing.assert_close(x_in.grad, expected_xgrad, **TOL, msg=tag)


def _check_all_layers(group):
    for gather_output in (True, False):
        for skip_bias_add in (False, True):
            _check_column(group, gather_output, skip_bias_add, sequence_parallel=False)
    for skip_bias_add in (False, True):
        _check_column(group, False, skip_bias_add, sequence_parallel=True)
    for input_is_parallel in (True, False):
        for skip_bias_add in (False, True):
            _check_row(group, input_is_parallel, skip_bias_add, sequence_parallel=False)
    for skip_bias_add in (False, True):
        _check_row(group, True, skip_bias_add, sequence_parallel=True)
    _check_embedding(group, 37, 2)
    _check_embedding(group, 50257, 128)
    _check_tied_output_layer(group, sequence_parallel=False)
    _check_tied_output_layer(group, sequence_parallel=True)


class _TensorParallelOnlyMPU:
    """The part of an mpu DeepSpeed's norm code reads, for a world that is only tensor parallel."""

    def __init__(self, group):
        self.group = group

    def get_model_parallel_rank(self):
        return dist.get_rank(self.group)

    def get_tensor_model_parallel_rank(self):
        return dist.get_rank(self.group)

    def get_model_parallel_group(self):
        return self.group


def _check_deepspeed_grad_norm(group):
    """DeepSpeed must count split parameters on every rank and replicated ones once."""
    from deepspeed.runtime.utils import clip_grad_norm_, get_weight_norm

    torch.manual_seed(20)
    col = ColumnParallelLinear(8, 12, tp_group=group, gather_output=False, init_method=INIT)
    row = RowParallelLinear(12, 8, tp_group=group, input_is_parallel=True, init_method=INIT)
    norm = torch.nn.LayerNorm(8)  # replicated
    col_bias = _rand((12,), 21)
    col.bias.data.copy_(_chunk(col_bias, 0, group))
    for seed, p in enumerate((row.bias, norm.weight, norm.bias), start=22):  # non-zero: each counts
        p.data.copy_(_rand(p.shape, seed))
    x = _rand((SEQ, BATCH, 8), 25)
    norm(row(col(x)[0])[0]).square().sum().backward()
    params = [col.weight, col.bias, row.weight, row.bias, norm.weight, norm.bias]

    # Dense reference: the same network with full weights. The row layer's master weight was drawn
    # right after the column layer's, from the same generator.
    torch.manual_seed(20)
    w_col, w_row = torch.empty(12, 8), torch.empty(8, 12)
    INIT(w_col)
    INIT(w_row)
    dense = [_leaf(t) for t in (w_col, col_bias, w_row, row.bias, norm.weight, norm.bias)]
    hidden = F.linear(x, dense[0], dense[1])
    F.layer_norm(F.linear(hidden, dense[2], dense[3]), (8,), dense[4], dense[5]).square().sum().backward()
    expected_grad_norm = torch.sqrt(sum(t.grad.square().sum() for t in dense)).item()
    expected_weight_norm = torch.sqrt(sum(t.detach().square().sum() for t in dense)).item()

    # rel 1e-5: norms of ~100 fp32 values, partial sums of squares added over ranks in another order.
    mpu = _TensorParallelOnlyMPU(group)
    assert get_weight_norm(params, mpu=mpu) == pytest.approx(expected_weight_norm, rel=1e-5)
    total = clip_grad_norm_(params, max_norm=1e9, mpu=mpu)  # huge max_norm: measure, do not clip
    assert total.item() == pytest.approx(expected_grad_norm, rel=1e-5)


def _all_layer_checks(rank, world_size):
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")  # clip_grad_norm_ talks through deepspeed.comm
    sub = dist.new_subgroups(2)[0]
    for group in (dist.group.WORLD, sub):
        _check_all_layers(group)
        _check_deepspeed_grad_norm(group)
        with pytest.raises(ValueError, match="pad_vocab_size"):
            VocabParallelEmbedding(37, 4, tp_group=group)


def test_layers_tp2_tp4_match_dense():
    run_distributed(_all_layer_checks, 4, timeout=240)


def test_layers_tp1_match_dense():
    _check_all_layers(None)


def test_parameter_attributes():
    col = ColumnParallelLinear(4, 6, tp_group=None)
    row = RowParallelLinear(6, 4, tp_group=None, input_is_parallel=True, sequence_parallel=True)
    emb = VocabParallelEmbedding(10, 4, tp_group=None)
    for p, dim in ((col.weight, 0), (col.bias, 0), (row.weight, 1), (emb.weight, 0)):
        assert p.tensor_model_parallel and p.partition_dim == dim and p.partition_stride == 1
    assert not getattr(row.bias, "tensor_model_parallel", False)  # replicated: counted once in grad norms
    assert row.bias.sequence_parallel


def test_strided_master_weight_shards(monkeypatch):
    # stride 2: the output dim is two interleaved blocks (e.g. a fused pair of projections); each
    # rank must own its part of both blocks. Pose as rank 1 of 2.
    import megatron_ds.parallel.layers as layers

    monkeypatch.setattr(layers, "tp_world_size", lambda group: 2)
    monkeypatch.setattr(layers, "tp_rank", lambda group: 1)
    w = _master((8, 3), 30)
    shard = layers._master_weight_shard((8, 3), 0, 2, lambda t: t.copy_(w), object(), torch.float32, None)
    assert torch.equal(shard, torch.cat([w[2:4], w[6:8]]))


def test_user_errors_are_clear():
    with pytest.raises(ValueError, match="gather_output=True cannot be combined"):
        ColumnParallelLinear(4, 4, tp_group=None, sequence_parallel=True)
    with pytest.raises(ValueError, match="needs input_is_parallel=True"):
        RowParallelLinear(4, 4, tp_group=None, sequence_parallel=True)
    head = ColumnParallelLinear(4, 6, tp_group=None, skip_weight_param_allocation=True, bias=False)
    with pytest.raises(ValueError, match="pass the \\(tied\\) weight"):
        head(torch.randn(2, 1, 4))
    with pytest.raises(ValueError, match="expected \\(6, 4\\)"):
        head(torch.randn(2, 1, 4), weight=torch.randn(4, 6))


def test_init_methods():
    torch.manual_seed(0)
    w = torch.empty(400, 400)
    init_method_normal(0.02)(w)
    assert w.std().item() == pytest.approx(0.02, rel=0.02)  # 160k samples: std error ~0.2%
    scaled_init_method_normal(0.02, 8)(w)
    assert w.std().item() == pytest.approx(0.02 / 4, rel=0.02)  # 0.02 / sqrt(2 * 8)
