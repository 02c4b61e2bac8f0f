"""BERT and T5 datasets equal Megatron-DeepSpeed's sampling.

Every comparison is against tests/data/megatron_bert_t5_reference.py, a transcription of
deepspeedai/Megatron-DeepSpeed's megatron/data/helpers.cpp (build_mapping), dataset_utils.py,
bert_dataset.py and t5_dataset.py, run on the same small indexed dataset (made here) with the same
seeds: the samples mapping, masks, 80/10/10 replacements, whole-word n-grams, sentinels, token types
and the sentence-order swap all have to agree exactly.
"""
from __future__ import annotations

import os
import pickle

import numpy as np
import pytest

from megatron_ds.data import helpers, masking
from megatron_ds.data.bert_t5_datasets import build_train_valid_test_datasets
from megatron_ds.data.indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder
from megatron_ds.data.tokenizer import build_tokenizer
from megatron_ds.errors import ConfigError, DataError
from tests.data import megatron_bert_t5_reference as ref

QUIET = lambda *a: None  # noqa: E731
SEED = 1234
WORDS, PIECES = 120, 60  # vocabulary: 5 specials, WORDS word starts, PIECES "##" continuations


def write_vocab(path):
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(WORDS)] + \
        [f"##p{i}" for i in range(PIECES)]
    path.write_text("".join(t + "\n" for t in tokens), encoding="utf-8")
    return str(path)


def random_documents(seed, num_docs=60):
    """Documents of 0-12 sentences of 1-30 tokens (a continuation piece follows a word 30% of the
    time), with one 600-token sentence in some documents (Megatron skips those documents)."""
    rng = np.random.RandomState(seed)
    docs = []
    for d in range(num_docs):
        sentences = []
        for _ in range(rng.randint(0, 13)):
            n = 600 if rng.random_sample() < 0.01 else rng.randint(1, 31)
            sent = [int(5 + rng.randint(WORDS)) if rng.random_sample() > 0.3 else int(5 + WORDS + rng.randint(PIECES))
                    for _ in range(n)]
            sentences.append(sent)
        docs.append(sentences)
    return docs


def write_dataset(prefix, docs):
    builder = MMapIndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for sentences in docs:
        for s in sentences:
            builder.add_item(np.array(s, dtype=np.uint16))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("bt")
    docs = random_documents(3)
    vocab_file = write_vocab(root / "vocab.txt")
    return {"root": root, "docs": docs, "prefix": write_dataset(root / "corpus_text_sentence", docs),
            "vocab": vocab_file, "sentences": [s for d in docs for s in d]}


def test_mersenne_twisters_are_the_standard_ones():
    # The C++ standard ([rand.predef]) requires these 10000th outputs of default-seeded engines.
    g32, g64 = ref.MT19937(5489), ref.MT19937_64(5489)
    assert [g32() for _ in range(10000)][-1] == 4123659995
    assert [g64() for _ in range(10000)][-1] == 9981545732273789042


BACKENDS = ["numpy", pytest.param("cpp", marks=pytest.mark.skipif(not helpers.have_extension("build_mapping"),
                                                                 reason="C++ helpers not built (or built before "
                                                                        "build_mapping)"))]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("max_num_samples,max_seq_length,short_seq_prob,seed,min_num_sent", [
    (50, 61, 0.1, 1234, 2),      # BERT with a binary head: 2 sentences at least
    (50, 62, 0.1, 1234, 1),      # T5 / BERT without a binary head
    (700, 40, 0.0, 7, 2),        # several epochs (checked between epochs), no short samples
    (30, 25, 0.4, 99, 1),        # ratio round(2.5) = 3 (C rounds halves away from zero)
    (30, 100, 1.0, 5, 2),        # every target length random
])
def test_build_mapping_equals_megatron(data, backend, max_num_samples, max_seq_length, short_seq_prob, seed,
                                       min_num_sent):
    ds = MMapIndexedDataset(data["prefix"])
    docs = ds.doc_idx[3:50]  # a split in the middle (documents 3..48)
    got = helpers.build_mapping(docs, ds.sizes, np.iinfo(np.int32).max - 1, max_num_samples, max_seq_length,
                                short_seq_prob, seed, min_num_sent, backend=backend)
    want = ref.build_mapping(docs.tolist(), ds.sizes.tolist(), np.iinfo(np.int32).max - 1, max_num_samples,
                             max_seq_length, short_seq_prob, seed, min_num_sent)
    assert got.dtype == np.uint32 and got.shape == want.shape and got.shape[0] >= max_num_samples
    np.testing.assert_array_equal(got, want)


