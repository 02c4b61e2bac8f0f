"""The mmap indexed dataset against Megatron's format as written from the spec with `struct`."""
import pickle
import struct

import numpy as np
import torch
import pytest

from megatron_ds.data.indexed_dataset import (
    DTYPES,
    IndexedDatasetError,
    MMapIndexedDataset,
    MMapIndexedDatasetBuilder,
    best_fitting_dtype,
    dataset_exists,
)

# Three documents: [[1, 2, 3], [4]] (two sequences), [[5, 6]], [[65535]]
SEQS = [[1, 2, 3], [4], [5, 6], [65535]]
DOC_IDX = [0, 2, 3, 4]


def spec_idx_bytes(code, itemsize, seqs, doc_idx):
    """The .idx file exactly as the format describes it, field by field."""
    out = b"MMIDIDX\x00\x00"
    out += struct.pack("<Q", 1)  # version
    out += struct.pack("<B", code)
    out += struct.pack("<Q", len(seqs))
    out += struct.pack("<Q", len(doc_idx))
    out += b"".join(struct.pack("<i", len(s)) for s in seqs)
    offset = 0
    for s in seqs:
        out += struct.pack("<q", offset)
        offset += len(s) * itemsize
    out += b"".join(struct.pack("<q", d) for d in doc_idx)
    return out


def spec_bin_bytes(fmt, seqs):
    return b"".join(struct.pack("<" + fmt * len(s), *s) for s in seqs)


def write_fixture(prefix, code=8, fmt="H", itemsize=2, seqs=SEQS, doc_idx=DOC_IDX):
    with open(f"{prefix}.idx", "wb") as f:
        f.write(spec_idx_bytes(code, itemsize, seqs, doc_idx))
    with open(f"{prefix}.bin", "wb") as f:
        f.write(spec_bin_bytes(fmt, seqs))


def test_builder_matches_spec_bytes(tmp_path):
    prefix = tmp_path / "built"
    b = MMapIndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    b.add_item([1, 2, 3])
    b.add_item(np.array([4], dtype=np.int64))
    b.end_document()
    b.add_item(torch.tensor([5, 6]))
    b.end_document()
    b.add_documents(np.array([65535]), [1])
    b.finalize(f"{prefix}.idx")
    assert (tmp_path / "built.idx").read_bytes() == spec_idx_bytes(8, 2, SEQS, DOC_IDX)
    assert (tmp_path / "built.bin").read_bytes() == spec_bin_bytes("H", SEQS)


@pytest.mark.parametrize("code,fmt,itemsize", [(8, "H", 2), (4, "i", 4), (5, "q", 8), (1, "B", 1)])
def test_reader_on_hand_written_fixture(tmp_path, code, fmt, itemsize):
    seqs = [[s % 250 for s in seq] for seq in SEQS]  # values every dtype can hold
    prefix = str(tmp_path / "fx")
    write_fixture(prefix, code, fmt, itemsize, seqs)
    ds = MMapIndexedDataset(prefix)
    assert dataset_exists(prefix)
    assert ds.dtype == np.dtype(DTYPES[code])
    assert len(ds) == 4
    assert ds.sizes.dtype == np.int32 and ds.sizes.tolist() == [3, 1, 2, 1]
    assert ds.pointers.dtype == np.int64 and ds.pointers.tolist() == [0, 3 * itemsize, 4 * itemsize, 6 * itemsize]
    assert ds.doc_idx.tolist() == DOC_IDX
    for i, seq in enumerate(seqs):
        assert ds[i].tolist() == seq
    assert ds[-1].tolist() == seqs[-1]
    assert [a.tolist() for a in ds[1:3]] == seqs[1:3]
    assert ds.get(0, offset=1).tolist() == seqs[0][1:]
    assert ds.get(0, offset=1, length=1).tolist() == seqs[0][1:2]
    assert ds.num_tokens() == 7
    with pytest.raises(IndexError):
        ds[4]
    with pytest.raises(IndexError):
        ds.get(0, offset=2, length=2)


