"""Cross entropy over logits whose vocabulary dimension is split across the tensor-parallel ranks.

The full [tokens, vocab] logits are never gathered: each rank reduces its slice, and two
all-reduces (the max, then the sums) combine the pieces. Computed in (at least) fp32 whatever the
logits' dtype; the input is never modified.

Label smoothing follows Megatron: with smoothing alpha over the vocabulary V, the target keeps
probability 1 - alpha and every other id gets alpha / (V - 1). (This equals
`torch.nn.functional.cross_entropy(..., label_smoothing=alpha * V / (V - 1))`.)

Vocabulary padding: the embedding is padded to a multiple of `--make-vocab-size-divisible-by` x TP
rows, so the padded size depends on TP. Given `vocab_size` (the real vocabulary), the columns at
ids >= vocab_size take no part at all -- not in the max, the softmax sum, label smoothing or the
gradient -- so the loss is the same for any padding, hence at any TP size.

z-loss (``z_loss_coeff`` c > 0, PaLM's auxiliary loss as the Swallow fork of Megatron-LM adds it, see
``megatron_ds.model.language_model.Z_LOSS_COEFF``): each token's loss gains ``c * log(Z)^2``, ``log Z``
the log-sum-exp of its logits over the whole (real) vocabulary, whose gradient ``2 c log(Z) softmax``
scales the saved softmax; the sums it needs are those of the cross entropy (no further all-reduce).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_ds.parallel.utils import tp_rank, tp_world_size, vocab_range


def _all_reduce(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if tp_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


class _VocabParallelCrossEntropy(torch.autograd.Function):

    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, group, label_smoothing, real_vocab_size, z_loss_coeff):
        # At least fp32 (half-precision exp/sum over a 50k vocabulary loses too much); float64 stays.
        logits = vocab_parallel_logits.to(torch.promote_types(vocab_parallel_logits.dtype, torch.float32))
        local_vocab = logits.size(-1)
        world = tp_world_size(group)
        padded_vocab_size = local_vocab * world
        vocab_size = padded_vocab_size if real_vocab_size is None else real_vocab_size
        start, end = vocab_range(padded_vocab_size, tp_rank(group), world)
        # This rank's padding columns (ids >= vocab_size): -inf, so exp() makes them exactly 0.
        real_local = max(0, min(local_vocab, vocab_size - start))
        if real_local < local_vocab:
            logits = logits.clone() if logits is vocab_parallel_logits else logits
            logits[..., real_local:] = float("-inf")

        # Subtracting the global max keeps exp() finite for any logit scale.
        logits_max = _all_reduce(logits.amax(dim=-1), group, op=dist.ReduceOp.MAX)
        shifted = logits - logits_max.unsqueeze(-1)  # a new tensor: the input stays untouched

        not_mine = (target < start) | (target >= end)
        local_target = (target - start).masked_fill(not_mine, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(not_mine, 0.0)
        exp_logits = shifted.exp()

        # One all-reduce for all the sums: the target's logit (non-zero on one rank only), the
        # softmax denominator and, for label smoothing, the sum of all logits.
        sums = [target_logit, exp_logits.sum(dim=-1)]
        if label_smoothing > 0:
            sums.append(shifted[..., :real_local].sum(dim=-1))
        sums = _all_reduce(torch.stack(sums), group)
        target_logit, sum_exp = sums[0], sums[1]

        log_sum_exp = sum_exp.log()
        loss = log_sum_exp - target_logit  # -log softmax[target]
        smoothing = 0.0
        if label_smoothing > 0:
            # Loss against q = (1 - s) * onehot + s / V, with s = alpha V / (V - 1), i.e. the
            # target keeps 1 - alpha and the others share alpha: -sum_j q_j log p_j.
            smoothing = label_smoothing * vocab_size / (vocab_size - 1)
            mean_log_prob = sums[2] / vocab_size - log_sum_exp
            loss = (1.0 - smoothing) * loss - smoothing * mean_log_prob

        softmax = exp_logits.div_(sum_exp.unsqueeze(-1))
        if z_loss_coeff > 0:
            log_z = log_sum_exp + logits_max  # the unshifted log-sum-exp
            loss = loss + z_loss_coeff * log_z.square()
            softmax.mul_((1.0 + 2.0 * z_loss_coeff * log_z).unsqueeze(-1))  # + d(c log_z^2)/d logits
        ctx.save_for_backward(softmax, not_mine, local_target)
        ctx.smoothing, ctx.vocab_size, ctx.real_local = smoothing, vocab_size, real_local
        ctx.input_dtype = vocab_parallel_logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        softmax, not_mine, local_target = ctx.saved_tensors
        # d loss / d logit_j = softmax_j - q_j
        grad = softmax.clone()  # the saved softmax must survive a second backward (retain_graph)
        if ctx.smoothing > 0:
            grad[..., :ctx.real_local].sub_(ctx.smoothing / ctx.vocab_size)
        owned = (~not_mine).to(grad.dtype) * (1.0 - ctx.smoothing)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -owned.unsqueeze(-1))
        grad.mul_(grad_output.unsqueeze(-1))
        return grad.to(ctx.input_dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor, tp_group,
                                 label_smoothing: float = 0.0, vocab_size: int | None = None,
                                 z_loss_coeff: float = 0.0) -> torch.Tensor:
    """Per-token loss (at least fp32, shape of `target`) from logits [..., padded vocab / tp] holding this
    rank's slice of the vocabulary. `target` holds global ids in [0, vocab_size). `vocab_size`: the
    real vocabulary; ids at and above it are padding and excluded (None: no padding). `z_loss_coeff`:
    adds that times log(Z)^2 per token (module docstring; 0: none)."""
    if vocab_parallel_logits.shape[:-1] != target.shape:
        raise ValueError(f"vocab_parallel_cross_entropy: logits {tuple(vocab_parallel_logits.shape)} and "
                         f"target {tuple(target.shape)} disagree (expected logits = target shape + [vocab])")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"vocab_parallel_cross_entropy: label_smoothing must be in [0, 1), got {label_smoothing}")
    padded = vocab_parallel_logits.size(-1) * tp_world_size(tp_group)
    if vocab_size is not None and not 0 < vocab_size <= padded:
        raise ValueError(f"vocab_parallel_cross_entropy: vocab_size {vocab_size} must be in (0, {padded}]")
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, tp_group, label_smoothing, vocab_size,
                                            z_loss_coeff)


def masked_token_loss(per_token_loss: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Mean loss over the tokens where `loss_mask` is 1, in fp32. A micro-batch with no such token
    gives 0 (not NaN), so one fully masked batch cannot poison training."""
    mask = loss_mask.reshape(-1).float()
    return (per_token_loss.reshape(-1).float() * mask).sum() / mask.sum().clamp(min=1.0)
