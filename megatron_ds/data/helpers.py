"""GPT sample index and dataset blending: the C++ extension when built, NumPy otherwise.

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


def have_extension() -> bool:
    return _ext is not None


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
