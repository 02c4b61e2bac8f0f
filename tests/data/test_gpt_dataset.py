"""GPTDataset: Megatron's index semantics, samples vs concatenate-and-slice, splits, errors."""
import pickle

import numpy as np
import pytest

from megatron_ds.data import helpers
from megatron_ds.data.gpt_dataset import (
    GPTDataset,
    build_index_mappings,
    build_train_valid_test_datasets,
    num_epochs_needed,
    split_document_ranges,
)
from megatron_ds.data.indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder
from tests.data.test_helpers import megatron_loop_sample_idx


def quiet(_msg):
    pass


def write_dataset(prefix, docs, dtype=np.uint16):
    builder = MMapIndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for doc in docs:
        builder.add_item(np.asarray(doc, dtype=dtype))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def random_docs(rng, n, mean=20, empty_fraction=0.1, vocab=50000):
    lengths = rng.poisson(mean, n)
    lengths[rng.random(n) < empty_fraction] = 0
    return [rng.integers(0, vocab, length) for length in lengths]


def megatron_reference_indices(documents, sizes, num_samples, seq_length, seed, exact_epochs=None):
    """Megatron's _build_index_mappings transcribed step by step (loops, np.mgrid, its dtypes);
    ``exact_epochs``: args.train_data_exact_num_epochs of a train split, with its asserts."""
    tokens_per_epoch = int(np.sum(sizes[documents]))
    num_epochs, total = 0, 0
    while True:
        num_epochs += 1
        total += tokens_per_epoch
        if (total - 1) // seq_length >= num_samples:
            break
    if exact_epochs is not None:
        num_epochs = exact_epochs
    rng = np.random.RandomState(seed=seed)
    if num_epochs == 1:
        separate = False
    else:
        from_epochs_minus_one = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
        last_epoch_samples = num_samples - from_epochs_minus_one
        assert last_epoch_samples >= 0, "last epoch number of samples should be non-negative."
        per_epoch = (tokens_per_epoch - 1) // seq_length
        assert last_epoch_samples <= per_epoch + 1, "last epoch number of samples exceeded max value."
        separate = last_epoch_samples < int(0.80 * per_epoch)

    def doc_idx_for(epochs):
        d = np.mgrid[0:epochs, 0:len(documents)][1]
        d[:] = documents
        d = d.reshape(-1).astype(np.int32)
        rng.shuffle(d)
        return d

    doc_idx = np.concatenate([doc_idx_for(num_epochs - 1), doc_idx_for(1)]) if separate else doc_idx_for(num_epochs)
    sample_idx = megatron_loop_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch)
    total_samples = sample_idx.shape[0] - 1
    first = from_epochs_minus_one if separate else total_samples
    shuffle_first = np.arange(0, first, dtype=np.uint32)
    rng.shuffle(shuffle_first)
    shuffle_idx = shuffle_first
    if first != total_samples:
        shuffle_last = np.arange(first, total_samples, dtype=np.uint32)
        rng.shuffle(shuffle_last)
        shuffle_idx = np.concatenate([shuffle_first, shuffle_last])
    return doc_idx, sample_idx, shuffle_idx, num_epochs, separate


def test_num_epochs_closed_form_matches_loop():
    for tokens in (1, 2, 7, 100, 1001):
        for seq in (1, 3, 64):
            for n in (0, 1, 5, 99, 1000):
                epochs, total = 0, 0
                while True:
                    epochs += 1
                    total += tokens
                    if (total - 1) // seq >= n:
                        break
                assert num_epochs_needed(tokens, seq, n) == epochs


