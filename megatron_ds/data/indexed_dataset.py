"""Megatron's mmap indexed dataset (`.bin` + `.idx`), bit for bit.

`.idx` layout (little endian):
    9 bytes  magic b"MMIDIDX\\x00\\x00"
    <Q       version (1)
    <B       dtype code (DTYPES)
    <Q       N, number of sequences
    <Q       M, number of document-index entries
    int32    sizes[N]      tokens per sequence
    int64    pointers[N]   byte offset of each sequence in `.bin`
    int64    doc_idx[M]    sequence index where each document starts (doc_idx[0] == 0, last == N)
`.bin` holds the token arrays back to back.

Terabytes of existing Megatron data are read through this file, so the reader is zero-copy
(np.memmap views) and checks the header against the file sizes up front: a truncated or corrupt
file fails with one line naming the file, not an mmap/numpy traceback deep inside training. The
`.bin` must be exactly as long as its `.idx` says (Megatron reads any longer one): an `.idx` of
another corpus next to it would otherwise train on token runs cut at that corpus's boundaries.
"""
from __future__ import annotations

import os
import struct

import numpy as np

_MAGIC = b"MMIDIDX\x00\x00"
_VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, N, M

DTYPES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}


class IndexedDatasetError(ValueError):
    """A `.bin/.idx` pair that is missing, truncated or not in Megatron's mmap format."""


def dtype_code(dtype) -> int:
    dtype = np.dtype(dtype)
    for code, candidate in DTYPES.items():
        if np.dtype(candidate) == dtype:
            return code
    raise IndexedDatasetError(
        f"dtype {dtype} cannot be stored in an indexed dataset; use one of "
        f"{sorted(np.dtype(d).name for d in DTYPES.values())}"
    )


def best_fitting_dtype(vocab_size) -> np.dtype:
    # 65500, not 65536: Megatron's threshold, kept so our files match theirs byte for byte.
    if vocab_size is not None and vocab_size < 65500:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


def data_file_path(prefix) -> str:
    return str(prefix) + ".bin"


def index_file_path(prefix) -> str:
    return str(prefix) + ".idx"


def dataset_exists(prefix) -> bool:
    return os.path.exists(index_file_path(prefix)) and os.path.exists(data_file_path(prefix))


def _memmap(path, dtype, offset, count):
    # np.memmap refuses zero-length maps; an empty dataset is legal, so give it an empty array.
    if count == 0:
        return np.empty(0, dtype=dtype)
    # A plain ndarray view of the map (still zero-copy): np.memmap subclasses leak into every
    # array derived from them, which confuses callers that check types or pickle results.
    return np.memmap(path, mode="r", dtype=dtype, offset=offset, shape=(count,)).view(np.ndarray)


class _Index:
    """The parsed `.idx` file: header fields plus memmapped sizes, pointers and doc_idx."""

    def __init__(self, path):
        self.path = path
        if not os.path.exists(path):
            raise IndexedDatasetError(f"index file {path} does not exist")
        file_size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(_HEADER.size)
        if len(head) < _HEADER.size:
            raise IndexedDatasetError(
                f"{path}: truncated index ({file_size} bytes, the header alone is {_HEADER.size})"
            )
        magic, version, code, n, m = _HEADER.unpack(head)
        if magic != _MAGIC:
            raise IndexedDatasetError(
                f"{path}: bad magic {magic!r}, expected {_MAGIC!r}; not a Megatron mmap index "
                "(the old 'lazy'/'cached' formats are not supported: re-run tools/preprocess_data.py)"
            )
        if version != _VERSION:
            raise IndexedDatasetError(f"{path}: index version {version}, only version {_VERSION} is supported")
        if code not in DTYPES:
            raise IndexedDatasetError(f"{path}: unknown dtype code {code}, expected one of {sorted(DTYPES)}")
        expected = _HEADER.size + 4 * n + 8 * n + 8 * m
        if file_size != expected:
            raise IndexedDatasetError(
                f"{path}: index is {file_size} bytes but its header (N={n} sequences, M={m} doc_idx "
                f"entries) implies {expected}; the file is truncated or corrupt"
            )
        self.dtype = np.dtype(DTYPES[code])
        offset = _HEADER.size
        self.sizes = _memmap(path, np.int32, offset, n)
        offset += 4 * n
        self.pointers = _memmap(path, np.int64, offset, n)
        offset += 8 * n
        self.doc_idx = _memmap(path, np.int64, offset, m)
        if m and (self.doc_idx[0] != 0 or self.doc_idx[-1] > n):
            raise IndexedDatasetError(
                f"{path}: doc_idx runs from {self.doc_idx[0]} to {self.doc_idx[-1]}, expected 0..{n}; "
                "the index is corrupt"
            )

    def data_bytes_needed(self) -> int:
        if len(self.sizes) == 0:
            return 0
        return int(self.pointers[-1]) + int(self.sizes[-1]) * self.dtype.itemsize


