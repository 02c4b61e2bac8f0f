"""tools/merge_datasets.py: the merged dataset is the concatenation of its inputs."""
import importlib
import os
from pathlib import Path

import numpy as np

from megatron_ds.data.indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder

ROOT = Path(__file__).resolve().parents[2]
merge_datasets = importlib.import_module("megatron_ds.cli.merge_datasets")


def make_dataset(prefix, seed, dtype=np.uint16):
    """Random documents of 1-3 sequences; returns them as nested lists (the independent record)."""
    rng = np.random.default_rng(seed)
    docs = [[rng.integers(0, 50000, rng.integers(1, 30)).tolist() for _ in range(rng.integers(1, 4))]
            for _ in range(rng.integers(5, 20))]
    b = MMapIndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for doc in docs:
        for seq in doc:
            b.add_item(seq)
        b.end_document()
    b.finalize(f"{prefix}.idx")
    return docs


def read_docs(prefix):
    ds = MMapIndexedDataset(prefix)
    return [[ds[i].tolist() for i in range(int(ds.doc_idx[d]), int(ds.doc_idx[d + 1]))]
            for d in range(len(ds.doc_idx) - 1)]


def test_directory_merge_is_sorted_concatenation(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    expected = []
    for name, seed in (("s0", 0), ("s1", 1), ("s2", 2)):
        expected += make_dataset(shards / name, seed)
    (shards / "README").write_text("ignored")
    out = shards / "merged"  # output next to the inputs: a re-run must not merge it into itself
    for _ in range(2):
        assert merge_datasets.main(["--input", str(shards), "--output-prefix", str(out)]) == 0
        assert read_docs(out) == expected
    concatenated = b"".join((shards / f"s{i}.bin").read_bytes() for i in range(3))
    assert (shards / "merged.bin").read_bytes() == concatenated
    ds = MMapIndexedDataset(out)
    assert ds.pointers.tolist() == (2 * np.concatenate([[0], np.cumsum(ds.sizes[:-1])])).tolist()
    assert not [f for f in os.listdir(shards) if ".tmp-" in f]


def test_prefix_list_keeps_given_order(tmp_path):
    a, b = make_dataset(tmp_path / "a", 3), make_dataset(tmp_path / "b", 4)
    assert merge_datasets.main(["--input", str(tmp_path / "b"), str(tmp_path / "a"),
                                "--output-prefix", str(tmp_path / "out" / "ba")]) == 0
    assert read_docs(tmp_path / "out" / "ba") == b + a


def test_errors(tmp_path, capsys):
    make_dataset(tmp_path / "u16", 5)
    make_dataset(tmp_path / "i32", 6, dtype=np.int32)
    assert merge_datasets.main(["--input", str(tmp_path / "u16"), str(tmp_path / "i32"),
                                "--output-prefix", str(tmp_path / "x")]) == 1
    assert "cannot merge" in capsys.readouterr().err
    assert not (tmp_path / "x.bin").exists() and not (tmp_path / "x.idx").exists()
    os.remove(tmp_path / "i32.bin")
    assert merge_datasets.main(["--input", str(tmp_path), "--output-prefix", str(tmp_path / "y")]) == 1
    assert "i32.idx has no matching .bin" in capsys.readouterr().err
    assert merge_datasets.main(["--input", str(tmp_path / "nope"), "--output-prefix", str(tmp_path / "z")]) == 1
    assert "not found" in capsys.readouterr().err
