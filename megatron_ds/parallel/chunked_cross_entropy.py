"""Vocab-parallel cross entropy over half-precision logits that never builds an fp32 copy of them.

``vocab_parallel_cross_entropy`` (cross_entropy.py) turns the whole ``[tokens, vocab/tp]`` logits
into fp32 and keeps the fp32 softmax for backward: with bf16 logits that is three fp32 tensors of
the logits' size (GPT 1.3B, micro batch 8, seq 2048: 3.3 GB each) and the bf16->fp32 copy shows
among the largest non-matmul kernels of a GPU profile. Here the logits are read a chunk of tokens
at a time, each chunk reduced in fp32 (the same precision as the reference), and only the per-token
log-sum-exp is kept; backward rebuilds each chunk's softmax from the saved half-precision logits.
Same numbers as the reference up to the order of fp32 summation; the same two all-reduces per
micro-batch over the tensor parallel group (the max, then the target logit and the sums).

``real_vocab_size`` (optional) leaves the padded vocabulary columns ``[real_vocab_size,
padded)`` out of the softmax entirely (their gradient is zero). ``z_loss_coeff`` adds the z-loss
as ``cross_entropy.py`` does (its docstring), from the log-sum-exp already kept.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_ds.parallel.utils import tp_rank, tp_world_size, vocab_range

CHUNK_ELEMENTS = 1 << 26
"""fp32 elements of one chunk (256 MB): tokens per chunk = this // local vocabulary."""


def _all_reduce(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if tp_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def _chunk_logits(logits: torch.Tensor, rows: slice, real_columns: int | None) -> torch.Tensor:
    """fp32 copy of one chunk of tokens, padded vocabulary columns at -inf."""
    chunk = logits[rows].to(torch.float32, copy=True)  # never a view of the input: modified in place
    if real_columns is not None and real_columns < chunk.shape[-1]:
        chunk[:, max(real_columns, 0):] = float("-inf")
    return chunk


class _ChunkedVocabParallelCrossEntropy(torch.autograd.Function):

    @staticmethod
    def forward(ctx, logits, target, group, real_vocab_size, chunk_tokens, z_loss_coeff):
        local_vocab = logits.shape[-1]
        world = tp_world_size(group)
        start, end = vocab_range(local_vocab * world, tp_rank(group), world)
        real_columns = None if real_vocab_size is None else real_vocab_size - start
        x = logits.reshape(-1, local_vocab)
        t = target.reshape(-1)
        not_mine = (t < start) | (t >= end)
        local_t = (t - start).masked_fill(not_mine, 0)

        # max in the logits' own dtype is exact; padded columns excluded
        real = x if real_columns is None else x[:, :max(min(real_columns, local_vocab), 0)]
        if real.shape[-1] > 0:
            logits_max = real.amax(dim=-1).float()
        else:  # a rank holding only padding
            logits_max = torch.full((x.shape[0],), float("-inf"), dtype=torch.float32, device=x.device)
        logits_max = _all_reduce(logits_max, group, op=dist.ReduceOp.MAX)

        sums = torch.empty((2, x.shape[0]), dtype=torch.float32, device=x.device)
        sums[0] = x.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).float().masked_fill(not_mine, 0.0)
        for i in range(0, x.shape[0], chunk_tokens):
            rows = slice(i, i + chunk_tokens)
            shifted = _chunk_logits(x, rows, real_columns).sub_(logits_max[rows].unsqueeze(-1))
            sums[1, rows] = shifted.exp_().sum(dim=-1)
        sums = _all_reduce(sums, group)
        log_sum_exp = logits_max + sums[1].log()
        loss = log_sum_exp - sums[0]
        if z_loss_coeff > 0:
            loss = loss + z_loss_coeff * log_sum_exp.square()

        ctx.save_for_backward(logits, log_sum_exp, not_mine, local_t)  # the input, not a view of it
        ctx.real_columns, ctx.chunk_tokens, ctx.shape = real_columns, chunk_tokens, logits.shape
        ctx.z_loss_coeff = z_loss_coeff
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_output):
        logits, log_sum_exp, not_mine, local_t = ctx.saved_tensors
        x = logits.reshape(-1, logits.shape[-1])
        grad_output = grad_output.reshape(-1).float()
        owned = (~not_mine).float()
        grad = torch.empty_like(x)
        for i in range(0, x.shape[0], ctx.chunk_tokens):
            rows = slice(i, i + ctx.chunk_tokens)
            # d loss / d logit_j = softmax_j - [j == target], times the incoming gradient
            softmax = _chunk_logits(x, rows, ctx.real_columns).sub_(log_sum_exp[rows].unsqueeze(-1)).exp_()
            if ctx.z_loss_coeff > 0:  # d(c lse^2)/d logit_j = 2 c lse softmax_j
                softmax.mul_((1.0 + 2.0 * ctx.z_loss_coeff * log_sum_exp[rows]).unsqueeze(-1))
            softmax.scatter_add_(-1, local_t[rows].unsqueeze(-1), -owned[rows].unsqueeze(-1))
            grad[rows] = softmax.mul_(grad_output[rows].unsqueeze(-1))
        return grad.view(ctx.shape), None, None, None, None, None


def chunked_vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor, tp_group,
                                         real_vocab_size: int | None = None,
                                         chunk_tokens: int | None = None, z_loss_coeff: float = 0.0) -> torch.Tensor:
    """Per-token loss (fp32, shape of ``target``) from logits ``[..., vocab/tp]`` (any float dtype)
    holding this rank's slice of the vocabulary; ``target`` holds global ids. The gradient has
    the logits' dtype. ``chunk_tokens`` defaults to ``CHUNK_ELEMENTS // (vocab/tp)``."""
    if vocab_parallel_logits.shape[:-1] != target.shape:
        raise ValueError(f"chunked_vocab_parallel_cross_entropy: logits {tuple(vocab_parallel_logits.shape)} and "
                         f"target {tuple(target.shape)} disagree (expected logits = target shape + [vocab])")
    chunk = chunk_tokens or max(1, CHUNK_ELEMENTS // vocab_parallel_logits.shape[-1])
    # The model hands over [b, s, V/tp] as a transposed view of [s, b, V/tp]: flattening that would
    # copy all the logits (in forward and again in backward). Tokens are independent, so work in
    # the memory order instead and put the per-token losses back in the caller's order.
    lead = list(range(target.dim()))
    order = sorted(lead, key=lambda d: -vocab_parallel_logits.stride(d))
    permuted = vocab_parallel_logits.permute(*order, target.dim())
    if order == lead or not permuted.is_contiguous():
        return _ChunkedVocabParallelCrossEntropy.apply(vocab_parallel_logits, target, tp_group, real_vocab_size,
                                                       chunk, z_loss_coeff)
    loss = _ChunkedVocabParallelCrossEntropy.apply(permuted, target.permute(*order), tp_group, real_vocab_size,
                                                   chunk, z_loss_coeff)
    return loss.permute(*sorted(lead, key=order.__getitem__))
