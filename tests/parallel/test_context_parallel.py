"""Context parallel attention (parallel/context_parallel.py) against full-sequence attention.

The reference is torch's SDPA over the whole sequence with the causal-and-same-document mask of
model/transformer.py's ``document_causal_mask``, on one process; each CP rank's output rows and its share of
the q/k/v gradients are compared with the reference's rows at that rank's positions (chunks i and 2N-1-i,
Megatron-LM's placement, megatron/core/utils.py ``_get_batch_on_this_cp_rank_per_sequence_balancing``)."""
import pytest
import torch
import torch.nn.functional as F

from megatron_ds.parallel.attention_blocks import FULL, block_forward, merge
from megatron_ds.parallel.context_parallel import (ContextParallel, _attend_chunks, _block_grads, _pack, _ring, _unpack,
                                                   _visible_blocks)
from tests.distributed import run_distributed

B, H, G, S, D = 2, 4, 2, 16, 8  # GQA: 2 query heads per key/value group
DV, SCALE = 6, 0.3  # multi-latent attention's shape: values narrower than queries and keys, an explicit scale


def _inputs(dv=D):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, S, D, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(B, G, S, d, generator=gen, dtype=torch.float64) for d in (D, dv))
    docs = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * S])  # row 0: three documents
    return q, k, v, docs


def _reference(docs, dv=D, scale=None):
    q, k, v = (t.clone().requires_grad_() for t in _inputs(dv)[:3])
    mask = (docs[:, None, :, None] == docs[:, None, None, :]) & torch.ones(S, S, dtype=torch.bool).tril()
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(H // G, 1), v.repeat_interleave(H // G, 1),
                                         attn_mask=mask, scale=scale)
    out.backward(_grad_out(dv))
    return out.detach(), q.grad, k.grad, v.grad


