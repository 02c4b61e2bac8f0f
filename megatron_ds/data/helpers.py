"""GPT sample index, BERT/T5 samples mapping and dataset blending: the C++ extension when built,
NumPy otherwise.

The extension (`megatron_ds.data._helpers`, compiled by `pip install` from helpers.cpp) is never
built at run time: a rank-0 `make` racing other ranks on a shared file system is one of the
failures we exist to remove. When it is missing the NumPy versions below are used; they give
identical arrays (tests/data/test_helpers.py proves it), only the blending fallback is slower.
"""
from __future__ import annotations

import numpy as np

try:
    from megatron_ds.data import _helpers as _ext

    _EXT_ERROR = None
except ImportError as exc:  # not compiled (no compiler at install time) or built for another Python
    _ext = None
    _EXT_ERROR = exc

_INT32_MAX = np.iinfo(np.int32).max


def have_extension(function: str | None = None) -> bool:
    """The C++ extension is loaded (and, when named, has that function: an extension compiled from an
    older helpers.cpp lacks the newer ones until reinstalled)."""
    return _ext is not None and (function is None or hasattr(_ext, function))


def backend_description() -> str:
    """One line for the start-up log saying which implementation builds the indices."""
    if _ext is not None:
        return f"C++ extension ({_ext.__file__})"
    return f"NumPy fallback (C++ extension unavailable: {_EXT_ERROR}; reinstall with `pip install -e .` to build it)"


_announced = False


def announce_backend(log=print) -> None:
    """Log backend_description() once per process (every dataset build calls this)."""
    global _announced
    if not _announced:
        _announced = True
        log(f" > data index helpers: {backend_description()}")


def _use_extension(backend: str | None) -> bool:
    if backend not in (None, "cpp", "numpy"):
        raise ValueError(f"backend must be None, 'cpp' or 'numpy', got {backend!r}")
    if backend == "cpp" and _ext is None:
        raise RuntimeError(f"the C++ helpers are not built ({_EXT_ERROR}); run `pip install --no-build-isolation -e .`")
    return backend != "numpy" and _ext is not None


def num_samples_in(num_epochs: int, tokens_per_epoch: int, seq_length: int) -> int:
    # -1: every sample needs seq_length + 1 tokens but shares one with the next, so only the
    # very last sample needs the extra token.
    return (num_epochs * tokens_per_epoch - 1) // seq_length


def build_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch, *, backend=None) -> np.ndarray:
    """Where each sample starts: row k = (position in doc_idx, token offset in that document).

    Sample k covers tokens [k * seq_length, (k + 1) * seq_length] (inclusive) of the stream formed
    by concatenating the documents in doc_idx order; row k + 1 is where it ends. Rows are int32
    when everything fits (as Megatron stores them), int64 otherwise.
    """
    seq_length, num_epochs, tokens_per_epoch = int(seq_length), int(num_epochs), int(tokens_per_epoch)
    if _use_extension(backend):
        return _ext.build_sample_idx(np.asarray(sizes), np.asarray(doc_idx), seq_length, num_epochs, tokens_per_epoch)
    return _build_sample_idx_numpy(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch)


def _build_sample_idx_numpy(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch) -> np.ndarray:
    if seq_length < 1 or num_epochs < 1 or tokens_per_epoch < 1:
        raise ValueError("build_sample_idx: seq_length, num_epochs and tokens_per_epoch must be >= 1")
    sizes = np.asarray(sizes)
    doc_idx = np.asarray(doc_idx)
    if doc_idx.size and (doc_idx.min() < 0 or doc_idx.max() >= sizes.shape[0]):
        raise IndexError(f"build_sample_idx: doc_idx entries must lie in [0, {sizes.shape[0]})")
    num_samples = num_samples_in(num_epochs, tokens_per_epoch, seq_length)
    # starts[j] = stream position of the first token of doc_idx[j]; starts[-1] = stream length.
    starts = np.zeros(doc_idx.shape[0] + 1, dtype=np.int64)
    np.cumsum(sizes[doc_idx], dtype=np.int64, out=starts[1:])
    last_token = num_samples * seq_length
    if num_samples > 0 and starts[-1] <= last_token:
        raise ValueError("build_sample_idx: doc_idx holds fewer tokens than num_epochs * tokens_per_epoch")
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    # side="right" skips empty documents: it finds the document that holds the token.
    docs = np.searchsorted(starts, positions, side="right") - 1
    offsets = positions - starts[docs]
    # The sequential walk starts sample 0 at doc_idx[0] even when that document is empty.
    docs[0], offsets[0] = 0, 0
    narrow = num_samples + 1 <= _INT32_MAX and doc_idx.shape[0] <= _INT32_MAX
    out = np.empty((num_samples + 1, 2), dtype=np.int32 if narrow else np.int64)
    out[:, 0], out[:, 1] = docs, offsets
    return out


