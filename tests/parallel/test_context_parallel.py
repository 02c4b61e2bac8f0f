"""Context parallel attention (parallel/context_parallel.py) against full-sequence attention.

The reference is torch's SDPA over the whole sequence with the causal-and-same-document mask of
model/transformer.py's ``document_causal_mask``, on one process; each CP rank's output rows and its share of
the q/k/v gradients are compared with the reference's rows at that rank's positions (chunks i and 2N-1-i,
Megatron-LM's placement, megatron/core/utils.py ``_get_batch_on_this_cp_rank_per_sequence_balancing``)."""
import pytest
import torch
import torch.nn.functional as F

from megatron_ds.parallel.context_parallel import ContextParallel, _attend_chunks, _ring, attention_block, merge
from tests.distributed import run_distributed

B, H, G, S, D = 2, 4, 2, 16, 8  # GQA: 2 query heads per key/value group


def _inputs():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, S, D, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(B, G, S, D, generator=gen, dtype=torch.float64) for _ in range(2))
    docs = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * S])  # row 0: three documents
    return q, k, v, docs


def _reference(docs):
    q, k, v = (t.clone().requires_grad_() for t in _inputs()[:3])
    mask = (docs[:, None, :, None] == docs[:, None, None, :]) & torch.ones(S, S, dtype=torch.bool).tril()
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(H // G, 1), v.repeat_interleave(H // G, 1),
                                         attn_mask=mask)
    out.backward(_grad_out())
    return out.detach(), q.grad, k.grad, v.grad


def _grad_out():
    return torch.randn(B, H, S, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def _sharded(rank, world_size, comm_type, with_docs):
    cp = ContextParallel(torch.distributed.group.WORLD, comm_type.removesuffix("_autograd"))
    q, k, v, docs = _inputs()
    docs = docs if with_docs else None
    local = [cp.shard(t, dim=2).clone().requires_grad_() for t in (q, k, v)]
    if comm_type == "p2p_autograd":  # the ring attention dropout runs: autograd through the hops and blocks
        kv = torch.cat(local[1:], dim=1)
        out = _attend_chunks(local[0], _ring(kv, cp), cp, S // (2 * cp.size), docs, 0.0)[0]
    else:
        out = cp.attention(*local, document_ids=docs)
    out.backward(cp.shard(_grad_out(), dim=2))
    return cp.positions(S), out.detach(), *(t.grad for t in local)


@pytest.mark.parametrize("comm_type,with_docs,cp", [("p2p", True, 2), ("all_gather", True, 2), ("p2p", False, 2),
                                                    ("p2p", True, 4), ("all_gather", False, 4),
                                                    ("p2p_autograd", True, 4)])
def test_context_parallel_attention_equals_full_attention(comm_type, with_docs, cp):
    """CP 4: three hops around the ring, chunks of 2 positions."""
    docs = _inputs()[3] if with_docs else torch.zeros(B, S, dtype=torch.long)
    ref = _reference(docs)
    ranks = run_distributed(_sharded, cp, comm_type, with_docs, timeout=60)
    assert sorted(torch.cat([r[0] for r in ranks]).tolist()) == list(range(S))  # every position once
    for positions, *got in ranks:
        for name, mine, full in zip(("out", "dq", "dk", "dv"), got, ref):
            torch.testing.assert_close(mine, full[:, :, positions], rtol=1e-10, atol=1e-10, msg=name)


def test_merge_of_two_blocks_is_attention_over_their_union():
    q, k, v, _ = _inputs()
    k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    whole = F.scaled_dot_product_attention(q, k, v)
    merged, _ = merge(*attention_block(q, k[:, :, :5], v[:, :, :5], None),
                      *attention_block(q, k[:, :, 5:], v[:, :, 5:], None))
    torch.testing.assert_close(merged, whole)
