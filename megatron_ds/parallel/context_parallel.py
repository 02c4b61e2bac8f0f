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

In forward each ring hop is in flight while the previous step's blocks compute. Backward of the ring
(``_RingAttention``, Transformer Engine's design) keeps only this rank's q, k, v, output and LSE, sends the
K/V around the ring again and the K/V gradients along with them back to their owners, recomputing each
block's probabilities. With attention dropout (whose masks would have to be redrawn) and for the
all-gather, backward is autograd through the hops (a differentiable send/receive) or the all-gather
(reduce-scatter of the K/V gradients) and the blocks (``_Block``, which also recomputes its probabilities):
every step's received K/V (the whole sequence's, per rank) is then kept for backward.

The block kernel (``attention_block``) is the explicit math path (scores, log-sum-exp, softmax, product) on
every device: torch's SDPA does not return the log-sum-exp the merge needs, and its CUDA flash kernel that
does (``aten._scaled_dot_product_flash_attention``) takes no mask. A faster CUDA block is a change of this
one function.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_ds.parallel.mappings import gather_from_sequence_parallel_region

COMM_TYPES = ("p2p", "all_gather")
_MASKED = -1e30  # a finite "minus infinity": fully masked rows keep finite LSEs and gradients (no NaN)


@dataclass(frozen=True)
class ContextParallel:
    """This rank's context parallel group and how attention communicates over it (``comm_type``)."""
    group: object
    comm_type: str = "p2p"
    size: int = field(init=False)
    rank: int = field(init=False)
    send_to: int = field(init=False)  # the ring's next and previous ranks (global ranks)
    recv_from: int = field(init=False)

    def __post_init__(self):
        if self.comm_type not in COMM_TYPES:
            raise ValueError(f"comm_type must be one of {COMM_TYPES}, got {self.comm_type!r}")
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

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  document_ids: torch.Tensor | None = None, dropout_p: float = 0.0) -> torch.Tensor:
        """Causal attention of this rank's ``[b, heads, s, d]`` queries over the whole sequence's keys
        (``k``, ``v``: this rank's ``[b, groups, s, d]``; GQA when groups < heads); ``document_ids``:
        ``[b, S]`` of the whole sequence, or None; ``dropout_p``: attention dropout (drawn from the current
        generator). Returns ``[b, heads, s, d]``."""
        c = q.shape[2] // 2  # the K/V travel as groups; each block expands them to the query heads
        if self.comm_type == "p2p" and not (dropout_p > 0.0 and torch.is_grad_enabled()):
            return _RingAttention.apply(q, k, v, self, document_ids)
        kv = torch.cat([k, v], dim=1)
        if self.comm_type == "all_gather":
            everyone = gather_from_sequence_parallel_region(kv.unsqueeze(0), self.group).unbind(0)
            sources = list(enumerate(everyone))
        else:
            sources = _ring(kv, self)
        return _attend_chunks(q, sources, self, c, document_ids, dropout_p)[0].to(q.dtype)


def _ring(kv: torch.Tensor, cp: ContextParallel):
    """(source rank, its K/V) for this rank's own K/V and then N-1 hops around the ring, each received
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
    """(query chunk index i of this rank, the slice of ``src``'s two chunks' key/value columns it sees, their
    mask) for each of this rank's query chunks that sees any of them: a later key chunk is skipped. The visible
    chunks are the first, the second or both: always one contiguous slice (a view, no gather)."""
    k_chunks = cp.chunks_of(src)
    for i, qc in enumerate(cp.chunks_of(cp.rank)):
        visible = [j for j, kc in enumerate(k_chunks) if kc <= qc]
        if visible:
            cols = slice(visible[0] * c, (visible[-1] + 1) * c)
            yield i, cols, _block_mask(qc, [k_chunks[j] for j in visible], c, document_ids, device)


def _attend_chunks(q, sources, cp: ContextParallel, c: int, document_ids,
                   dropout_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the visible blocks of each source's K/V against this rank's two query chunks and merge them;
    returns (output, LSE), fp32."""
    acc = [None, None]  # per query chunk: (output fp32, LSE fp32)
    for src, kv in sources:
        k, v = (_expand(t, q.shape[1]) for t in kv.chunk(2, dim=1))
        for i, cols, mask in _visible_blocks(cp, src, c, document_ids, q.device):
            block = attention_block(q[:, :, i * c:(i + 1) * c], k[:, :, cols], v[:, :, cols], mask, dropout_p)
            acc[i] = block if acc[i] is None else merge(*acc[i], *block)
    # every query chunk sees at least its own diagonal block, so both accumulators exist
    return torch.cat([acc[0][0], acc[1][0]], dim=2), torch.cat([acc[0][1], acc[1][1]], dim=2)