def _sentences(data, row):
    start, end, target = (int(v) for v in row)
    return [list(s) for s in data["sentences"][start:end]], target


def _expected_mapping(data, split, s, num_samples, max_seq_length, min_num_sent):
    ds = MMapIndexedDataset(data["prefix"])
    bounds = ref.get_train_valid_test_split_(split, len(data["docs"]))
    docs = ds.doc_idx[bounds[s]:bounds[s + 1] + 1].tolist()
    return ref.build_mapping(docs, ds.sizes.tolist(), np.iinfo(np.int32).max - 1, num_samples, max_seq_length, 0.1,
                             SEED, min_num_sent)


@pytest.mark.parametrize("binary_head", [True, False])
def test_bert_samples_equal_megatron(data, tmp_path, binary_head):
    tok = build_tokenizer("BertWordPieceLowerCase", vocab_file=data["vocab"], log=None)
    _, inv_vocab, _, _, _ = ref.megatron_bert_vocab(data["vocab"])
    train, valid, test = build_train_valid_test_datasets(
        data["prefix"], "8,1,1", [150, 20, 0], max_seq_length=64, masked_lm_prob=0.15, short_seq_prob=0.1, seed=SEED,
        binary_head=binary_head, tokenizer=tok, data_cache_path=str(tmp_path), log=QUIET)
    assert test is None  # no samples asked for
    seen = {"is_random": set(), "truncated": set(), "kept": 0, "random": 0, "whole_word": 0}
    for s, dataset in ((0, train), (1, valid)):
        mapping = _expected_mapping(data, "8,1,1", s, [150, 20][s], 61, 2 if binary_head else 1)
        np.testing.assert_array_equal(dataset.samples_mapping, mapping)
        for idx in range(len(dataset)):
            sample, target = _sentences(data, mapping[idx])
            want = ref.bert_training_sample(sample, target, 64, list(inv_vocab.keys()), inv_vocab, tok.cls, tok.sep,
                                            tok.mask, tok.pad, 0.15, np.random.RandomState((SEED + idx) % 2**32),
                                            binary_head)
            got = dataset[idx]
            assert got.keys() == want.keys()
            for key in want:
                np.testing.assert_array_equal(got[key], want[key], err_msg=f"{key} of sample {idx}")
                assert np.asarray(got[key]).dtype == np.asarray(want[key]).dtype
            _count(got, tok, seen)
    # the comparison covered every branch: swapped and kept order (with a binary head), truncation,
    # the 10% kept / 10% random replacements and multi-piece words masked whole
    assert seen["is_random"] == ({0, 1} if binary_head else {0}) and seen["truncated"] == {0, 1}
    assert seen["kept"] > 0 and seen["random"] > 0 and seen["whole_word"] > 0


def _count(sample, tok, seen):
    seen["is_random"].add(sample["is_random"])
    seen["truncated"].add(sample["truncated"])
    masked = np.flatnonzero(sample["loss_mask"])
    text, labels = sample["text"], sample["labels"]
    seen["kept"] += int(np.sum(text[masked] == labels[masked]))
    seen["random"] += int(np.sum((text[masked] != labels[masked]) & (text[masked] != tok.mask)))
    seen["whole_word"] += sum(1 for i in masked if i > 0 and sample["loss_mask"][i - 1]
                              and tok.inv_vocab[int(labels[i])].startswith("##"))


def test_t5_samples_equal_megatron(data, tmp_path):
    tok = build_tokenizer("BertWordPieceLowerCase", vocab_file=data["vocab"], vocab_extra_ids=100, log=None)
    _, inv_vocab, bos, eos, sentinels = ref.megatron_bert_vocab(data["vocab"], 100)
    train, valid, _ = build_train_valid_test_datasets(
        data["prefix"], "8,1,1", [120, 10, 0], max_seq_length=64, max_seq_length_dec=32, masked_lm_prob=0.15,
        short_seq_prob=0.1, seed=SEED, tokenizer=tok, dataset_type="t5", data_cache_path=str(tmp_path), log=QUIET)
    spans = set()
    for s, dataset in ((0, train), (1, valid)):
        mapping = _expected_mapping(data, "8,1,1", s, [120, 10][s], 62, 1)
        np.testing.assert_array_equal(dataset.samples_mapping, mapping)
        for idx in range(len(dataset)):
            sample, target = _sentences(data, mapping[idx])
            want = ref.t5_training_sample(sample, target, 64, 32, list(inv_vocab.keys()), inv_vocab, tok.cls, tok.sep,
                                          tok.mask, tok.pad, 0.15, np.random.RandomState(SEED + idx), bos, eos,
                                          sentinels)
            got = dataset[idx]
            assert got.keys() == want.keys()
            for key in want:
                np.testing.assert_array_equal(got[key], want[key], err_msg=f"{key} of sample {idx}")
                assert np.asarray(got[key]).dtype == np.asarray(want[key]).dtype
            dec = got["text_dec"][got["loss_mask"] == 1].tolist()
            # span lengths: the decoder runs between sentinels
            marks = [i for i, t in enumerate(dec) if t in sentinels] + [len(dec)]
            spans.update(b - a - 1 for a, b in zip(marks, marks[1:]))
    assert max(spans) >= 3 and 1 in spans  # geometric span lengths, whole words of several pieces


