"""tools/preprocess_data.py end to end: decode(output) == input for every key, Megatron's layout,
malformed input, determinism across runs and worker counts, .gz/directory input, atomic output."""
import gzip
import importlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from megatron_ds.data.bpe_reference import ReferenceBPE
from megatron_ds.data.indexed_dataset import IndexedDatasetError, MMapIndexedDataset
from tests.data.test_tokenizer import VARIED, fuzz_texts, training_corpus

ROOT = Path(__file__).resolve().parents[2]


def _tool(name):
    return importlib.import_module(f"megatron_ds.cli.{name}")  # the body of tools/<name>.py


preprocess_data = _tool("preprocess_data")


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    corpus = training_corpus(d / "corpus.jsonl")
    assert _tool("train_tokenizer").main(["--input", str(corpus), "--vocab-size", "600", "--output-dir", str(d)]) == 0
    return str(d / "vocab.json"), str(d / "merges.txt")


def documents(n=300, seed=0):
    texts = VARIED + fuzz_texts(n, seed)
    # Lone surrogates would not survive the round trip (they become U+FFFD by design).
    return [{"text": t, "title": f"doc {i}: {t[:12]}", "id": i} for i, t in enumerate(texts) if "\ud800" not in t]


def write_jsonl(path, docs, gz=False):
    opener = gzip.open if gz else open
    with opener(path, "wt", encoding="utf-8") as f:
        for d in docs:
            f.write((d if isinstance(d, str) else json.dumps(d)) + "\n")
    return str(path)


def run(bpe, inp, prefix, *extra):
    vocab, merges = bpe
    return preprocess_data.main(["--input", str(inp), "--output-prefix", str(prefix), "--tokenizer-type",
                                 "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges,
                                 "--log-interval", "1", *extra])


def decode_docs(bpe, prefix, eod=None):
    ds, ref = MMapIndexedDataset(prefix), ReferenceBPE(*bpe)
    out = []
    for d in range(len(ds.doc_idx) - 1):
        ids = np.concatenate(ds[int(ds.doc_idx[d]) : int(ds.doc_idx[d + 1])]).tolist()
        if eod is not None:
            assert ids[-1] == eod  # the EOD is stored, and counted in the sequence's size
            ids = ids[:-1]
        out.append(ref.decode(ids))
    return ds, out


@pytest.mark.parametrize("append_eod", [True, False])
def test_round_trip_every_key(bpe, tmp_path, append_eod):
    docs = [d for d in documents() if d["text"]]  # empty documents are skipped, tested below
    inp = write_jsonl(tmp_path / "in.jsonl", docs)
    extra = ["--json-keys", "text", "title"] + (["--append-eod"] if append_eod else [])
    assert run(bpe, inp, tmp_path / "out", *extra) == 0
    eod = ReferenceBPE(*bpe).encoder["<|endoftext|>"] if append_eod else None
    for key in ("text", "title"):
        ds, decoded = decode_docs(bpe, tmp_path / f"out_{key}_document", eod)
        assert decoded == [d[key] for d in docs]
        assert ds.dtype == np.uint16  # vocab 600 < 65500
        assert ds.doc_idx.tolist() == list(range(len(docs) + 1))  # one sequence per document
        ref = ReferenceBPE(*bpe)
        assert ds.sizes.tolist() == [len(ref.encode(d[key])) + bool(append_eod) for d in docs]
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl", "out_text_document.bin", "out_text_document.idx",
                                             "out_title_document.bin", "out_title_document.idx"]


def test_deterministic_across_runs_and_workers(bpe, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", documents(600, seed=5))
    outputs = []
    for name, workers, chunk in (("a", 1, 1024), ("b", 1, 1024), ("c", 2, 7), ("d", 2, 64)):
        extra = ["--append-eod", "--workers", str(workers), "--chunk-size", str(chunk)]
        assert run(bpe, inp, tmp_path / name, *extra) == 0
        outputs.append(tuple((tmp_path / f"{name}_text_document.{ext}").read_bytes() for ext in ("bin", "idx")))
    assert all(o == outputs[0] for o in outputs)


def test_malformed_lines_are_counted_and_reported(bpe, tmp_path, capsys):
    good = [{"text": "first"}, {"text": "second"}, {"text": "third"}]
    lines = [good[0], "{not json", {"txt": "missing key"}, good[1], {"text": 42}, "[1, 2]",
             {"text": ["ok", 3]}, "", good[2], "\xff"]
    inp = write_jsonl(tmp_path / "in.jsonl", lines)
    assert run(bpe, inp, tmp_path / "out", "--workers", "2", "--chunk-size", "3") == 0
    err = capsys.readouterr().err
    for line_no in (2, 3, 5, 6, 7):  # the first five are shown with file and line
        assert f"in.jsonl:{line_no}:" in err
    assert "in.jsonl:10" not in err and "further malformed lines are counted" in err
    assert "skipped 6 malformed line(s) (bad JSON: 3, missing key: 1, wrong type: 2)" in err
    assert "ignored 1 blank line(s)" in err
    _, decoded = decode_docs(bpe, tmp_path / "out_text_document")
    assert decoded == ["first", "second", "third"]


@pytest.mark.parametrize("workers", ["1", "2"])
def test_strict_fails_on_first_malformed_line_and_leaves_nothing(bpe, tmp_path, capsys, workers):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"text": "ok"}] * 50 + [{"text": None}] + [{"text": "ok"}] * 50)
    assert run(bpe, inp, tmp_path / "out", "--strict", "--chunk-size", "8", "--workers", workers) == 1
    assert "in.jsonl:51: wrong type" in capsys.readouterr().err
    assert os.listdir(tmp_path) == ["in.jsonl"]  # no output, not even temporary files