def build_blending_indices(weights, size, *, backend=None) -> tuple[np.ndarray, np.ndarray]:
    """Interleave datasets by weight: (dataset_index, dataset_sample_index), each of length size.

    Sample i of the blend is sample dataset_sample_index[i] of dataset dataset_index[i]. Each is
    chosen greedily as the dataset furthest below its share weights[d] * i, so after any prefix
    of n samples dataset d has contributed within about one sample of weights[d] * n.
    dataset_index is uint8 (int16 beyond 256 datasets).
    """
    weights = np.ascontiguousarray(weights, dtype=np.float64)
    size = int(size)
    if _use_extension(backend):
        return _ext.build_blending_indices(weights, size)
    return _build_blending_indices_numpy(weights, size)


def _build_blending_indices_numpy(weights, size) -> tuple[np.ndarray, np.ndarray]:
    if weights.ndim != 1 or weights.shape[0] < 1:
        raise ValueError("build_blending_indices: weights must be a non-empty 1-D array")
    if size < 0:
        raise ValueError("build_blending_indices: size must be >= 0")
    num = weights.shape[0]
    if num > np.iinfo(np.int16).max:
        raise ValueError("build_blending_indices: at most 32767 datasets can be blended")
    dataset_index = np.empty(size, dtype=np.uint8 if num <= 256 else np.int16)
    if num == 1:
        dataset_index[:] = 0
        return dataset_index, np.arange(size, dtype=np.int64)
    # Each choice depends on every earlier one, so this stays a sequential loop; plain Python
    # floats round exactly like the C++ doubles (multiply, then subtract), keeping ties identical.
    w = [float(x) for x in weights]
    taken = [0] * num
    choices = [0] * size
    sample_index = [0] * size
    datasets = range(1, num)
    for i in range(size):
        position = float(i) if i > 1 else 1.0
        best, best_error = 0, w[0] * position - taken[0]
        for d in datasets:
            error = w[d] * position - taken[d]
            if error > best_error:
                best, best_error = d, error
        choices[i] = best
        sample_index[i] = taken[best]
        taken[best] += 1
    dataset_index[:] = choices
    return dataset_index, np.asarray(sample_index, dtype=np.int64)


# ---------------------------------------------------------------------------------------------
# BERT / T5 samples mapping (Megatron-DeepSpeed megatron/data/helpers.cpp `build_mapping`)

LONG_SENTENCE_LEN = 512  # Megatron skips documents holding a sentence longer than this


def build_mapping(docs, sizes, num_epochs, max_num_samples, max_seq_length, short_seq_prob, seed, min_num_sent,
                  *, backend=None) -> np.ndarray:
    """Shuffled rows (first sentence, end sentence, target length) of BERT/T5 samples.

    docs are document bounds into sizes (a doc_idx slice: document d is sentences
    [docs[d], docs[d + 1])). A sample is a run of whole sentences of one document, closed once it
    reaches its target length (max_seq_length, or with probability ~short_seq_prob a random
    length in [2, max_seq_length]) unless that leaves one sentence, and always at the document's
    end. Epochs repeat until max_num_samples is reached (checked between epochs, as Megatron does,
    so the result may hold more). uint32 rows unless sizes has 2^32 or more entries.
    Raises ValueError when no document yields a sample.
    """
    args = (np.ascontiguousarray(docs, dtype=np.int64), np.ascontiguousarray(sizes, dtype=np.int32),
            int(num_epochs), int(max_num_samples), int(max_seq_length), float(short_seq_prob), int(seed),
            int(min_num_sent))
    if _use_extension(backend):
        if hasattr(_ext, "build_mapping"):
            return _ext.build_mapping(*args)
        # an extension compiled before build_mapping existed: rebuilding it (`pip install -e .`) adds it
        if backend == "cpp":
            raise RuntimeError("the C++ helpers predate build_mapping; rebuild them with "
                               "`pip install --no-build-isolation -e .`")
    return _build_mapping_numpy(*args)


class _MT19937:
    """std::mt19937(seed)'s stream, in blocks: NumPy's legacy RandomState seeds the same generator
    (init_genrand) and returns raw 32-bit outputs for the full uint32 range."""

    def __init__(self, seed):
        self._rs = np.random.RandomState(seed)
        self._buf, self._pos = np.empty(0, dtype=np.uint32), 0

    def __call__(self) -> int:
        if self._pos == len(self._buf):
            self._buf, self._pos = self._rs.randint(0, 1 << 32, size=4096, dtype=np.uint32), 0
        self._pos += 1
        return int(self._buf[self._pos - 1])


