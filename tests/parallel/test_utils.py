"""Pure helpers: sizes, vocabulary padding and ranges (no processes needed)."""
import pytest

from megatron_ds.parallel.utils import (
    divide,
    pad_vocab_size,
    tp_rank,
    tp_world_size,
    vocab_range,
)


def test_no_group_means_tensor_parallel_size_one():
    assert tp_world_size(None) == 1
    assert tp_rank(None) == 0


def test_divide():
    assert divide(12, 4) == 3
    with pytest.raises(ValueError, match="10 is not divisible by 4"):
        divide(10, 4)
    with pytest.raises(ValueError):
        divide(10, 0)


def _pad_by_counting(vocab, divisible_by, tp):
    # Megatron's definition, step by step: grow until divisible by divisible_by * tp.
    padded = vocab
    while padded % (divisible_by * tp) != 0:
        padded += 1
    return padded


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("divisible_by", [1, 2, 128])
def test_pad_vocab_size_matches_megatron_definition(tp, divisible_by):
    for vocab in [1, 37, 50257, 50304, 32000, 65535]:
        assert pad_vocab_size(vocab, divisible_by, tp) == _pad_by_counting(vocab, divisible_by, tp)


def test_pad_vocab_size_known_values():
    assert pad_vocab_size(50257, 128, 1) == 50304  # GPT-2 in Megatron's logs
    assert pad_vocab_size(50257, 128, 4) == 50688
    assert pad_vocab_size(37, 2, 2) == 40
    with pytest.raises(ValueError):
        pad_vocab_size(0, 128, 1)


def test_vocab_range_covers_vocabulary_without_overlap():
    ranges = [vocab_range(40, r, 4) for r in range(4)]
    assert ranges == [(0, 10), (10, 20), (20, 30), (30, 40)]
    with pytest.raises(ValueError):
        vocab_range(37, 0, 2)