@pytest.mark.parametrize("workers", ["1", "2"])
def test_failure_midway_leaves_no_complete_looking_files(tmp_path, capsys, workers):
    # NullTokenizer rejects a non-integer document deep into the input: the run fails after
    # writing some chunks, and must neither leave final names nor temporary files behind.
    inp = write_jsonl(tmp_path / "in.jsonl", [{"text": "1 2 3"}] * 40 + [{"text": "one"}] + [{"text": "4"}] * 10)
    rc = preprocess_data.main(["--input", inp, "--output-prefix", str(tmp_path / "out"), "--tokenizer-type",
                               "NullTokenizer", "--vocab-size", "10", "--chunk-size", "4", "--workers", workers])
    err = capsys.readouterr().err
    assert rc == 1 and "in.jsonl, lines 41-44: NullTokenizer expects space-separated integers" in err
    assert os.listdir(tmp_path) == ["in.jsonl"]


def test_gz_and_directory_input(bpe, tmp_path):
    docs = documents(40, seed=9)
    folder = tmp_path / "in"
    folder.mkdir()
    write_jsonl(folder / "b.jsonl.gz", docs[20:], gz=True)
    write_jsonl(folder / "a.jsonl", docs[:20])
    (folder / "notes.txt").write_text("not an input")
    assert run(bpe, folder, tmp_path / "dir", "--append-eod") == 0
    eod = ReferenceBPE(*bpe).encoder["<|endoftext|>"]
    _, decoded = decode_docs(bpe, tmp_path / "dir_text_document", eod)
    assert decoded == [d["text"] for d in docs if d["text"]]  # sorted file order: a then b
    # a glob naming the same files gives the same bytes
    assert run(bpe, str(folder / "*.jsonl*"), tmp_path / "glob", "--append-eod") == 0
    assert (tmp_path / "glob_text_document.bin").read_bytes() == (tmp_path / "dir_text_document.bin").read_bytes()


def test_sentences_lists_and_empty_documents(bpe, tmp_path, capsys):
    docs = [{"text": "One sentence. Two sentences!  Three? Four"}, {"text": ""}, {"text": ["pre", "", "split"]}]
    inp = write_jsonl(tmp_path / "in.jsonl", docs)
    assert run(bpe, inp, tmp_path / "s", "--split-sentences", "--append-eod") == 0
    assert "1 empty documents skipped" in capsys.readouterr().err
    ds = MMapIndexedDataset(tmp_path / "s_text_sentence")
    ref = ReferenceBPE(*bpe)
    assert ds.doc_idx.tolist() == [0, 4, 6]  # empty document and empty sentence dropped
    sentences = [ref.decode(ds[i].tolist()) for i in range(len(ds))]
    eod = "<|endoftext|>"
    # Punkt, as Megatron's NLTK splitter: the whitespace between sentences is dropped
    assert sentences == ["One sentence.", "Two sentences!", "Three?", "Four" + eod, "pre", "split" + eod]
    # --keep-newlines: the whitespace stays at the end of the sentence before it
    assert run(bpe, inp, tmp_path / "k", "--split-sentences", "--keep-newlines", "--append-eod") == 0
    ds = MMapIndexedDataset(tmp_path / "k_text_sentence")
    sentences = [ref.decode(ds[i].tolist()) for i in range(len(ds))]
    assert sentences == ["One sentence. ", "Two sentences!  ", "Three? ", "Four" + eod, "pre", "split" + eod]