def test_index_mappings_match_megatron_reference():
    rng = np.random.default_rng(0)
    seen_separate = set()
    for seed in range(40):
        sizes = rng.integers(0, 40, int(rng.integers(2, 60))).astype(np.int32)
        sizes[0] += 1
        lo = int(rng.integers(0, len(sizes) // 2))
        documents = np.arange(lo, len(sizes), dtype=np.int32)
        if sizes[documents].sum() == 0:
            sizes[documents[0]] = 3
        seq_length = int(rng.choice([1, 4, 16, 33]))
        per_epoch = max(1, (int(sizes[documents].sum()) - 1) // seq_length)
        # From a fraction of an epoch to several, landing on both sides of the 80% rule.
        num_samples = int(per_epoch * rng.choice([0.3, 1.0, 1.5, 1.9, 2.2, 3.95]))
        ref_doc, ref_sample, ref_shuffle, _, separate = megatron_reference_indices(
            documents, sizes, num_samples, seq_length, seed)
        seen_separate.add(separate)
        got = build_index_mappings(documents, sizes, num_samples, seq_length, seed, log=quiet)
        np.testing.assert_array_equal(got["doc_idx"], ref_doc)
        np.testing.assert_array_equal(got["sample_idx"], ref_sample)
        np.testing.assert_array_equal(got["shuffle_idx"], ref_shuffle)
        assert got["doc_idx"].dtype == np.int32 and got["sample_idx"].dtype == np.int32
        assert got["shuffle_idx"].dtype == np.uint32
    assert seen_separate == {True, False}  # both branches of the separate-last-epoch rule ran


def reference_samples(docs, doc_idx, sample_count, seq_length):
    """Concatenate the documents in doc_idx order and slice seq_length + 1 tokens every seq_length."""
    stream = np.concatenate([np.asarray(docs[d], dtype=np.int64) for d in doc_idx])
    return [stream[k * seq_length: k * seq_length + seq_length + 1] for k in range(sample_count)]


@pytest.mark.parametrize("num_samples", [10, 75, 400])  # within one epoch, about 2 epochs, many epochs
def test_samples_equal_concatenate_and_slice(tmp_path, num_samples):
    rng = np.random.default_rng(num_samples)
    docs = random_docs(rng, 30)
    prefix = write_dataset(tmp_path / "corpus", docs)
    indexed = MMapIndexedDataset(prefix)
    seq_length = 16
    ds = GPTDataset("train", prefix, np.arange(len(docs)), indexed, num_samples, seq_length, seed=3, log=quiet)
    assert len(ds) >= num_samples
    expected = reference_samples(docs, ds.doc_idx, len(ds), seq_length)
    for i in range(len(ds)):
        sample = ds[i]["text"]
        assert sample.dtype == np.int64 and sample.shape == (seq_length + 1,)
        np.testing.assert_array_equal(sample, expected[int(ds.shuffle_idx[i])])
    # Every epoch holds every document once.
    counts = np.bincount(ds.doc_idx, minlength=len(docs))
    assert (counts == counts[0]).all()


def test_split_ranges_follow_megatron_rounding():
    assert split_document_ranges("949,50,1", 1000) == [0, 949, 999, 1000]
    assert split_document_ranges("969, 30, 1", 10) == [0, 10, 10, 10]
    assert split_document_ranges("1", 7) == [0, 7, 7, 7]
    assert split_document_ranges("80/20", 11) == [0, 9, 11, 11]
    # Rounding past the end moves every boundary back: three parts of 2 documents.
    assert split_document_ranges("1,1,1", 2) == [0, 0, 1, 2]


def test_train_valid_test_split_documents(tmp_path):
    rng = np.random.default_rng(1)
    docs = random_docs(rng, 40, empty_fraction=0)
    prefix = write_dataset(tmp_path / "c", docs)
    train, valid, test = build_train_valid_test_datasets(
        data_path=[prefix], split="70,20,10", train_valid_test_num_samples=[50, 10, 5], seq_length=8, seed=1,
        log=quiet)
    for ds, (lo, hi) in zip((train, valid, test), ((0, 28), (28, 36), (36, 40))):
        assert set(np.unique(ds.doc_idx)) == set(range(lo, hi))
        expected = reference_samples(docs, ds.doc_idx, len(ds), 8)
        for i in range(min(len(ds), 20)):
            np.testing.assert_array_equal(ds[i]["text"], expected[int(ds.shuffle_idx[i])])
    assert len(train) >= 50 and len(valid) >= 10 and len(test) >= 5


def test_separate_train_valid_test_paths(tmp_path):
    rng = np.random.default_rng(2)
    a = write_dataset(tmp_path / "a", random_docs(rng, 10))
    b = write_dataset(tmp_path / "b", random_docs(rng, 5))
    train, valid, test = build_train_valid_test_datasets(
        train_data_path=a, valid_data_path=[b], train_valid_test_num_samples=[20, 4, 0], seq_length=8, seed=1,
        log=quiet)
    assert test is None
    assert set(np.unique(train.doc_idx)) == set(range(10)) and set(np.unique(valid.doc_idx)) == set(range(5))
    with pytest.raises(ValueError, match="cannot be combined"):
        build_train_valid_test_datasets(data_path=a, train_data_path=a, train_valid_test_num_samples=[1, 1, 1],
                                        seq_length=8, seed=1, log=quiet)


def test_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no dataset at .*missing: expected .*missing\.bin"):
        build_train_valid_test_datasets(data_path=str(tmp_path / "missing"), train_valid_test_num_samples=[1, 1, 1],
                                        seq_length=8, seed=1, log=quiet)
    small = write_dataset(tmp_path / "small", [[1, 2, 3], [4, 5]])
    # 1,1,1 of 2 documents: [0, 0, 1, 2] -- no training documents is an error (upstream trains nothing)
    with pytest.raises(ValueError, match=r"^--split 1,1,1 leaves the train split of .*small without documents \(2 in "
                                         r"total\); use more data or change --split$"):
        build_train_valid_test_datasets(data_path=small, split="1,1,1", train_valid_test_num_samples=[1, 1, 1],
                                        seq_length=8, seed=1, log=quiet)
    empty = write_dataset(tmp_path / "empty", [[], []])
    with pytest.raises(ValueError, match=r"train split of .*empty .* has no tokens"):
        build_train_valid_test_datasets(data_path=empty, split="1", train_valid_test_num_samples=[1, 0, 0],
                                        seq_length=8, seed=1, log=quiet)


def test_pickles_by_file_name_and_numpy_fallback_gives_same_indices(tmp_path, monkeypatch):
    rng = np.random.default_rng(4)
    docs = random_docs(rng, 25)
    prefix = write_dataset(tmp_path / "c", docs)
    ds = GPTDataset("train", prefix, np.arange(25), MMapIndexedDataset(prefix), 60, 16, seed=9, log=quiet)
    clone = pickle.loads(pickle.dumps(ds))
    assert isinstance(clone.sample_idx, np.memmap)  # re-mapped from the cache, not copied
    assert len(pickle.dumps(ds)) < 4096
    for i in range(len(ds)):
        np.testing.assert_array_equal(clone[i]["text"], ds[i]["text"])
    # With the extension hidden, the NumPy fallback builds the same arrays.
    monkeypatch.setattr(helpers, "_ext", None)
    assert "NumPy" in helpers.backend_description()
    fallback = build_index_mappings(np.arange(25), ds.indexed_dataset.sizes, 60, 16, 9, log=quiet)
    for name in ("doc_idx", "sample_idx", "shuffle_idx"):
        np.testing.assert_array_equal(fallback[name], getattr(ds, name))


@pytest.mark.parametrize("epochs,samples_in_epochs", [(1, 2.5), (1, 0.5), (2, 1.2), (2, 1.9), (3, 2.6)])
def test_exact_num_epochs_matches_megatron(epochs, samples_in_epochs):
    # --train-data-exact-num-epochs: exactly N epochs (one epoch may hold fewer samples than asked)
    rng = np.random.default_rng(epochs)
    sizes = rng.integers(1, 40, 50).astype(np.int32)
    documents = np.arange(3, 50, dtype=np.int32)
    per_epoch = (int(sizes[documents].sum()) - 1) // 16
    num_samples = int(per_epoch * samples_in_epochs)
    ref_doc, ref_sample, ref_shuffle, _, _ = megatron_reference_indices(documents, sizes, num_samples, 16, 7,
                                                                        exact_epochs=epochs)
    got = build_index_mappings(documents, sizes, num_samples, 16, 7, log=quiet, num_epochs=epochs)
    for name, ref in (("doc_idx", ref_doc), ("sample_idx", ref_sample), ("shuffle_idx", ref_shuffle)):
        np.testing.assert_array_equal(got[name], ref)
    assert len(got["doc_idx"]) == epochs * len(documents)


@pytest.mark.parametrize("epochs,samples_in_epochs", [(2, 0.5), (2, 3.0)])
def test_exact_num_epochs_refuses_what_megatron_asserts(epochs, samples_in_epochs):
    sizes = np.full(40, 17, dtype=np.int32)
    documents = np.arange(40, dtype=np.int32)
    num_samples = int((40 * 17 - 1) // 16 * samples_in_epochs)
    with pytest.raises(AssertionError):
        megatron_reference_indices(documents, sizes, num_samples, 16, 7, exact_epochs=epochs)
    with pytest.raises(ValueError, match="do not end in epoch 2"):
        build_index_mappings(documents, sizes, num_samples, 16, 7, log=quiet, num_epochs=epochs)

def test_empty_evaluation_splits_are_skipped_with_a_warning(tmp_path):
    """--split 949,50,1 on 2 documents: [0, 2, 2, 2]. Megatron-DeepSpeed builds no valid/test dataset
    (its build_dataset needs splits[i + 1] > splits[i]); here too, with one warning line per split."""
    small = write_dataset(tmp_path / "small", [[1, 2, 3], [4, 5]])
    lines = []
    train, valid, test = build_train_valid_test_datasets(
        data_path=small, split="949,50,1", train_valid_test_num_samples=[4, 2, 2], seq_length=2, seed=1,
        log=lines.append)
    assert valid is None and test is None and set(np.unique(train.doc_idx)) == {0, 1}
    warnings = [line for line in lines if line.startswith("WARNING")]
    assert warnings == [f"WARNING: --split 949,50,1 leaves the {name} split of {small} without documents (2 in total): "
                        f"no {name} dataset, its evaluation is skipped (as in Megatron-DeepSpeed)"
                        for name in ("valid", "test")]
    # no samples asked (--eval-iters 0) or no share in --split: nothing to warn about
    lines.clear()
    build_train_valid_test_datasets(data_path=small, split="100,0,0", train_valid_test_num_samples=[4, 2, 2],
                                    seq_length=2, seed=1, log=lines.append)
    build_train_valid_test_datasets(data_path=small, split="949,50,1", train_valid_test_num_samples=[4, 0, 0],
                                    seq_length=2, seed=1, log=lines.append)
    assert not [line for line in lines if line.startswith("WARNING")]
