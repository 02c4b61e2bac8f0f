"""Context parallelism (Megatron-LM's --context-parallel-size N): every layer's sequence split over N ranks.

Placement (Megatron-LM megatron/core/utils.py ``_get_batch_on_this_cp_rank_per_sequence_balancing``): each
sequence is cut into 2N equal chunks and CP rank i holds chunks i and 2N-1-i, so under the causal mask every
rank has the same amount of attention work. Everything outside attention is per token, so only attention
talks: each rank's queries must see the keys and values of the earlier chunks, wherever they live.

Attention (Transformer Engine's ``AttnFuncWithCPAndKVP2P`` / ``AttnFuncWithCPAndKVAllGather`` semantics):
- ``p2p``: the K/V of a rank travel around the ring, one hop per step; after N-1 hops every rank has seen
  every rank's K/V. Each step's block (this rank's query chunks against the K/V it holds now) is merged
  into the running output with the online softmax: outputs weighted by exp(block LSE - total LSE), in fp32.
- ``all_gather``: the K/V of all CP ranks are all-gathered, then each query chunk attends to the key chunks
  it may see in one block.
Per (query chunk, key chunk) pair the causal mask leaves three cases: a key chunk after the query chunk is
skipped, one before it is fully visible, the same chunk is the causal diagonal. Document masks
(--reset-attention-mask) come from the whole sequence's document ids, which every CP rank holds.

In forward each ring hop is in flight while the previous step's blocks compute. Without dropout, attention is
``_ContextParallelAttention`` (Transformer Engine's design): it keeps only this rank's q, k, v, output and LSE;
its backward sends the K/V around the ring again (p2p) and the K/V gradients along with them back to their
owners, or gathers the K/V again and reduce-scatters their gradients (all_gather), each block's gradient from
the final output and LSE. With attention dropout (whose masks would have to be redrawn) backward is autograd
through the hops (a differentiable send/receive) or the all-gather and the math blocks: every step's received
K/V (the whole sequence's, per rank) and each block's probabilities are then kept for backward.

Blocks (parallel/attention_blocks.py): FULL (earlier key chunks), CAUSAL (the square diagonal) or DOCUMENT
(with --reset-attention-mask), run by ``cp.kernel``: ``math`` (the explicit path, the default) or ``flash``
(torch's fused attention operators, which return the log-sum-exp: --cp-block-kernel flash). K and V travel
packed in one buffer, so their head dims may differ (multi-latent attention); the softmax scale is explicit.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_ds.parallel.attention_blocks import (CAUSAL, DOCUMENT, FULL, KERNELS, block_backward, block_forward,
                                                   math_block, merge)
from megatron_ds.parallel.mappings import (all_gather_along_first_dim, gather_from_sequence_parallel_region,
                                           reduce_scatter_along_first_dim)

COMM_TYPES = ("p2p", "all_gather")


@dataclass(frozen=True)
class ContextParallel:
    """This rank's context parallel group, how attention communicates over it (``comm_type``) and the kernel
    its blocks run (``kernel``, attention_blocks.KERNELS)."""
    group: object
    comm_type: str = "p2p"
    kernel: str = "math"
    size: int = field(init=False)
    rank: int = field(init=False)
    send_to: int = field(init=False)  # the ring's next and previous ranks (global ranks)
    recv_from: int = field(init=False)

    def __post_init__(self):
        if self.comm_type not in COMM_TYPES:
            raise ValueError(f"comm_type must be one of {COMM_TYPES}, got {self.comm_type!r}")
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {self.kernel!r}")
        object.__setattr__(self, "size", dist.get_world_size(self.group))
        object.__setattr__(self, "rank", dist.get_rank(self.group))
        ranks = dist.get_process_group_ranks(self.group)
        object.__setattr__(self, "send_to", ranks[(self.rank + 1) % self.size])
        object.__setattr__(self, "recv_from", ranks[(self.rank - 1) % self.size])

    def chunks_of(self, rank: int) -> tuple[int, int]:
        """The two of the sequence's 2N chunks CP rank ``rank`` holds."""
        return rank, 2 * self.size - 1 - rank

    def positions(self, seq_length: int, device=None) -> torch.Tensor:
        """This rank's global positions in a sequence of ``seq_length`` (its two chunks, in order)."""
        c = seq_length // (2 * self.size)
        return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in self.chunks_of(self.rank)])

    def shard(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's two chunks of ``t`` along ``dim`` (the whole sequence there)."""
        return t.index_select(dim, self.positions(t.shape[dim], t.device))

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: torch.Tensor | None = None,
                  dropout_p: float = 0.0, scale: float | None = None) -> torch.Tensor:
        """Causal attention of this rank's ``[b, heads, s, d]`` queries over the whole sequence's keys
        (``k``: this rank's ``[b, groups, s, d]``, ``v``: ``[b, groups, s, dv]``; GQA when groups < heads);
        ``document_ids``: ``[b, S]`` of the whole sequence, or None; ``dropout_p``: attention dropout (drawn from
        the current generator); ``scale``: the softmax scale (default 1/sqrt(d), SDPA's). Returns
        ``[b, heads, s, dv]``. The K/V travel as groups; each block expands them to the query heads."""
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        if dropout_p == 0.0:
            return _ContextParallelAttention.apply(q, k, v, self, document_ids, scale)
        sources = _sources(_pack(k, v), self)
        return _attend_chunks(q, sources, (k.shape, v.shape), self, document_ids, dropout_p, scale)[0].to(q.dtype)