class _RingAttention(torch.autograd.Function):
    """The p2p ring without dropout, as Transformer Engine's ``AttnFuncWithCPAndKVP2P``: forward keeps only
    this rank's q, k, v, the merged output and LSE; backward sends the K/V around the ring again, each rank
    adding its queries' share of the K/V gradient to an accumulator that travels with them and arrives back
    at the K/V's owner after N hops. Each block's gradient is flash attention's, from the final output and
    LSE: P = exp(S - lse), dV = P^T dO, dS = P (dO V^T - rowsum(dO O)), dQ = dS K, dK = dS^T Q (scaled)."""

    @staticmethod
    def forward(ctx, q, k, v, cp: ContextParallel, document_ids):
        out, lse = _attend_chunks(q, _ring(torch.cat([k, v], dim=1), cp), cp, q.shape[2] // 2, document_ids, 0.0)
        ctx.cp, ctx.document_ids = cp, document_ids
        # kept in the compute dtype, as flash attention keeps its output, and laid out [s, b, heads, d] in memory:
        # the layer's [s, b, heads x d] view of it (model/transformer.py) is then the same storage, kept once
        out = out.to(q.dtype).permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse = ctx.saved_tensors
        cp, c, acc = ctx.cp, q.shape[2] // 2, lse.dtype
        d_out = d_out.to(acc)
        delta = (d_out * out.to(acc)).sum(-1, keepdim=True)  # rowsum(dO O)
        qa, d_q = q.to(acc), torch.zeros_like(d_out)
        send_to, recv_from = cp.send_to, cp.recv_from
        kv = torch.cat([k, v], dim=1).to(acc)
        d_kv = torch.zeros_like(kv)  # the gradient of the K/V this rank holds now, from the ranks it has visited
        for step in range(cp.size):
            src = (cp.rank - step) % cp.size
            _block_grads(qa, kv, d_kv, d_q, d_out, delta, lse, _visible_blocks(cp, src, c, ctx.document_ids, q.device))
            if step + 1 < cp.size:  # both move on
                kv, d_kv = _exchange([kv, d_kv], cp.group, send_to, recv_from)
            else:  # the gradient takes one more hop, to the K/V's owner
                (d_kv,) = _exchange([d_kv], cp.group, send_to, recv_from)
        d_k, d_v = d_kv.chunk(2, dim=1)
        return d_q.to(q.dtype), d_k.to(k.dtype), d_v.to(v.dtype), None, None


def _block_grads(q, kv, d_kv, d_q, d_out, delta, lse, blocks) -> None:
    """Add each block's gradients (``_RingAttention``) into ``d_q`` and ``d_kv`` (in place, fp32)."""
    heads = q.shape[1]
    k, v = (_expand(t, heads) for t in kv.chunk(2, dim=1))
    d_k, d_v = d_kv.chunk(2, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1])
    c = q.shape[2] // 2
    for i, cols, mask in blocks:
        rows = slice(i * c, (i + 1) * c)
        k_b, v_b = k[:, :, cols], v[:, :, cols]
        scores = torch.matmul(q[:, :, rows], k_b.transpose(-1, -2)) * scale
        if mask is not None:
            scores = scores.masked_fill(~mask, _MASKED)
        probs = torch.exp(scores - lse[:, :, rows].unsqueeze(-1))
        if mask is not None:
            probs = probs * mask
        d_v[:, :, cols] += _reduce(torch.matmul(probs.transpose(-1, -2), d_out[:, :, rows]), d_v.shape[1])
        d_scores = probs * (torch.matmul(d_out[:, :, rows], v_b.transpose(-1, -2)) - delta[:, :, rows]) * scale
        d_q[:, :, rows] += torch.matmul(d_scores, k_b)
        d_k[:, :, cols] += _reduce(torch.matmul(d_scores.transpose(-1, -2), q[:, :, rows]), d_k.shape[1])


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