_ENDS_SAMPLED = 32  # documents whose last token _ends_agree reads


def _ends_agree(index: _Index, bin_path: str, have: int) -> bool:
    """Whether documents the ``.bin`` holds whole, sampled across it, all end in one token: the EOD
    of data preprocessed with --append-eod, wherever the index's document ends fall on that data.
    The index of another corpus puts its ends on arbitrary tokens of this one."""
    itemsize = index.dtype.itemsize
    # O(log N) reads of the mapped index, not a pass over it: sequences are stored in order, so
    # those starting within ``have`` bytes, and the documents made of them, are a prefix
    starts = int(np.searchsorted(index.pointers, have, side="right"))
    whole_docs = int(np.searchsorted(index.doc_idx[1:], starts, side="right"))
    if whole_docs < 2:
        return False
    docs = np.unique(np.linspace(0, whole_docs - 1, min(_ENDS_SAMPLED, whole_docs)).astype(np.int64))
    last = np.asarray(index.doc_idx[docs + 1]) - 1  # each sampled document's last sequence
    last = last[(last >= 0) & (last < len(index.sizes))]
    ends = np.asarray(index.pointers[last]) + (np.asarray(index.sizes[last], np.int64) - 1) * itemsize
    ends = ends[(np.asarray(index.sizes[last]) > 0) & (ends >= 0) & (ends + itemsize <= have)]
    if len(ends) < 2:
        return False
    data = _memmap(bin_path, np.uint8, 0, have)
    return len({bytes(data[int(e):int(e) + itemsize]) for e in ends}) == 1


def _other_itemsize(index: _Index, have: int) -> int | None:
    """The item size other than the index's at which the ``.bin`` holds exactly the index's tokens."""
    tokens = int(np.sum(index.sizes, dtype=np.int64))
    sizes = sorted({np.dtype(d).itemsize for d in DTYPES.values()} - {index.dtype.itemsize})
    return next((k for k in sizes if tokens and have == tokens * k), None)


def check_data_size(index: _Index, bin_path: str) -> int:
    """The ``.bin``'s size, which must be exactly what its index describes: the end of its last
    sequence. Otherwise one line says which of a dtype mismatch (the ``.bin`` holds exactly the
    index's tokens at another item size), extra bytes (an index of a smaller corpus) or truncation
    (or an index of a larger corpus: ``_ends_agree`` tells them apart where it can) it is."""
    if not os.path.exists(bin_path):
        raise IndexedDatasetError(f"data file {bin_path} does not exist (its index {index.path} does)")
    need, have = index.data_bytes_needed(), os.path.getsize(bin_path)
    if have == need:
        return have
    head = (f"{bin_path} has {have} bytes, but its index {index.path} ({len(index.sizes)} sequences of "
            f"{index.dtype.name}) {'needs' if have < need else 'covers'} {need}")
    other = _other_itemsize(index, have)
    if other is not None:
        names = "/".join(sorted(np.dtype(d).name for d in DTYPES.values() if np.dtype(d).itemsize == other))
        raise IndexedDatasetError(f"{head}: dtype mismatch: the .bin holds exactly the index's tokens as {other}-byte "
                                  f"ids ({names}), not as {index.dtype.name}; the .idx's dtype does not match its .bin")
    if have > need:
        raise IndexedDatasetError(f"{head}: the data file has extra bytes: is this .idx from another .bin?")
    if _ends_agree(index, bin_path, have):
        raise IndexedDatasetError(f"{head}: the data file is truncated")
    raise IndexedDatasetError(f"{head}: the data file is truncated, or this .idx is from another, larger .bin")


