"""The chunked vocab-parallel cross entropy against a float64 dense reference and against the
existing (fp32, unchunked) path, at tensor parallel 1 and 2, fp32 and bf16 logits.

Reference: log_softmax in float64 over the whole (or only the real) vocabulary, gradients by
float64 autograd. Chunks of 5 tokens over 4 x 3 = 12 tokens: full chunks and a remainder.
"""
import pytest
import torch

from megatron_ds.parallel.chunked_cross_entropy import chunked_vocab_parallel_cross_entropy
from megatron_ds.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_ds.parallel.utils import tp_rank, tp_world_size
from tests.distributed import run_distributed

SEQ, BATCH, VOCAB, CHUNK = 4, 3, 64, 5
# fp32 logits: both sides are fp32 arithmetic on the same values, the reference float64; the
# summation order differs (chunks, all-reduce), each fp32 op rounding by ~6e-8 relative: the
# tolerances of tests/parallel/test_cross_entropy.py (measured <= 2e-7 relative there).
FP32_TOL = dict(rtol=1e-6, atol=1e-5)
# bf16 logits: the loss is still computed in fp32 from the same bf16 values (as the reference,
# which gets the bf16 values as float64), so it keeps the fp32 tolerance. The gradient is returned
# in bf16 (the logits' dtype): one bf16 rounding, 2^-8 relative, of values <= 1 in size.
BF16_GRAD_TOL = dict(rtol=2 ** -8, atol=2 ** -9)


def _reference(logits, target, real_vocab):
    logits = logits.double().requires_grad_(True)
    real = logits[..., :real_vocab]
    loss = -torch.log_softmax(real, dim=-1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    return loss, logits


def _check(group, dtype, real_vocab):
    world, rank = tp_world_size(group), tp_rank(group)
    gen = torch.Generator().manual_seed(11)
    logits = (torch.randn(SEQ, BATCH, VOCAB, generator=gen) * 4).to(dtype)
    high = real_vocab or VOCAB
    target = torch.randint(0, high, (SEQ, BATCH), generator=gen)
    target[0, 0], target[0, 1] = 0, high - 1  # both ends of the (real) vocabulary
    upstream = torch.randn(SEQ, BATCH, generator=gen)

    ref_loss, ref_logits = _reference(logits, target, high)
    (ref_loss * upstream).sum().backward()
    shard = logits.chunk(world, dim=-1)[rank].clone().requires_grad_(True)
    before = shard.detach().clone()
    loss = chunked_vocab_parallel_cross_entropy(shard, target, group, real_vocab_size=real_vocab,
                                                chunk_tokens=CHUNK)
    assert loss.dtype == torch.float32 and loss.shape == target.shape
    torch.testing.assert_close(loss.double(), ref_loss.detach(), **FP32_TOL)
    (loss * upstream).sum().backward()
    assert torch.equal(shard.detach(), before)  # the input is not modified
    assert shard.grad.dtype == dtype
    ref_grad = ref_logits.grad.chunk(world, dim=-1)[rank]
    tol = FP32_TOL if dtype == torch.float32 else BF16_GRAD_TOL
    torch.testing.assert_close(shard.grad.double(), ref_grad, **tol)
    if real_vocab is None:
        # and the existing path, on the same shard: the same numbers within fp32 summation order
        same = shard.detach().clone().requires_grad_(True)
        old = vocab_parallel_cross_entropy(same.float() if dtype != torch.float32 else same, target, group)
        torch.testing.assert_close(loss, old, **FP32_TOL)
        (old * upstream).sum().backward()
        torch.testing.assert_close(shard.grad, same.grad, **tol)
    return True


def _check_all(group):
    for dtype in (torch.float32, torch.bfloat16):
        # 50: padding only on the last of two ranks; 20: rank 1 of 2 holds padding only
        for real_vocab in (None, 50, 20):
            _check(group, dtype, real_vocab)
    return True


def _distributed(rank, world_size):
    return _check_all(None)


def test_tp1():
    _check_all(None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tp1_fp16_path_and_default_chunking(dtype):
    """Default chunk size (one chunk here) and 3-D logits as the model hands them over."""
    logits = torch.randn(2, 7, 32, dtype=dtype, requires_grad=True)
    target = torch.randint(0, 32, (2, 7))
    loss = chunked_vocab_parallel_cross_entropy(logits, target, None)
    ref = torch.nn.functional.cross_entropy(logits.float().reshape(-1, 32), target.reshape(-1), reduction="none")
    torch.testing.assert_close(loss.reshape(-1), ref, **FP32_TOL)
    with pytest.raises(ValueError, match="disagree"):
        chunked_vocab_parallel_cross_entropy(logits, target[:, :3], None)


def test_tp2():
    assert run_distributed(_distributed, 2, timeout=180) == [True, True]


def test_model_loss_takes_the_chunked_path_for_bf16_logits(monkeypatch):
    """language_model_loss on bf16 logits: the chunked function runs, and the loss and gradient equal the
    fp32 path's (the one the model used before) within the tolerances above."""
    import megatron_ds.model.language_model as gpt

    calls = []
    real = gpt.chunked_vocab_parallel_cross_entropy
    monkeypatch.setattr(gpt, "chunked_vocab_parallel_cross_entropy",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    logits = (torch.randn(3, 5, 40) * 3).to(torch.bfloat16).requires_grad_(True)
    labels, mask = torch.randint(0, 40, (3, 5)), (torch.rand(3, 5) > 0.3).float()
    loss = gpt.language_model_loss(logits, (labels, mask))
    loss.backward()
    assert calls == [1]
    same = logits.detach().clone().requires_grad_(True)
    from megatron_ds.parallel.cross_entropy import masked_token_loss

    old = masked_token_loss(vocab_parallel_cross_entropy(same.float(), labels, None), mask)
    old.backward()
    torch.testing.assert_close(loss, old, **FP32_TOL)
    torch.testing.assert_close(logits.grad, same.grad, **BF16_GRAD_TOL)


def test_transposed_logits_are_read_in_place(monkeypatch):
    """The model's logits are a [b, s, V] view of an [s, b, V] tensor: same losses and gradient as
    from a contiguous copy, and no copy of the logits is made for the flattening."""
    base = torch.randn(6, 3, 40, dtype=torch.bfloat16)  # [s, b, V]
    target = torch.randint(0, 40, (3, 6))  # [b, s]
    view = base.clone().requires_grad_(True)
    dense = base.transpose(0, 1).contiguous().requires_grad_(True)
    upstream = torch.randn(3, 6)
    got = chunked_vocab_parallel_cross_entropy(view.transpose(0, 1), target, None, chunk_tokens=4)
    want = chunked_vocab_parallel_cross_entropy(dense, target, None, chunk_tokens=4)
    torch.testing.assert_close(got, want, **FP32_TOL)  # same fp32 arithmetic, other chunk boundaries
    (got * upstream).sum().backward()
    (want * upstream).sum().backward()
    torch.testing.assert_close(view.grad.transpose(0, 1), dense.grad, **FP32_TOL)
    from megatron_ds.parallel import chunked_cross_entropy as module

    seen = []
    original = module._ChunkedVocabParallelCrossEntropy.apply
    monkeypatch.setattr(module._ChunkedVocabParallelCrossEntropy, "apply",
                        lambda x, *a: seen.append(x) or original(x, *a))
    chunked_vocab_parallel_cross_entropy(view.transpose(0, 1), target, None)
    assert seen[0].is_contiguous() and seen[0].data_ptr() == view.data_ptr()
