"""Vocab-parallel cross entropy against a float64 dense reference written from the definition.

Reference: log p = log_softmax(logits) in float64 over the full vocabulary; the loss is
-sum_j q_j log p_j with q = one-hot(target), or with label smoothing alpha: 1 - alpha on the target
and alpha / (V - 1) on every other id (Megatron's definition); gradients by float64 autograd.
Each rank feeds its vocabulary slice of the same fp32 logits. Tensor-parallel size 1 runs here;
4 and 2 (subgroups) in one 4-process job.
"""
import torch
import torch.distributed as dist

from megatron_ds.parallel.cross_entropy import masked_token_loss, vocab_parallel_cross_entropy
from megatron_ds.parallel.utils import pad_vocab_size, tp_rank, tp_world_size
from tests.distributed import run_distributed

SEQ, BATCH = 4, 3

# Tolerances. Our loss is computed in fp32 from fp32 logits; the reference is float64 arithmetic on
# the same values. Each fp32 operation rounds by ~6e-8 relative, and the loss (log-sum-exp minus
# the target logit, after the max shift) comes out within a few of those of its own size: measured
# <= 2e-7 relative at logit scales 3 and 1e4 (losses up to ~6e4 there, so absolute errors of ~5e-3
# are expected and fine). rtol 1e-6 leaves a 5x margin; atol 1e-5 covers losses near zero.
# Gradients are probabilities (<= 1) times an O(1) upstream grad: measured ~1e-7 absolute.
LOSS_TOL = dict(rtol=1e-6, atol=1e-5)
GRAD_TOL = dict(rtol=1e-5, atol=1e-6)


def _rand(shape, seed, scale=1.0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


def _targets(vocab, world, seed):
    per = vocab // world
    ids = [i for r in range(world) for i in (r * per, (r + 1) * per - 1)]  # every shard boundary
    ids += torch.randint(0, vocab, (SEQ * BATCH,), generator=torch.Generator().manual_seed(seed)).tolist()
    return torch.tensor(ids[: SEQ * BATCH]).view(SEQ, BATCH)  # boundaries first: at most 8 <= 12 tokens


def _reference(logits, target, label_smoothing):
    """Per-token loss in float64 from the definition, and the float64 leaf logits (for its grads)."""
    logits = logits.double().requires_grad_(True)
    vocab = logits.size(-1)
    log_p = torch.log_softmax(logits, dim=-1)
    q = torch.full_like(log_p, label_smoothing / (vocab - 1))
    q.scatter_(-1, target.unsqueeze(-1), 1.0 - label_smoothing)
    loss = -(q * log_p).sum(-1)
    return loss, logits


def _check_cross_entropy(group, orig_vocab, divisible_by, scale, label_smoothing):
    world, rank = tp_world_size(group), tp_rank(group)
    vocab = pad_vocab_size(orig_vocab, divisible_by, world)
    tag = f"vocab={orig_vocab}->{vocab} scale={scale} smoothing={label_smoothing}"
    logits = _rand((SEQ, BATCH, vocab), 1, scale)
    target = _targets(vocab, world, 2)
    upstream = _rand((SEQ, BATCH), 3)

    ref_loss, ref_logits = _reference(logits, target, label_smoothing)
    (ref_loss * upstream).sum().backward()

    shard = logits.chunk(world, dim=-1)[rank].clone().requires_grad_(True)
    before = shard.detach().clone()
    loss = vocab_parallel_cross_entropy(shard, target, group, label_smoothing=label_smoothing)
    assert loss.shape == target.shape and loss.dtype == torch.float32, tag
    assert torch.isfinite(loss).all(), tag
    torch.testing.assert_close(loss.double(), ref_loss.detach(), **LOSS_TOL, msg=tag)
    (loss * upstream).sum().backward()
    assert torch.equal(shard.detach(), before), tag  # the input is not modified
    assert torch.isfinite(shard.grad).all(), tag
    ref_grad = ref_logits.grad.chunk(world, dim=-1)[rank]
    torch.testing.assert_close(shard.grad.double(), ref_grad, **GRAD_TOL, msg=tag)


def _check_all(group):
    for orig_vocab, divisible_by in ((37, 2), (50257, 128)):
        for scale in (3.0, 1e4):
            for label_smoothing in (0.0, 0.1):
                _check_cross_entropy(group, orig_vocab, divisible_by, scale, label_smoothing)


def _all_cross_entropy_checks(rank, world_size):
    for group in (dist.group.WORLD, dist.new_subgroups(2)[0]):
        _check_all(group)


def test_cross_entropy_tp2_tp4_matches_float64_reference():
    run_distributed(_all_cross_entropy_checks, 4, timeout=240)


def test_cross_entropy_tp1_matches_float64_reference():
    _check_all(None)


def test_label_smoothing_equals_torch_with_rescaled_alpha():
    # Megatron's alpha over V ids is torch's label_smoothing of alpha * V / (V - 1).
    logits, target = _rand((SEQ, BATCH, 40), 4), torch.randint(0, 40, (SEQ, BATCH))
    ours = vocab_parallel_cross_entropy(logits, target, None, label_smoothing=0.1)
    theirs = torch.nn.functional.cross_entropy(logits.view(-1, 40), target.view(-1), reduction="none",
                                               label_smoothing=0.1 * 40 / 39).view(SEQ, BATCH)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)  # fp32, different op order