def _grad_out(dv=D):
    return torch.randn(B, H, S, dv, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def _sharded(rank, world_size, comm_type, with_docs, kernel, dv, scale):
    cp = ContextParallel(torch.distributed.group.WORLD, comm_type.removesuffix("_autograd"), kernel)
    q, k, v, docs = _inputs(dv)
    docs = docs if with_docs else None
    local = [cp.shard(t, dim=2).clone().requires_grad_() for t in (q, k, v)]
    if comm_type == "p2p_autograd":  # the ring attention dropout runs: autograd through the hops and blocks
        q, k, v = local
        out = _attend_chunks(q, _ring(_pack(k, v), cp), (k.shape, v.shape), cp, docs, 0.0,
                             scale or D ** -0.5)[0]
    else:
        out = cp.attention(*local, document_ids=docs, scale=scale)
    out.backward(cp.shard(_grad_out(dv), dim=2))
    return cp.positions(S), out.detach(), *(t.grad for t in local)


# kernel "flash": on the CPU torch's flash operator (attention_blocks.py), the CUDA branch's code path
@pytest.mark.parametrize("comm_type,with_docs,cp,kernel,mla", [
    ("p2p", True, 2, "math", False), ("all_gather", True, 2, "math", False), ("p2p", False, 2, "math", False),
    ("p2p", True, 4, "math", False), ("all_gather", False, 4, "math", False), ("p2p_autograd", True, 4, "math", False),
    ("p2p", True, 2, "flash", False), ("p2p", False, 4, "flash", False), ("all_gather", True, 2, "flash", False),
    ("p2p", True, 2, "flash", True), ("all_gather", False, 2, "math", True), ("p2p_autograd", False, 2, "math", True)])
def test_context_parallel_attention_equals_full_attention(comm_type, with_docs, cp, kernel, mla):
    """CP 4: three hops around the ring, chunks of 2 positions. ``mla``: values of another head dim than the
    keys' and an explicit softmax scale."""
    docs = _inputs()[3] if with_docs else torch.zeros(B, S, dtype=torch.long)
    dv, scale = (DV, SCALE) if mla else (D, None)
    ref = _reference(docs, dv, scale)
    ranks = run_distributed(_sharded, cp, comm_type, with_docs, kernel, dv, scale, timeout=60)
    assert sorted(torch.cat([r[0] for r in ranks]).tolist()) == list(range(S))  # every position once
    for positions, *got in ranks:
        for name, mine, full in zip(("out", "dq", "dk", "dv"), got, ref):
            torch.testing.assert_close(mine, full[:, :, positions], rtol=1e-10, atol=1e-10, msg=name)


def test_merge_of_two_blocks_is_attention_over_their_union():
    q, k, v, _ = _inputs()
    k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    whole = F.scaled_dot_product_attention(q, k, v)
    for kernel in ("math", "flash"):
        merged, _ = merge(*block_forward(q, k[:, :, :5], v[:, :, :5], FULL, None, D ** -0.5, kernel),
                          *block_forward(q, k[:, :, 5:], v[:, :, 5:], FULL, None, D ** -0.5, kernel))
        torch.testing.assert_close(merged, whole)


class _VirtualRank:
    """One CP rank's view (its rank, the group's size, the block kernel) for ``_emulated_cp``."""

    def __init__(self, size: int, rank: int, kernel: str):
        self.size, self.rank, self.kernel = size, rank, kernel

    def chunks_of(self, rank: int) -> tuple[int, int]:
        return rank, 2 * self.size - 1 - rank


def _emulated_cp(q, k, v, d_out, size, kernel, docs, scale):
    """CP ``size`` in one process: each rank's blocks over every rank's K/V merged (forward), and their gradients
    from the merged output and LSE (backward), as ``_ContextParallelAttention`` runs them; (out, dq, dk, dv)."""
    c = q.shape[2] // (2 * size)
    ranks = [_VirtualRank(size, r, kernel) for r in range(size)]
    pos = [torch.cat([torch.arange(i * c, (i + 1) * c) for i in cp.chunks_of(cp.rank)]) for cp in ranks]
    kv = [_pack(k[:, :, p], v[:, :, p]) for p in pos]
    shapes = (k[:, :, pos[0]].shape, v[:, :, pos[0]].shape)
    out = torch.empty(*q.shape[:3], v.shape[-1], dtype=q.dtype, device=q.device)
    dq, dk, dv = (torch.zeros(t.shape, device=q.device) for t in (q, k, v))
    with torch.no_grad():
        for cp, p in zip(ranks, pos):
            o, lse = _attend_chunks(q[:, :, p], list(enumerate(kv)), shapes, cp, docs, 0.0, scale)
            out[:, :, p] = o = o.to(q.dtype)
            for src in range(size):
                d_kv = torch.zeros(kv[src].shape, device=q.device)
                d_q = torch.zeros(q[:, :, p].shape, device=q.device)
                _block_grads(q[:, :, p], _unpack(kv[src], *shapes), _unpack(d_kv, *shapes), d_q, d_out[:, :, p], o,
                             lse, _visible_blocks(cp, src, c, docs, q.device), scale, kernel)
                dq[:, :, p] += d_q
                d_k, d_v = _unpack(d_kv, *shapes)
                dk[:, :, pos[src]] += d_k
                dv[:, :, pos[src]] += d_v
    return out, dq, dk, dv


def _check_emulated(device, dtype, size, docs_on, dqk, dv, seq, heads, groups, tol):
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, heads, seq, dqk, generator=gen, device=device).to(dtype)
    k = torch.randn(1, groups, seq, dqk, generator=gen, device=device).to(dtype)
    v = torch.randn(1, groups, seq, dv, generator=gen, device=device).to(dtype)
    d_out = torch.randn(1, heads, seq, dv, generator=gen, device=device).to(dtype)
    scale = 0.7 / dqk ** 0.5
    docs = (torch.arange(seq, device=device) * 5 // seq)[None] if docs_on else None  # five documents
    got = _emulated_cp(q, k, v, d_out, size, "flash", docs, scale)
    # the reference: SDPA over the whole sequence, in fp32
    ref_in = [t.float().requires_grad_() for t in (q, k, v)]
    mask = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()
    if docs_on:
        mask = mask & (docs[0][:, None] == docs[0][None, :])
    rep = heads // groups
    ref = F.scaled_dot_product_attention(ref_in[0], ref_in[1].repeat_interleave(rep, 1),
                                         ref_in[2].repeat_interleave(rep, 1), attn_mask=mask, scale=scale)
    ref.backward(d_out.float())
    for name, mine, full in zip(("out", "dq", "dk", "dv"), got, (ref.detach(), *(t.grad for t in ref_in))):
        err = (mine.float() - full).norm() / full.norm()
        assert err < tol, (name, err.item())


@pytest.mark.parametrize("size,docs_on,dv", [(2, True, 8), (4, False, 6)])
def test_flash_blocks_emulated_cp_equal_sdpa_on_cpu(size, docs_on, dv):
    """The check the GPU test runs, on the CPU's flash operator in fp32 (its harness tested here)."""
    _check_emulated("cpu", torch.float32, size, docs_on, 8, dv, 32, 4, 2, 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("size,docs_on,dqk,dv", [(2, False, 128, 128), (2, True, 128, 128), (4, False, 192, 128),
                                                 (4, True, 64, 64)])
def test_flash_blocks_emulated_cp_equal_sdpa_on_gpu_bf16(size, docs_on, dqk, dv):
    """bf16 on one GPU: CP ``size``'s flash blocks (the flash operator; the memory-efficient one with document
    masks; multi-latent attention's 192/128 head dims) against SDPA over the whole sequence, forward and
    backward, within bf16's error (relative norm 2e-2)."""
    _check_emulated("cuda", torch.bfloat16, size, docs_on, dqk, dv, 2048, 8, 2, 2e-2)