@pytest.mark.parametrize("options", [
    dict(), dict(whole_word=False), dict(favor_longer_ngram=True), dict(max_ngrams=1),
    dict(max_ngrams=10, geometric_dist=True, masking_style="t5"), dict(masked_lm_prob=0.0),
    dict(masked_lm_prob=0.5, max_predictions=7.5),
])
def test_masking_options_equal_megatron(data, options):
    tok = build_tokenizer("BertWordPieceCase", vocab_file=data["vocab"], log=None)
    inv = tok.inv_vocab
    options = dict(options)
    prob = options.pop("masked_lm_prob", 0.15)
    max_predictions = options.pop("max_predictions", None)
    theirs_kw = {"max_ngrams": options.get("max_ngrams", 3), "do_whole_word_mask": options.get("whole_word", True),
                 "favor_longer_ngram": options.get("favor_longer_ngram", False),
                 "geometric_dist": options.get("geometric_dist", False),
                 "masking_style": options.get("masking_style", "bert")}
    rng = np.random.RandomState(0)
    for trial in range(40):
        tokens = [tok.cls] + [int(t) for t in rng.randint(5, 5 + WORDS + PIECES, size=rng.randint(1, 120))] + [tok.sep]
        budget = max_predictions if max_predictions is not None else prob * len(tokens)
        ours_rng, theirs_rng = np.random.RandomState(trial), np.random.RandomState(trial)
        got = masking.create_masked_lm_predictions(tokens, list(inv), lambda t: inv[t].startswith("##"), prob,
                                                   tok.cls, tok.sep, tok.mask, budget, ours_rng, **options)
        out, positions, labels, spans = ref.create_masked_lm_predictions(
            tokens, list(inv), inv, prob, tok.cls, tok.sep, tok.mask, budget, theirs_rng, **theirs_kw)
        assert (got.tokens, got.positions, got.labels) == (out, positions, labels)
        assert [(s.index, s.label) for s in got.spans] == [(s.index, s.label) for s in spans or []]
        # the same draws in the same order: the generators end in the same state
        assert ours_rng.randint(1 << 30) == theirs_rng.randint(1 << 30)


def test_deterministic_cached_and_picklable(data, tmp_path):
    tok = build_tokenizer("BertWordPieceLowerCase", vocab_file=data["vocab"], log=None)
    kw = dict(max_seq_length=64, masked_lm_prob=0.15, short_seq_prob=0.1, binary_head=True, tokenizer=tok,
              data_cache_path=str(tmp_path / "cache"))
    first = build_train_valid_test_datasets(data["prefix"], "8,1,1", [100, 0, 0], seed=SEED, log=QUIET, **kw)[0]
    files = sorted(os.listdir(tmp_path / "cache"))
    assert any(f.endswith("_samples_mapping.npy") for f in files)
    stamps = {f: os.stat(tmp_path / "cache" / f).st_mtime_ns for f in files}
    lines = []
    again = build_train_valid_test_datasets(data["prefix"], "8,1,1", [100, 0, 0], seed=SEED, log=lines.append, **kw)[0]
    assert any("loading cached index files" in line for line in lines)  # reused, not rebuilt
    assert {f: os.stat(tmp_path / "cache" / f).st_mtime_ns for f in files} == stamps
    copy = pickle.loads(pickle.dumps(again))  # as DataLoader workers receive it
    for i in range(0, len(first), 7):
        for key, value in first[i].items():
            np.testing.assert_array_equal(value, again[i][key])
            np.testing.assert_array_equal(value, copy[i][key])
    other = build_train_valid_test_datasets(data["prefix"], "8,1,1", [100, 0, 0], seed=SEED + 1, log=QUIET, **kw)[0]
    assert not np.array_equal(other.samples_mapping, first.samples_mapping)


