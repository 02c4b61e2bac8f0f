"""C++ and NumPy index helpers against direct references, on many random inputs.

`hypothesis` is not installed in the project env, so the property tests are seeded loops:
every seed draws fresh document lengths (empty documents included), epochs and lengths.
"""
import numpy as np
import pytest

from megatron_ds.data import helpers

BACKENDS = ["numpy"] + (["cpp"] if helpers.have_extension() else [])


def reference_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch):
    """From the definition: list every token of the doc_idx stream as (doc_idx position, offset);
    sample k starts at stream token k * seq_length (samples of seq_length + 1 tokens overlap by one)."""
    where = [(pos, off) for pos, doc in enumerate(doc_idx) for off in range(int(sizes[doc]))]
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    rows = [where[k * seq_length] for k in range(num_samples + 1)]
    rows[0] = (0, 0)  # Megatron starts sample 0 at doc_idx[0], offset 0, even if that document is empty
    return np.array(rows, dtype=np.int64).reshape(-1, 2)


def megatron_loop_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch):
    """A plain transcription of Megatron's sequential walk (its _build_sample_idx)."""
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    out = [(0, 0)]
    pos, offset = 0, 0
    while len(out) <= num_samples:
        remaining = seq_length + 1
        while remaining != 0:
            length = int(sizes[doc_idx[pos]]) - offset
            remaining -= length
            if remaining <= 0:
                offset += remaining + length - 1
                remaining = 0
            else:
                pos, offset = pos + 1, 0
        out.append((pos, offset))
    return np.array(out, dtype=np.int64)


def random_case(rng):
    num_docs = int(rng.integers(1, 40))
    sizes = rng.integers(0, 30, num_docs).astype(np.int32)
    sizes[rng.integers(0, num_docs)] += 1  # at least one token
    if rng.random() < 0.3:
        sizes[0] = 0  # an empty first document exercises the sample-0 rule
    documents = np.arange(num_docs, dtype=np.int32)
    if rng.random() < 0.5:
        documents = np.sort(rng.choice(num_docs, int(rng.integers(1, num_docs + 1)), replace=False)).astype(np.int32)
    tokens_per_epoch = int(sizes[documents].sum())
    if tokens_per_epoch == 0:
        sizes[documents[0]] = 5
        tokens_per_epoch = int(sizes[documents].sum())
    num_epochs = int(rng.integers(1, 4))
    doc_idx = np.tile(documents, num_epochs)
    rng.shuffle(doc_idx)
    seq_length = int(rng.choice([1, 2, 3, 7, 16, 64]))
    return sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch


@pytest.mark.parametrize("backend", BACKENDS)
def test_sample_idx_matches_references_on_random_documents(backend):
    rng = np.random.default_rng(1234)
    for _ in range(300):
        case = random_case(rng)
        expected = reference_sample_idx(*case)
        np.testing.assert_array_equal(megatron_loop_sample_idx(*case), expected)
        got = helpers.build_sample_idx(*case, backend=backend)
        assert got.dtype == np.int32 and got.shape == expected.shape
        np.testing.assert_array_equal(got, expected)


@pytest.mark.skipif(not helpers.have_extension(), reason="C++ helpers not built")
def test_sample_idx_cpp_equals_numpy_on_larger_inputs():
    rng = np.random.default_rng(7)
    for seed in range(5):
        sizes = rng.lognormal(5, 1.2, 20000).astype(np.int32)
        sizes[rng.random(sizes.size) < 0.05] = 0
        doc_idx = np.tile(np.arange(sizes.size, dtype=np.int32), 2)
        rng.shuffle(doc_idx)
        tokens = int(sizes.sum())
        for seq_length in (127, 2048):
            args = (sizes, doc_idx, seq_length, 2, tokens)
            cpp = helpers.build_sample_idx(*args, backend="cpp")
            np.testing.assert_array_equal(cpp, helpers.build_sample_idx(*args, backend="numpy"))
            # int64 doc_idx (datasets of more than 2^31 documents) gives the same rows.
            np.testing.assert_array_equal(cpp, helpers.build_sample_idx(sizes, doc_idx.astype(np.int64), seq_length,
                                                                        2, tokens, backend="cpp"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_sample_idx_rejects_too_few_tokens(backend):
    sizes = np.array([3, 4], dtype=np.int32)
    with pytest.raises(ValueError, match="fewer tokens"):
        helpers.build_sample_idx(sizes, np.array([0, 1], dtype=np.int32), 2, 2, 7, backend=backend)


def reference_blending(weights, size):
    """Megatron's greedy rule, spelled out: pick the dataset furthest below weight * max(i, 1)."""
    counts = [0] * len(weights)
    index, sample = [], []
    for i in range(size):
        errors = [w * max(i, 1) - c for w, c in zip(weights, counts)]
        best = errors.index(max(errors))  # the first one on ties
        index.append(best)
        sample.append(counts[best])
        counts[best] += 1
    return np.array(index), np.array(sample)


def random_weights(rng):
    k = int(rng.integers(1, 6))
    kind = rng.integers(0, 3)
    if kind == 0:
        w = np.ones(k)  # exact ties everywhere
    elif kind == 1:
        w = rng.integers(1, 5, k).astype(np.float64)  # rational weights: frequent near-ties
    else:
        w = rng.random(k) + 1e-3
    return w / w.sum()


@pytest.mark.parametrize("backend", BACKENDS)
def test_blending_matches_reference(backend):
    rng = np.random.default_rng(99)
    for _ in range(150):
        weights = random_weights(rng)
        size = int(rng.integers(0, 600))
        index, sample = helpers.build_blending_indices(weights, size, backend=backend)
        ref_index, ref_sample = reference_blending(list(weights), size)
        assert index.dtype == np.uint8 and sample.dtype == np.int64
        np.testing.assert_array_equal(index, ref_index)
        np.testing.assert_array_equal(sample, ref_sample)


@pytest.mark.skipif(not helpers.have_extension(), reason="C++ helpers not built")
def test_blending_cpp_equals_numpy_and_stays_near_weights():
    rng = np.random.default_rng(5)
    for _ in range(10):
        weights = random_weights(rng)
        size = 20000
        cpp = helpers.build_blending_indices(weights, size, backend="cpp")
        fallback = helpers.build_blending_indices(weights, size, backend="numpy")
        np.testing.assert_array_equal(cpp[0], fallback[0])
        np.testing.assert_array_equal(cpp[1], fallback[1])
        # After every prefix of n samples the errors w*n - count sum to 0 and each is > -1 (a
        # dataset is picked only while its error is the largest, hence >= 0), so each is also
        # < k - 1; for two datasets that is |error| <= 1. The 1e-9 absorbs float rounding of w*n.
        counts = np.zeros((size, len(weights)))
        counts[np.arange(size), cpp[0]] = 1
        errors = weights[None, :] * np.arange(1, size + 1)[:, None] - np.cumsum(counts, axis=0)
        assert errors.min() > -1 - 1e-9
        assert errors.max() <= max(len(weights) - 1, 1) + 1e-9


@pytest.mark.parametrize("backend", BACKENDS)
def test_blending_many_datasets_use_int16(backend):
    weights = np.full(300, 1 / 300)
    index, sample = helpers.build_blending_indices(weights, 900, backend=backend)
    assert index.dtype == np.int16
    np.testing.assert_array_equal(index, np.tile(np.arange(300), 3))  # equal weights: round robin
    np.testing.assert_array_equal(sample, np.repeat(np.arange(3), 300))


def test_backend_is_described():
    text = helpers.backend_description()
    assert ("C++" in text) == helpers.have_extension()