def _pack(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """K and V as one flat buffer, one message per hop: their head dims may differ (multi-latent attention)."""
    return torch.cat([k.reshape(-1), v.reshape(-1)])


def _unpack(buf: torch.Tensor, k_shape, v_shape) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = buf.split([math.prod(k_shape), math.prod(v_shape)])
    return k.view(k_shape), v.view(v_shape)


def _ring(kv: torch.Tensor, cp: ContextParallel):
    """(source rank, its packed K/V) for this rank's own K/V and then N-1 hops around the ring, each received
    from the previous rank. The next hop is in flight while the caller computes the current step's blocks
    (Transformer Engine's overlap); it is waited for when the next step is asked for."""
    send_to, recv_from = cp.send_to, cp.recv_from
    for step in range(cp.size):
        pending = []
        if step + 1 < cp.size:
            received = _RingHop.apply(kv, cp.group, send_to, recv_from, pending)
        yield (cp.rank - step) % cp.size, kv
        for work in pending:
            work.wait()
        if step + 1 < cp.size:
            kv = received


def _visible_blocks(cp: ContextParallel, src: int, c: int, document_ids, device):
    """(query chunk index i of this rank, the slice of ``src``'s two chunks' key/value columns, the block's kind
    and mask) for the blocks this rank's query chunks see of them: a later key chunk is skipped; the earlier
    ones, always a contiguous prefix of the two, are one FULL block; the query chunk's own is a square CAUSAL
    block (kept apart from the full one, so no kernel sees a causal mask over keys of two chunks, whose
    alignment torch's SDPA (top-left) and flash attention (bottom-right) read differently). With document ids
    every block is DOCUMENT, its mask the causal one (on the diagonal) and the documents'."""
    k_chunks = cp.chunks_of(src)
    for i, qc in enumerate(cp.chunks_of(cp.rank)):
        earlier = [j for j, kc in enumerate(k_chunks) if kc < qc]
        if earlier:
            yield (i, slice(0, len(earlier) * c),
                   *_block_kind(qc, [k_chunks[j] for j in earlier], c, document_ids, device))
        if qc in k_chunks:
            j = k_chunks.index(qc)
            yield i, slice(j * c, (j + 1) * c), *_block_kind(qc, [qc], c, document_ids, device)


def _block_kind(qc: int, k_chunks: list[int], c: int, document_ids, device) -> tuple[str, torch.Tensor | None]:
    """(kind, mask) of query chunk ``qc`` against the key chunks ``k_chunks`` (all earlier, or ``[qc]``)."""
    diagonal = k_chunks == [qc]
    if document_ids is None:
        return (CAUSAL if diagonal else FULL), None
    q_pos = torch.arange(qc * c, (qc + 1) * c, device=device)
    k_pos = torch.cat([torch.arange(kc * c, (kc + 1) * c, device=device) for kc in k_chunks])
    mask = document_ids[:, q_pos][:, None, :, None] == document_ids[:, k_pos][:, None, None, :]
    if diagonal:
        mask = mask & (k_pos[None, :] <= q_pos[:, None])[None, None]
    return DOCUMENT, mask


def _attend_chunks(q, sources, shapes, cp: ContextParallel, document_ids, dropout_p: float,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the visible blocks of each source's packed K/V (``shapes``: of K and V) against this rank's two query chunks and merge them;
    returns (output, LSE), fp32. With gradients recorded or dropout (the autograd ring and all-gather), each block
    is ``math_block`` under autograd; otherwise (inside ``_ContextParallelAttention``) ``cp.kernel``'s."""
    c, heads = q.shape[2] // 2, q.shape[1]
    autograd = dropout_p > 0.0 or torch.is_grad_enabled()
    acc = [None, None]  # per query chunk: (output fp32, LSE fp32)
    for src, kv in sources:
        k, v = _unpack(kv, *shapes)
        for i, cols, kind, mask in _visible_blocks(cp, src, c, document_ids, q.device):
            args = (q[:, :, i * c:(i + 1) * c], _expand(k[:, :, cols], heads), _expand(v[:, :, cols], heads),
                    kind, mask, scale)
            block = math_block(*args, dropout_p) if autograd else block_forward(*args, cp.kernel)
            acc[i] = block if acc[i] is None else merge(*acc[i], *block)
    # every query chunk sees at least its own diagonal block, so both accumulators exist
    return torch.cat([acc[0][0], acc[1][0]], dim=2), torch.cat([acc[0][1], acc[1][1]], dim=2)


class _ContextParallelAttention(torch.autograd.Function):
    """Context parallel attention without dropout, as Transformer Engine's ``AttnFuncWithCPAndKVP2P``: forward
    keeps only this rank's q, k, v, the merged output and LSE. Backward, p2p: the K/V go around the ring again,
    each rank adding its queries' share of the K/V gradient to an accumulator that travels with them and arrives
    back at the K/V's owner after N hops; all_gather: the K/V are gathered again and their gradients
    reduce-scattered to their owners. Each block's gradient is ``block_backward``'s from the final output and
    LSE (exact: attention_blocks.py)."""

    @staticmethod
    def forward(ctx, q, k, v, cp: ContextParallel, document_ids, scale: float):
        shapes = (k.shape, v.shape)
        out, lse = _attend_chunks(q, _sources(_pack(k, v), cp), shapes, cp, document_ids, 0.0, scale)
        ctx.cp, ctx.document_ids, ctx.scale, ctx.shapes = cp, document_ids, scale, shapes
        # kept in the compute dtype, as flash attention keeps its output, and laid out [s, b, heads, d] in memory:
        # the layer's [s, b, heads x d] view of it (model/transformer.py) is then the same storage, kept once
        out = out.to(q.dtype).permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse = ctx.saved_tensors
        cp, c, shapes = ctx.cp, q.shape[2] // 2, ctx.shapes
        d_out = d_out.contiguous()  # (a sum's gradient arrives expanded: stride 0, which the kernels do not take)
        d_q = torch.zeros(q.shape, dtype=lse.dtype, device=q.device)
        kv = _pack(k, v)

        def grads(src: int, kv_src: torch.Tensor, d_kv: torch.Tensor) -> None:
            blocks = _visible_blocks(cp, src, c, ctx.document_ids, q.device)
            _block_grads(q, _unpack(kv_src, *shapes), _unpack(d_kv, *shapes), d_q, d_out, out, lse,
                         blocks, ctx.scale, cp.kernel)

        if cp.size == 1:  # a group of one (bench/cp_attention.py): nothing to exchange
            d_kv = torch.zeros(kv.shape, dtype=lse.dtype, device=q.device)
            grads(0, kv, d_kv)
        elif cp.comm_type == "all_gather":
            everyone = all_gather_along_first_dim(kv.unsqueeze(0), cp.group)
            d_all = torch.zeros(everyone.shape, dtype=lse.dtype, device=q.device)
            for src in range(cp.size):
                grads(src, everyone[src], d_all[src])
            d_kv = reduce_scatter_along_first_dim(d_all, cp.group)[0]
        else:
            d_kv = torch.zeros(kv.shape, dtype=lse.dtype, device=q.device)  # of the K/V held now
            for step in range(cp.size):
                grads((cp.rank - step) % cp.size, kv, d_kv)
                if step + 1 < cp.size:  # both move on
                    kv, d_kv = _exchange([kv, d_kv], cp.group, cp.send_to, cp.recv_from)
                else:  # the gradient takes one more hop, to the K/V's owner
                    (d_kv,) = _exchange([d_kv], cp.group, cp.send_to, cp.recv_from)
        d_k, d_v = _unpack(d_kv, *shapes)
        return d_q.to(q.dtype), d_k.to(k.dtype), d_v.to(v.dtype), None, None, None


def _sources(kv: torch.Tensor, cp: ContextParallel):
    """(source rank, its packed K/V) for every CP rank: around the ring (p2p) or all-gathered."""
    if cp.comm_type == "all_gather":
        return enumerate(gather_from_sequence_parallel_region(kv.unsqueeze(0), cp.group).unbind(0))
    return _ring(kv, cp)


def _block_grads(q, kv, d_kv, d_q, d_out, out, lse, blocks, scale: float, kernel: str) -> None:
    """Add each block's gradients into ``d_q`` and the (group) K/V gradients ``d_kv`` (in place, fp32)."""
    (k, v), (d_k, d_v), heads = kv, d_kv, q.shape[1]
    c = q.shape[2] // 2
    for i, cols, kind, mask in blocks:
        rows = slice(i * c, (i + 1) * c)
        dq, dk, dv = block_backward(d_out[:, :, rows], q[:, :, rows], _expand(k[:, :, cols], heads),
                                    _expand(v[:, :, cols], heads), out[:, :, rows], lse[:, :, rows], kind, mask,
                                    scale, kernel)
        d_q[:, :, rows] += dq
        d_k[:, :, cols] += _reduce(dk, d_k.shape[1])
        d_v[:, :, cols] += _reduce(dv, d_v.shape[1])


def _expand(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``[b, groups, s, d]`` keys or values for ``heads`` query heads: query head h uses group h // (heads /
    groups), model/transformer.py's layout (GQA; a no-op for multi-head attention)."""
    repeat = heads // t.shape[1]
    return t if repeat == 1 else t.repeat_interleave(repeat, dim=1)


def _reduce(t: torch.Tensor, groups: int) -> torch.Tensor:
    """``_expand``'s gradient: ``[b, heads, s, d]`` summed over each group's query heads."""
    b, heads, s, d = t.shape
    return t if heads == groups else t.view(b, groups, heads // groups, s, d).sum(2)


def _exchange(tensors: list, group, send_to: int, recv_from: int) -> list:
    """Send ``tensors`` to ``send_to`` and receive tensors like them from ``recv_from``, synchronously."""
    started = [_start_exchange(t.contiguous(), group, send_to, recv_from) for t in tensors]
    for _, works in started:
        for work in works:
            work.wait()
    return [out for out, _ in started]


class _RingHop(torch.autograd.Function):
    """Forward: send ``x`` to the next CP rank and receive the previous rank's into the returned tensor,
    asynchronously: the exchange's handles go to ``pending``, which the caller waits for before reading it.
    Backward: the gradient goes the other way (to the rank the tensor came from), synchronously."""

    @staticmethod
    def forward(ctx, x, group, send_to: int, recv_from: int, pending: list):
        ctx.group, ctx.send_to, ctx.recv_from = group, send_to, recv_from
        out, works = _start_exchange(x.contiguous(), group, send_to, recv_from)
        pending.extend(works)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _exchange([grad], ctx.group, ctx.recv_from, ctx.send_to)[0], None, None, None, None


def _start_exchange(x: torch.Tensor, group, send_to: int, recv_from: int):
    """Start sending ``x`` to ``send_to`` and receiving a tensor like it from ``recv_from`` (global ranks);
    returns (the receive buffer, the handles). ``x`` must stay unchanged until they complete."""
    out = torch.empty_like(x)
    ops = [dist.P2POp(dist.isend, x, send_to, group), dist.P2POp(dist.irecv, out, recv_from, group)]
    return out, dist.batch_isend_irecv(ops)