class _MT19937_64:
    """std::mt19937_64 (Matsumoto & Nishimura's MT19937-64), twisted a block at a time with NumPy."""

    _N, _M = 312, 156
    _MATRIX_A, _UPPER, _LOWER = 0xB5026F5AA96619E9, 0xFFFFFFFF80000000, 0x7FFFFFFF

    def __init__(self, seed):
        mt = [int(seed) & 0xFFFFFFFFFFFFFFFF]
        for i in range(1, self._N):
            mt.append((6364136223846793005 * (mt[-1] ^ (mt[-1] >> 62)) + i) & 0xFFFFFFFFFFFFFFFF)
        self._mt = np.array(mt, dtype=np.uint64)
        self._out, self._pos = np.empty(0, dtype=np.uint64), 0

    def _twist(self):
        mt, n, m = self._mt, self._N, self._M
        a = np.uint64(self._MATRIX_A)
        # Entry i depends on entries i + 1 and i + m, which are already new for i >= n - m: three slices.
        for lo, hi in ((0, n - m), (n - m, n - 1), (n - 1, n)):
            nxt = mt[(np.arange(lo, hi) + 1) % n]
            x = (mt[lo:hi] & np.uint64(self._UPPER)) | (nxt & np.uint64(self._LOWER))
            xa = (x >> np.uint64(1)) ^ np.where(x & np.uint64(1), a, np.uint64(0))
            mt[lo:hi] = mt[(np.arange(lo, hi) + m) % n] ^ xa
        y = mt.copy()
        y ^= (y >> np.uint64(29)) & np.uint64(0x5555555555555555)
        y ^= (y << np.uint64(17)) & np.uint64(0x71D67FFFEDA60000)
        y ^= (y << np.uint64(37)) & np.uint64(0xFFF7EEE000000000)
        y ^= y >> np.uint64(43)
        self._out, self._pos = y, 0

    def __call__(self) -> int:
        if self._pos == len(self._out):
            self._twist()
        self._pos += 1
        return int(self._out[self._pos - 1])


def _mapping_rows(docs, sizes, num_epochs, max_num_samples, max_seq_length, short_seq_ratio, seed, min_num_sent):
    gen = _MT19937(seed)

    def target():
        if short_seq_ratio == 0:
            return max_seq_length
        r = gen()
        return 2 + r % (max_seq_length - 1) if r % short_seq_ratio == 0 else max_seq_length

    # A document qualifies (enough sentences, none too long) or not in every epoch alike.
    too_long = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(np.asarray(sizes) > LONG_SENTENCE_LEN, out=too_long[1:])
    sizes = np.asarray(sizes).tolist()
    docs = np.asarray(docs).tolist()
    rows = []
    for _ in range(num_epochs):
        if len(rows) >= max_num_samples:
            break
        at_start = len(rows)
        for first, last in zip(docs[:-1], docs[1:]):
            remaining = last - first
            if remaining < min_num_sent or (remaining > 1 and too_long[last] > too_long[first]):
                continue
            start, seq_len, num_sent, goal = first, 0, 0, target()
            for s in range(first, last):
                seq_len += sizes[s]
                num_sent += 1
                remaining -= 1
                if (seq_len >= goal and remaining > 1 and num_sent >= min_num_sent) or remaining == 0:
                    rows.append((start, s + 1, goal))
                    start, seq_len, num_sent, goal = s + 1, 0, 0, target()
        if len(rows) == at_start:
            raise ValueError("build_mapping: no document has enough sentences (each of at most 512 tokens) "
                             "for a sample")
    return rows


def _build_mapping_numpy(docs, sizes, num_epochs, max_num_samples, max_seq_length, short_seq_prob, seed,
                         min_num_sent) -> np.ndarray:
    if docs.ndim != 1 or sizes.ndim != 1 or docs.shape[0] < 1:
        raise ValueError("build_mapping: docs (document bounds) and sizes must be non-empty 1-D arrays")
    if num_epochs < 1 or max_seq_length < 2 or not 0.0 <= short_seq_prob <= 1.0 or seed < 1 or min_num_sent < 1:
        raise ValueError("build_mapping: needs num_epochs >= 1, max_seq_length >= 2, 0 <= short_seq_prob <= 1, "
                         "seed >= 1, min_num_sent >= 1")
    if docs.min() < 0 or docs.max() > sizes.shape[0] or np.any(np.diff(docs) < 0):
        raise IndexError("build_mapping: docs must be non-decreasing sentence indices within sizes")
    # C's round() rounds halves away from zero; Python's round() would round them to even.
    ratio = int(np.floor(1.0 / short_seq_prob + 0.5)) if short_seq_prob > 0 else 0
    rows = _mapping_rows(docs, sizes, num_epochs, max_num_samples, max_seq_length, ratio, seed, min_num_sent)
    out = np.array(rows, dtype=np.uint32 if sizes.shape[0] <= 0xFFFFFFFF else np.uint64).reshape(-1, 3)
    gen64 = _MT19937_64(seed + 1)
    for i in range(len(out) - 1, 0, -1):
        j = gen64() % (i + 1)
        out[[i, j]] = out[[j, i]]
    return out