def test_blend_of_two_prefixes(data, tmp_path):
    second = write_dataset(tmp_path / "other_text_sentence", random_documents(8, num_docs=30))
    tok = build_tokenizer("BertWordPieceLowerCase", vocab_file=data["vocab"], log=None)
    train, _, _ = build_train_valid_test_datasets(
        ["0.3", data["prefix"], "0.7", second], "1", [200, 0, 0], max_seq_length=64, masked_lm_prob=0.15,
        short_seq_prob=0.1, seed=SEED, binary_head=True, tokenizer=tok, data_cache_path=str(tmp_path), log=QUIET)
    # upstream's per-prefix requests: ceil(200 * w * 1.005), the blend as long as their sum
    assert len(train) == int(np.ceil(200 * 0.3 * 1.005)) + int(np.ceil(200 * 0.7 * 1.005))
    counts = np.bincount(train.dataset_index[:200], minlength=2)
    assert abs(counts[0] - 60) <= 1 and abs(counts[1] - 140) <= 1  # the greedy blend tracks the weights
    for key, value in train[0].items():
        part = train.datasets[int(train.dataset_index[0])]
        np.testing.assert_array_equal(value, part[int(train.dataset_sample_index[0])][key])


def test_errors_are_one_line(data, tmp_path):
    one_sentence = write_dataset(tmp_path / "single_text_document", [[[7, 8, 9]] for _ in range(10)])
    tok = build_tokenizer("BertWordPieceLowerCase", vocab_file=data["vocab"], log=None)
    kw = dict(max_seq_length=64, masked_lm_prob=0.15, short_seq_prob=0.1, seed=SEED, tokenizer=tok,
              data_cache_path=str(tmp_path), log=QUIET)
    with pytest.raises(DataError, match="--split-sentences"):
        build_train_valid_test_datasets(one_sentence, "1", [10, 0, 0], binary_head=True, **kw)
    with pytest.raises(ConfigError, match="--vocab-extra-ids 100"):
        build_train_valid_test_datasets(data["prefix"], "1", [10, 0, 0], dataset_type="t5", max_seq_length_dec=32,
                                        **kw)
    with pytest.raises(DataError, match="seed >= 1"):
        build_train_valid_test_datasets(data["prefix"], "1", [10, 0, 0], **{**kw, "seed": 0})
    gpt = build_tokenizer("NullTokenizer", vocab_size=300, log=None)
    with pytest.raises(ConfigError, match="BertWordPieceLowerCase"):
        build_train_valid_test_datasets(data["prefix"], "1", [10, 0, 0], **{**kw, "tokenizer": gpt})


def test_exact_epochs_take_every_epoch(data, tmp_path):
    # --train-data-exact-num-epochs: upstream's get_samples_mapping builds exactly that many epochs for the
    # train split, with no sample limit
    tok = build_tokenizer("BertWordPieceLowerCase", vocab_file=data["vocab"], log=None)
    train, _, _ = build_train_valid_test_datasets(
        data["prefix"], "1", [5, 0, 0], max_seq_length=64, masked_lm_prob=0.15, short_seq_prob=0.1, seed=SEED,
        binary_head=True, tokenizer=tok, data_cache_path=str(tmp_path), train_num_epochs=3, log=QUIET)
    ds = MMapIndexedDataset(data["prefix"])
    want = ref.build_mapping(ds.doc_idx.tolist(), ds.sizes.tolist(), 3, np.iinfo(np.int64).max - 1, 61, 0.1, SEED, 2)
    np.testing.assert_array_equal(train.samples_mapping, want)
    assert len(train) > 5


def _build_in_child(prefix, vocab, cache, log_path, queue):
    tok = build_tokenizer("BertWordPieceLowerCase", vocab_file=vocab, log=None)
    with open(log_path, "w") as f:
        train = build_train_valid_test_datasets(
            prefix, "1", [300, 0, 0], max_seq_length=64, masked_lm_prob=0.15, short_seq_prob=0.1, seed=SEED,
            binary_head=True, tokenizer=tok, data_cache_path=cache, log=lambda m: print(m, file=f, flush=True))[0]
    queue.put(np.asarray(train.samples_mapping).tobytes())


def test_samples_mapping_built_once_by_concurrent_processes(data, tmp_path):
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    logs = [tmp_path / f"log{i}" for i in range(3)]
    procs = [ctx.Process(target=_build_in_child, args=(data["prefix"], data["vocab"], str(tmp_path / "c"), str(p),
                                                       queue)) for p in logs]
    for p in procs:
        p.start()
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert len(set(results)) == 1  # every process reads the same mapping
    builders = [p for p in logs if "building index files" in p.read_text()]
    assert len(builders) == 1  # one process built it, the others waited for its files