def test_reader_is_zero_copy_and_pickles_by_path(tmp_path):
    prefix = str(tmp_path / "fx")
    write_fixture(prefix)
    ds = MMapIndexedDataset(prefix)
    item = ds[0]
    assert type(item) is np.ndarray and not item.flags.owndata and not item.flags.writeable
    blob = pickle.dumps(ds)
    assert len(blob) < 500  # the path, not the data
    assert pickle.loads(blob)[2].tolist() == SEQS[2]


def test_empty_dataset(tmp_path):
    prefix = str(tmp_path / "empty")
    MMapIndexedDatasetBuilder(prefix + ".bin", dtype=np.int32).finalize(prefix + ".idx")
    ds = MMapIndexedDataset(prefix)
    assert len(ds) == 0 and ds.doc_idx.tolist() == [0] and ds[0:0] == []


def test_merge_file_appends_sequences_documents_and_bytes(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    write_fixture(a)
    write_fixture(b, seqs=[[7, 8], [9]], doc_idx=[0, 1, 2])
    out = str(tmp_path / "ab")
    builder = MMapIndexedDatasetBuilder(out + ".bin", dtype=np.uint16)
    builder.merge_file_(a)
    builder.merge_file_(b)
    builder.finalize(out + ".idx")
    merged = SEQS + [[7, 8], [9]]
    assert (tmp_path / "ab.idx").read_bytes() == spec_idx_bytes(8, 2, merged, DOC_IDX + [5, 6])
    assert (tmp_path / "ab.bin").read_bytes() == spec_bin_bytes("H", merged)


def test_builder_accepts_torch_and_refuses_overflow(tmp_path):
    torch = pytest.importorskip("torch")
    prefix = str(tmp_path / "t")
    b = MMapIndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    b.add_item(torch.tensor([3, 4, 5]))
    with pytest.raises(IndexedDatasetError, match="does not fit uint16"):
        b.add_item([70000])  # Megatron would silently wrap this to 4464
    b.end_document()
    b.finalize(prefix + ".idx")
    assert MMapIndexedDataset(prefix)[0].tolist() == [3, 4, 5]


def test_best_fitting_dtype():
    assert best_fitting_dtype(50257) == np.uint16
    assert best_fitting_dtype(65499) == np.uint16
    assert best_fitting_dtype(65500) == np.int32
    assert best_fitting_dtype(128256) == np.int32


def _corrupt(tmp_path, name, mutate_idx=None, mutate_bin=None):
    prefix = str(tmp_path / name)
    write_fixture(prefix)
    if mutate_idx:
        data = open(prefix + ".idx", "rb").read()
        open(prefix + ".idx", "wb").write(mutate_idx(data))
    if mutate_bin:
        data = open(prefix + ".bin", "rb").read()
        open(prefix + ".bin", "wb").write(mutate_bin(data))
    return prefix


@pytest.mark.parametrize(
    "name,mutate_idx,mutate_bin,message",
    [
        ("magic", lambda d: b"XXIDIDX\x00\x00" + d[9:], None, "bad magic"),
        ("version", lambda d: d[:9] + struct.pack("<Q", 2) + d[17:], None, "version 2"),
        ("dtype", lambda d: d[:17] + bytes([9]) + d[18:], None, "unknown dtype code 9"),
        ("short_header", lambda d: d[:20], None, "truncated index"),
        ("short_index", lambda d: d[:-8], None, "truncated or corrupt"),
        ("doc_idx", lambda d: d[:-8] + struct.pack("<q", 99), None, "doc_idx"),
        ("short_bin", None, lambda d: d[:-1], "data file is truncated"),
    ],
)
def test_corrupt_files_raise_one_clear_error(tmp_path, name, mutate_idx, mutate_bin, message):
    prefix = _corrupt(tmp_path, name, mutate_idx, mutate_bin)
    with pytest.raises(IndexedDatasetError, match=message) as info:
        MMapIndexedDataset(prefix)
    assert name in str(info.value)  # the message names the file


def test_missing_files(tmp_path):
    prefix = str(tmp_path / "gone")
    with pytest.raises(IndexedDatasetError, match="does not exist"):
        MMapIndexedDataset(prefix)
    write_fixture(prefix)
    (tmp_path / "gone.bin").unlink()
    assert not dataset_exists(prefix)
    with pytest.raises(IndexedDatasetError, match=r"gone\.bin does not exist"):
        MMapIndexedDataset(prefix)