def test_null_tokenizer_and_wide_dtype(tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"text": "1 69999 2"}, {"text": "5"}])
    assert preprocess_data.main(["--input", inp, "--output-prefix", str(tmp_path / "n"), "--tokenizer-type",
                                 "NullTokenizer", "--vocab-size", "70000", "--append-eod"]) == 0
    ds = MMapIndexedDataset(tmp_path / "n_text_document")
    assert ds.dtype == np.int32  # vocab 70001 >= 65500
    assert [ds[i].tolist() for i in range(2)] == [[1, 69999, 2, 70000], [5, 70000]]


def test_progress_and_flag_errors(bpe, tmp_path, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", documents(20))
    assert run(bpe, inp, tmp_path / "p", "--partitions", "2", "--keep-sequential-samples") == 0
    err = capsys.readouterr().err
    assert "docs/s" in err and "MB/s" in err and "ETA" in err
    with pytest.raises(SystemExit) as info:
        run(bpe, inp, tmp_path / "p", "--dataset-impl", "lazy")
    assert info.value.code == 2 and "only mmap" in capsys.readouterr().err
    assert run(bpe, tmp_path / "missing*.jsonl", tmp_path / "p") == 1
    assert "matches no file" in capsys.readouterr().err


def _refused(prefix) -> str:
    with pytest.raises(IndexedDatasetError) as info:
        MMapIndexedDataset(prefix)
    return str(info.value)


def test_an_idx_is_checked_against_its_bin_exactly(bpe, tmp_path, capsys):
    """The .idx of one preprocessed corpus next to the .bin of another, either way round, a .bin cut short,
    and an .idx whose dtype byte was changed: each refused in one line saying which it is."""
    prefixes = []
    for name, n, seed in (("small", 40, 1), ("large", 300, 2)):  # two corpora sharing no document
        docs = [{"text": t} for t in fuzz_texts(n, seed) if "\ud800" not in t]
        assert run(bpe, write_jsonl(tmp_path / f"{name}.jsonl", docs), tmp_path / name, "--append-eod") == 0
        prefixes.append(str(tmp_path / f"{name}_text_document"))
    small, large = prefixes
    small_bin, large_bin = Path(f"{small}.bin").read_bytes(), Path(f"{large}.bin").read_bytes()
    n_small, n_large = len(MMapIndexedDataset(small)), len(MMapIndexedDataset(large))

    def pair(name, idx_of, data):
        prefix = str(tmp_path / name)
        shutil.copy(f"{idx_of}.idx", f"{prefix}.idx")
        Path(f"{prefix}.bin").write_bytes(data)
        return prefix

    def head(prefix, n, dtype, verb, need, have):
        return (f"{prefix}.bin has {have} bytes, but its index {prefix}.idx ({n} sequences of {dtype}) "
                f"{verb} {need}: ")

    fwd = pair("fwd", small, large_bin)  # Megatron trains on this one without a word
    assert _refused(fwd) == head(fwd, n_small, "uint16", "covers", len(small_bin), len(large_bin)) + \
        "the data file has extra bytes: is this .idx from another .bin?"
    rev = pair("rev", large, small_bin)
    assert _refused(rev) == head(rev, n_large, "uint16", "needs", len(large_bin), len(small_bin)) + \
        "the data file is truncated, or this .idx is from another, larger .bin"
    cut = pair("cut", large, large_bin[:len(large_bin) // 2 + 1])  # every whole document still ends in EOD
    assert _refused(cut) == head(cut, n_large, "uint16", "needs", len(large_bin), len(large_bin) // 2 + 1) + \
        "the data file is truncated"
    wide = pair("wide", large, large_bin)
    with open(f"{wide}.idx", "r+b") as f:  # the dtype code after the 9-byte magic and the version
        f.seek(17)
        assert f.read(1) == bytes([8])  # uint16
        f.seek(17)
        f.write(bytes([4]))  # int32: the pointers still count 2-byte tokens
    last = int(MMapIndexedDataset(large).sizes[-1])
    assert _refused(wide) == head(wide, n_large, "int32", "needs", len(large_bin) + 2 * last, len(large_bin)) + \
        "dtype mismatch: the .bin holds exactly the index's tokens as 2-byte ids (int16/uint16), not as int32; " \
        "the .idx's dtype does not match its .bin"

    # as a user meets it: pretrain_gpt.py --dry-run (and start-up) refuses the data in that one line
    from megatron_ds.families import main  # noqa: PLC0415 - the entry point's imports only here

    vocab, merges = bpe
    argv = ("--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 16 --micro-batch-size 2 "
            "--train-iters 10 --lr 1e-3 --eval-iters 1 --dry-run --world-size 1 --tokenizer-type GPT2BPETokenizer "
            f"--vocab-file {vocab} --merge-file {merges} --data-path {fwd}").split()
    capsys.readouterr()
    assert main(argv) == 1
    assert capsys.readouterr().err.strip() == f"error: {_refused(fwd)}"