class MMapIndexedDataset:
    """Zero-copy reader. `ds[i]` is sequence i as a read-only view into the mapped `.bin`."""

    def __init__(self, path_prefix):
        self._prefix = str(path_prefix)
        self._open()

    def _open(self):
        idx_path, bin_path = index_file_path(self._prefix), data_file_path(self._prefix)
        self._index = _Index(idx_path)
        self._bin = _memmap(bin_path, np.uint8, 0, check_data_size(self._index, bin_path))

    # DataLoader workers pickle datasets: a memmap would pickle as a full in-memory copy of the
    # data, so ship the path and map the files again on the other side.
    def __getstate__(self):
        return {"path_prefix": self._prefix}

    def __setstate__(self, state):
        self._prefix = state["path_prefix"]
        self._open()

    @property
    def dtype(self) -> np.dtype:
        return self._index.dtype

    @property
    def sizes(self) -> np.ndarray:
        return self._index.sizes

    @property
    def pointers(self) -> np.ndarray:
        return self._index.pointers

    @property
    def doc_idx(self) -> np.ndarray:
        return self._index.doc_idx

    def __len__(self) -> int:
        return len(self._index.sizes)

    def _view(self, pointer, count) -> np.ndarray:
        start = int(pointer)
        return self._bin[start : start + int(count) * self.dtype.itemsize].view(self.dtype)

    def __getitem__(self, idx):
        if isinstance(idx, (int, np.integer)):
            n = len(self)
            if idx < 0:
                idx += n
            if not 0 <= idx < n:
                raise IndexError(f"sequence index {idx} out of range for {n} sequences in {self._prefix}")
            return self._view(self.pointers[idx], self.sizes[idx])
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise IndexError(f"slices of an indexed dataset must be contiguous (step 1), got step {step}")
            if start >= stop:
                return []
            sizes = self.sizes[start:stop]
            flat = self._view(self.pointers[start], int(np.sum(sizes, dtype=np.int64)))
            return np.split(flat, np.cumsum(sizes[:-1], dtype=np.int64))
        raise TypeError(f"indexed dataset indices must be int or slice, not {type(idx).__name__}")

    def get(self, idx, offset=0, length=None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence idx (to its end when length is None)."""
        size = int(self.sizes[idx])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens [{offset}, {offset + length}) out of range for sequence {idx} of {size}")
        return self._view(int(self.pointers[idx]) + offset * self.dtype.itemsize, length)

    def num_tokens(self) -> int:
        return int(np.sum(self.sizes, dtype=np.int64))


def write_index(path, dtype, sizes, doc_idx):
    """Write a `.idx` file for sequences of `sizes` tokens stored back to back in `dtype`."""
    sizes = np.asarray(sizes, dtype=np.int32)
    doc_idx = np.asarray(doc_idx, dtype=np.int64)
    pointers = np.zeros(len(sizes), dtype=np.int64)
    if len(sizes) > 1:
        np.cumsum(sizes[:-1], dtype=np.int64, out=pointers[1:])
    pointers *= np.dtype(dtype).itemsize
    with open(path, "wb") as f:
        f.write(_HEADER.pack(_MAGIC, _VERSION, dtype_code(dtype), len(sizes), len(doc_idx)))
        f.write(sizes.tobytes(order="C"))
        f.write(pointers.tobytes(order="C"))
        f.write(doc_idx.tobytes(order="C"))


class MMapIndexedDatasetBuilder:
    """Streams tokens into `.bin` and keeps sizes/doc_idx in memory until `finalize` writes `.idx`.

    Sizes are kept as a list of numpy chunks, not Python ints: a billion-sequence corpus would
    otherwise need tens of GB of list objects.
    """

    def __init__(self, out_file_bin, dtype=np.int64):
        self._dtype = np.dtype(dtype)
        dtype_code(self._dtype)  # fail now on an unsupported dtype, not at finalize
        self._path = str(out_file_bin)
        self._file = open(self._path, "wb")
        self._sizes: list[np.ndarray] = []
        self._doc_ends: list[np.ndarray] = []
        self._num_seqs = 0

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    def _as_array(self, tokens) -> np.ndarray:
        if hasattr(tokens, "detach"):  # torch tensor, without importing torch here
            tokens = tokens.detach().cpu().numpy()
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            arr = arr.reshape(-1)
        if arr.dtype == self._dtype:
            return arr
        # Megatron casts silently, so a 70k-token vocab written as uint16 wraps around unnoticed.
        if arr.size and np.issubdtype(self._dtype, np.integer):
            info = np.iinfo(self._dtype)
            lo, hi = arr.min(), arr.max()
            if lo < info.min or hi > info.max:
                raise IndexedDatasetError(
                    f"token ids span [{lo}, {hi}], which does not fit {self._dtype.name} for {self._path}; "
                    "use a wider dtype (int32 for vocabularies of 65500 or more)"
                )
        return arr.astype(self._dtype)

    def _write(self, arr, seq_lengths):
        self._file.write(arr.tobytes(order="C"))
        self._sizes.append(np.asarray(seq_lengths, dtype=np.int32))
        self._num_seqs += len(seq_lengths)

    def add_item(self, tokens):
        """One sequence (the document continues until `end_document`)."""
        arr = self._as_array(tokens)
        self._write(arr, [arr.size])

    def end_document(self):
        self._doc_ends.append(np.array([self._num_seqs], dtype=np.int64))

    def add_documents(self, tokens, lengths, seqs_per_doc=None):
        """Many documents in one write (the preprocessing fast path): `tokens` back to back,
        `lengths` per sequence, `seqs_per_doc` sequences in each document (default: one each)."""
        arr = self._as_array(tokens)
        lengths = np.asarray(lengths, dtype=np.int64)
        if int(lengths.sum()) != arr.size:
            raise IndexedDatasetError(f"sequence lengths sum to {int(lengths.sum())} but {arr.size} tokens were given")
        if seqs_per_doc is None:
            ends = np.arange(1, len(lengths) + 1, dtype=np.int64)
        else:
            ends = np.cumsum(np.asarray(seqs_per_doc, dtype=np.int64))
            if len(ends) and ends[-1] != len(lengths):
                raise IndexedDatasetError(
                    f"documents hold {int(ends[-1])} sequences but {len(lengths)} lengths were given")
        first = self._num_seqs
        self._write(arr, lengths)
        self._doc_ends.append(ends + first)

    def merge_file_(self, another_prefix):
        """Append another dataset (same dtype): its sequences, its documents and its `.bin` bytes."""
        other = _Index(index_file_path(another_prefix))
        if other.dtype != self._dtype:
            raise IndexedDatasetError(
                f"cannot merge {another_prefix} ({other.dtype.name}) into a {self._dtype.name} dataset"
            )
        bin_path = data_file_path(another_prefix)
        need = check_data_size(other, bin_path)
        offset = self._num_seqs
        self._sizes.append(np.array(other.sizes, dtype=np.int32))
        self._num_seqs += len(other.sizes)
        # The other file's doc_idx starts with its own 0, which is our current end: drop it.
        self._doc_ends.append(np.asarray(other.doc_idx[1:], dtype=np.int64) + offset)
        with open(bin_path, "rb") as f:
            remaining = need
            while remaining:
                block = f.read(min(remaining, 64 << 20))
                if not block:
                    break
                self._file.write(block)
                remaining -= len(block)

    def finalize(self, out_file_idx):
        self._file.close()
        sizes = np.concatenate(self._sizes) if self._sizes else np.zeros(0, np.int32)
        doc_idx = np.concatenate([np.zeros(1, np.int64)] + self._doc_ends)
        write_index(out_file_idx, self._dtype, sizes, doc_idx)

    def abort(self):
        """Close and delete the partial `.bin` (used when preprocessing fails midway)."""
        self._file.close()
        if os.path.exists(self._path):
            os.remove(self._path)

