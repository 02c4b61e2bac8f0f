"""Blending: --data-path parsing, Megatron's per-dataset sample counts, BlendableDataset contents."""
import math

import numpy as np
import pytest

from megatron_ds.data.blendable_dataset import BlendableDataset, blended_num_samples, parse_data_path
from megatron_ds.data.gpt_dataset import build_train_valid_test_datasets
from tests.data.test_gpt_dataset import quiet, random_docs, write_dataset


def test_parse_data_path():
    assert parse_data_path("corpus") == (["corpus"], None)
    assert parse_data_path(["corpus"]) == (["corpus"], None)
    prefixes, weights = parse_data_path("3 A 1 B")
    assert prefixes == ["A", "B"] and weights == [0.75, 0.25]
    assert parse_data_path(["0.3", "A", "0.7", "B"])[1] == pytest.approx([0.3, 0.7], abs=1e-15)
    with pytest.raises(ValueError, match="pairs of WEIGHT PATH"):
        parse_data_path("0.3 A B")
    with pytest.raises(ValueError, match="'A' is not a weight"):
        parse_data_path("A 0.3 B 0.7")
    with pytest.raises(ValueError, match="sum to 0"):
        parse_data_path("0 A 0 B")


def test_blended_num_samples_have_megatron_margin():
    counts = blended_num_samples([0.25, 0.75], [1000, 40, 0])
    # ceil(n * w * 1.005), computed independently in integers: n * w * 1005 / 1000.
    assert counts == [[math.ceil(1000 * 1005 / 4000), math.ceil(40 * 1005 / 4000), 0],
                      [math.ceil(3000 * 1005 / 4000), math.ceil(120 * 1005 / 4000), 0]]


class Numbered:
    """A stand-in dataset whose sample j of dataset d is (d, j)."""

    def __init__(self, d, n):
        self.d, self.n = d, n

    def __len__(self):
        return self.n

    def __getitem__(self, j):
        assert 0 <= j < self.n
        return (self.d, j)


def test_blendable_dataset_proportions_and_order(tmp_path):
    weights = [0.2, 0.5, 0.3]
    size = 5000
    parts = [Numbered(d, math.ceil(size * w * 1.005)) for d, w in enumerate(weights)]
    blend = BlendableDataset(parts, weights, size, cache_dir=str(tmp_path), log=quiet)
    assert len(blend) == size
    items = [blend[i] for i in range(size)]
    for d, w in enumerate(weights):
        mine = [j for dd, j in items if dd == d]
        assert mine == list(range(len(mine)))  # each dataset read in its own order, no repeats
        # Any prefix holds each dataset within the greedy bound: error > -1 and < k - 1 = 2
        # (see tests/data/test_helpers.py for why); checked here at a few prefixes.
        for n in (10, 777, size):
            got = sum(1 for dd, _ in items[:n] if dd == d)
            assert -1 < w * n - got < 2
    # Cached: a second blend with the same description loads the same arrays.
    again = BlendableDataset(parts, weights, size, cache_dir=str(tmp_path), log=quiet)
    assert isinstance(again.dataset_index, np.memmap)
    np.testing.assert_array_equal(again.dataset_index, blend.dataset_index)
    with pytest.raises(IndexError):
        blend[size]


def test_blend_larger_than_a_dataset_is_a_clear_error():
    with pytest.raises(ValueError, match="takes 5 samples from dataset 1, which has only 3"):
        BlendableDataset([Numbered(0, 100), Numbered(1, 3)], [0.5, 0.5], 10, log=quiet)


def test_blended_train_valid_test_from_data_path(tmp_path):
    rng = np.random.default_rng(3)
    docs_a, docs_b = random_docs(rng, 40, vocab=100), random_docs(rng, 30, vocab=100)
    a = write_dataset(tmp_path / "a", docs_a)
    b = write_dataset(tmp_path / "b", [d + 1000 for d in docs_b])  # token ids tell the sources apart
    nums = [300, 30, 10]
    train, valid, test = build_train_valid_test_datasets(
        data_path=f"0.3 {a} 0.7 {b}", split="80,15,5", train_valid_test_num_samples=nums, seq_length=8, seed=2,
        log=quiet)
    for ds, n in zip((train, valid, test), nums):
        assert isinstance(ds, BlendableDataset)
        # Blend size: the sum of the per-dataset requests, each with the 0.5% margin.
        assert len(ds) == math.ceil(n * 0.3 * 1.005) + math.ceil(n * 0.7 * 1.005)
    # Train samples come from both sources in about the weights' proportion: from a sample's
    # first token alone (< 1000: a, else b) the share of b is 0.7 within the greedy bound.
    from_b = sum(int(train[i]["text"][0] >= 1000) for i in range(nums[0]))
    # A sample starting in b can only come from b; the greedy bound is under 2 samples.
    assert abs(from_b - 0.7 * nums[0]) < 2


def test_blend_without_requested_samples_is_no_dataset(tmp_path):
    """--eval-iters 0 asks valid/test for 0 samples: a blend must then be None like a plain split,
    not an empty dataset a sampler cannot draw from."""
    rng = np.random.default_rng(3)
    a = write_dataset(tmp_path / "a", random_docs(rng, 40, vocab=100))
    b = write_dataset(tmp_path / "b", random_docs(rng, 30, vocab=100))
    train, valid, test = build_train_valid_test_datasets(
        data_path=f"0.5 {a} 0.5 {b}", split="80,15,5", train_valid_test_num_samples=[50, 0, 0], seq_length=8,
        seed=2, log=quiet)
    assert len(train) > 0 and valid is None and test is None


def test_blend_where_some_prefixes_leave_a_split_empty(tmp_path):
    """949,50,1: a (40 documents) has 2 validation documents, b (2 documents) none. Upstream's
    BlendableDataset asserts one weight per dataset there; here the validation blend is a's alone
    (weight renormalized to 1), with a warning naming b. Neither has test documents: no test set."""
    rng = np.random.default_rng(5)
    a = write_dataset(tmp_path / "a", random_docs(rng, 40, vocab=100, empty_fraction=0))
    b = write_dataset(tmp_path / "b", [d + 1000 for d in random_docs(rng, 2, vocab=100, empty_fraction=0)])
    lines = []
    nums = [100, 20, 5]
    train, valid, test = build_train_valid_test_datasets(
        data_path=f"0.25 {a} 0.75 {b}", split="949,50,1", train_valid_test_num_samples=nums, seq_length=4, seed=2,
        log=lines.append)
    assert test is None
    assert len(train) == math.ceil(100 * 0.25 * 1.005) + math.ceil(100 * 0.75 * 1.005)  # both, as before
    assert isinstance(valid, BlendableDataset) and len(valid.datasets) == 1 and valid.weights.tolist() == [1.0]
    assert len(valid) == math.ceil(20 * 1.005)
    assert all(valid[i]["text"].max() < 1000 for i in range(len(valid)))  # all from a
    assert set(np.unique(valid.datasets[0].doc_idx)) == {38, 39}  # a's validation documents
    warnings = [line for line in lines if line.startswith("WARNING")]
    assert warnings == [
        f"WARNING: --split 949,50,1 leaves the valid split of {b} without documents (2 in total): the valid blend "
        f"uses the other prefixes, their weights renormalized",
        f"WARNING: --split 949,50,1 leaves the test split of {a} {b} without documents (40, 2 in total): no test "
        f"dataset, its evaluation is skipped (as in Megatron-DeepSpeed)"]