def _block_mask(qc: int, k_chunks: list[int], c: int, document_ids, device) -> torch.Tensor | None:
    """[b or 1, 1, c, len(k_chunks) * c] bool where a query may attend to a key: causal on the diagonal chunk
    (fully visible elsewhere) and within the document; None where everything is visible."""
    q_pos = torch.arange(qc * c, (qc + 1) * c, device=device)
    k_pos = torch.cat([torch.arange(kc * c, (kc + 1) * c, device=device) for kc in k_chunks])
    mask = None
    if qc in k_chunks:
        mask = (k_pos[None, :] <= q_pos[:, None])[None, None]
    if document_ids is not None:
        same = document_ids[:, q_pos][:, None, :, None] == document_ids[:, k_pos][:, None, None, :]
        mask = same if mask is None else mask & same
    return mask


def attention_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                    dropout_p: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``_math_block``, keeping for backward only its inputs, output and LSE (``_Block``: the scores and
    probabilities are recomputed there, as flash attention does), so a rank keeps no [queries, keys] tensor
    per block. With dropout, autograd through ``_math_block`` (its mask would have to be redrawn)."""
    if dropout_p > 0.0 and torch.is_grad_enabled():
        return _math_block(q, k, v, mask, dropout_p)
    return _Block.apply(q, k, v, mask)


class _Block(torch.autograd.Function):
    """``_math_block`` without dropout, its backward recomputing the probabilities from the LSE. With
    P = exp(S - lse) and the block's output O: dV = P^T dO, dP = dO V^T, and dS = P (dP - rowsum(dO O) + dlse)
    (the LSE's own gradient, which the merge gives it, adds dlse x P since d lse / dS = P)."""

    @staticmethod
    def forward(ctx, q, k, v, mask):
        out, lse = _math_block(q, k, v, mask, 0.0)
        ctx.save_for_backward(q, k, v, mask, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, k, v, mask, out, lse = ctx.saved_tensors
        acc, scale = out.dtype, 1.0 / math.sqrt(q.shape[-1])
        qa, ka, va = q.to(acc), k.to(acc), v.to(acc)
        scores = torch.matmul(qa, ka.transpose(-1, -2)) * scale
        if mask is not None:
            scores = scores.masked_fill(~mask, _MASKED)
        probs = torch.exp(scores - lse.unsqueeze(-1))
        if mask is not None:
            probs = probs * mask
        d_v = torch.matmul(probs.transpose(-1, -2), d_out)
        d_probs = torch.matmul(d_out, va.transpose(-1, -2))
        d_scores = probs * (d_probs - (d_out * out).sum(-1, keepdim=True) + d_lse.unsqueeze(-1)) * scale
        d_q, d_k = torch.matmul(d_scores, ka), torch.matmul(d_scores.transpose(-1, -2), qa)
        return d_q.to(q.dtype), d_k.to(k.dtype), d_v.to(v.dtype), None


def _math_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                dropout_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of ``[b, h, sq, d]`` q over ``[b, h, sk, d]`` k, v (``mask``: True = visible,
    broadcastable to ``[b, h, sq, sk]``); returns (output fp32 ``[b, h, sq, d]``, log-sum-exp fp32
    ``[b, h, sq]``). A row with nothing visible gets output 0 and an LSE of about -1e30, so merging it
    changes nothing. The scale is SDPA's default, 1/sqrt(d). Dropout drops (and rescales) the block's
    probabilities after the LSE is taken: the merge only rescales whole blocks, so that is dropout of the
    final softmax, as SDPA's."""
    acc = torch.promote_types(q.dtype, torch.float32)  # fp32 (fp64 stays fp64: the tests' references)
    scores = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    if mask is not None:
        scores = scores.masked_fill(~mask, _MASKED)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    if mask is not None:
        probs = probs * mask
    if dropout_p > 0.0:
        probs = F.dropout(probs, dropout_p)
    return torch.matmul(probs, v.to(acc)), lse


def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
          lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Online softmax: two blocks' attention over disjoint keys -> the attention over their union (fp32)."""
    lse = torch.logaddexp(lse_a, lse_b)
    out = out_a * torch.exp(lse_a - lse).unsqueeze(-1) + out_b * torch.exp(lse_b - lse).unsqueeze(-1)
    return out, lse


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