def test_bf16_logits_give_fp32_loss_and_bf16_grad():
    logits = _rand((SEQ, BATCH, 40), 5).bfloat16().requires_grad_(True)
    target = torch.randint(0, 40, (SEQ, BATCH))
    loss = vocab_parallel_cross_entropy(logits, target, None)
    assert loss.dtype == torch.float32
    loss.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    ref = torch.nn.functional.cross_entropy(logits.detach().float().view(-1, 40), target.view(-1), reduction="none")
    torch.testing.assert_close(loss.view(-1), ref, rtol=1e-5, atol=1e-5)  # same bf16 values, fp32 math


def test_backward_twice_with_retain_graph():
    logits = _rand((SEQ, BATCH, 40), 6).requires_grad_(True)
    loss = vocab_parallel_cross_entropy(logits, torch.randint(0, 40, (SEQ, BATCH)), None, label_smoothing=0.1).sum()
    loss.backward(retain_graph=True)
    first = logits.grad.clone()
    loss.backward()
    torch.testing.assert_close(logits.grad, 2 * first)  # saved state must survive the first backward


def test_shape_and_argument_errors():
    import pytest

    with pytest.raises(ValueError, match="disagree"):
        vocab_parallel_cross_entropy(torch.randn(2, 3, 5), torch.zeros(3, 2, dtype=torch.long), None)
    with pytest.raises(ValueError, match="label_smoothing"):
        vocab_parallel_cross_entropy(torch.randn(2, 5), torch.zeros(2, dtype=torch.long), None, label_smoothing=1.0)


def test_masked_token_loss():
    loss = _rand((SEQ, BATCH), 7).abs().requires_grad_(True)
    mask = (torch.arange(SEQ * BATCH).view(SEQ, BATCH) % 3 != 0).float()
    out = masked_token_loss(loss, mask)
    expected = (loss.double() * mask.double()).sum() / mask.double().sum()
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected.detach(), rtol=1e-6, atol=1e-7)  # 12 fp32 terms
    out.backward()
    torch.testing.assert_close(loss.grad, mask / mask.sum())  # exact: the same two fp32 values
    # bf16 losses are accumulated in fp32.
    assert masked_token_loss(loss.detach().bfloat16(), mask).dtype == torch.float32
    # A fully masked micro-batch contributes 0, not NaN.
    assert masked_token_loss(loss.detach(), torch.zeros_like(mask)).item() == 0.0
