"""`tools/preprocess_data.py --split-sentences` end to end for BERT/T5: a JSONL corpus, a WordPiece
vocabulary trained offline (tools/train_tokenizer.py --type wordpiece), sentence-level `.bin/.idx` with
documents delimited, then BERT and T5 samples built from it.

Megatron-DeepSpeed splits with NLTK's Punkt and its pretrained English model (tools/preprocess_data.py
Encoder.initializer: nltk.load("tokenizers/punkt/english.pickle")); the sentences below are what
that model gives (abbreviations such as "Dr." and "U.S." do not end a sentence, "3.5" is no boundary),
and each sequence must hold the ids Megatron's BERT tokenizer gives its sentence.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from megatron_ds.data.bert_t5_datasets import build_train_valid_test_datasets
from megatron_ds.data.indexed_dataset import MMapIndexedDataset
from megatron_ds.data.tokenizer import build_tokenizer
from tests.data import bert_tokenization_reference as ref
from megatron_ds.cli import preprocess_data, train_tokenizer

DOCS = [
    ("Dr. Smith went to Washington. He arrived at 3.5 p.m. on Monday! Was the U.S. capital busy? Yes, it was.",
     ["Dr. Smith went to Washington.", "He arrived at 3.5 p.m. on Monday!", "Was the U.S. capital busy?",
      "Yes, it was."]),
    ("A single sentence without a final stop", ["A single sentence without a final stop"]),
    ("", []),  # no tokens: skipped, as Megatron skips empty documents
    ("Mr. Brown's café served crème brûlée.  The bill was $12.50, tip included.\nThe end.",
     ["Mr. Brown's café served crème brûlée.", "The bill was $12.50, tip included.", "The end."]),
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("split")
    path = root / "corpus.jsonl"
    filler = [f"Sentence number {i} talks about topic {i % 7}. It has a second part {i}. And a third one."
              for i in range(60)]
    with open(path, "w", encoding="utf-8") as f:
        for text in [d for d, _ in DOCS] + filler:
            f.write(json.dumps({"text": text}) + "\n")
    assert train_tokenizer.main(["--input", str(path), "--type", "wordpiece", "--vocab-size", "400",
                                 "--output-dir", str(root / "tok"), "--min-frequency", "1"]) == 0
    return root, str(path), str(root / "tok" / "vocab.txt"), filler


def test_one_sequence_per_sentence_documents_delimited(corpus):
    root, path, vocab, filler = corpus
    argv = ["--input", path, "--output-prefix", str(root / "bt"), "--tokenizer-type", "BertWordPieceLowerCase",
            "--vocab-file", vocab, "--split-sentences", "--vocab-extra-ids", "100", "--workers", "2"]
    assert preprocess_data.main(argv) == 0
    ds = MMapIndexedDataset(root / "bt_text_sentence")
    theirs = ref.FullTokenizer(vocab, do_lower_case=True)
    expected_docs = [sents for _, sents in DOCS if sents] + \
        [[f"Sentence number {i} talks about topic {i % 7}.", f"It has a second part {i}.", "And a third one."]
         for i in range(len(filler))]
    bounds = np.cumsum([0] + [len(s) for s in expected_docs])
    assert ds.doc_idx.tolist() == bounds.tolist()  # one document per non-empty line, in order
    want = [theirs.convert_tokens_to_ids(theirs.tokenize(s)) for doc in expected_docs for s in doc]
    assert [ds[i].tolist() for i in range(len(ds))] == want
    assert ds.dtype == np.uint16  # 400 + [BOS] [EOS] + 100 sentinels fit uint16


def test_bert_and_t5_samples_from_preprocessed_corpus(corpus, tmp_path):
    root, path, vocab, _ = corpus
    prefix = str(tmp_path / "c")
    assert preprocess_data.main(["--input", path, "--output-prefix", prefix, "--tokenizer-type",
                                 "BertWordPieceLowerCase", "--vocab-file", vocab, "--split-sentences"]) == 0
    ds = MMapIndexedDataset(prefix + "_text_sentence")
    tok = build_tokenizer("BertWordPieceLowerCase", vocab_file=vocab, vocab_extra_ids=100, log=None)
    quiet = lambda *a: None  # noqa: E731
    bert, _, _ = build_train_valid_test_datasets(prefix + "_text_sentence", "1", [40, 0, 0], max_seq_length=48,
                                                 masked_lm_prob=0.15, short_seq_prob=0.1, seed=1234, binary_head=True,
                                                 tokenizer=tok, data_cache_path=str(tmp_path), log=quiet)
    for i in range(len(bert)):
        sample = bert[i]
        text = sample["text"][sample["padding_mask"] == 1]
        start, end, _ = (int(v) for v in bert.samples_mapping[i])
        doc = int(np.searchsorted(ds.doc_idx, start, side="right")) - 1
        assert end <= ds.doc_idx[doc + 1]  # a sample never crosses a document boundary
        assert text[0] == tok.cls and text[-1] == tok.sep and np.sum(text == tok.sep) == 2
        original = np.where(sample["loss_mask"] == 1, sample["labels"], sample["text"])[sample["padding_mask"] == 1]
        pieces = [ds[j].tolist() for j in range(start, end)]
        a, b = original[1:list(text).index(tok.sep)], original[list(text).index(tok.sep) + 1:-1]
        first, second = (b, a) if sample["is_random"] else (a, b)
        joined = np.concatenate([first, second]).tolist()
        assert sample["truncated"] or joined == [t for p in pieces for t in p]  # A then B = the sentences in order
    t5, _, _ = build_train_valid_test_datasets(prefix + "_text_sentence", "1", [40, 0, 0], max_seq_length=48,
                                               max_seq_length_dec=24, masked_lm_prob=0.15, short_seq_prob=0.1,
                                               seed=1234, tokenizer=tok, dataset_type="t5",
                                               data_cache_path=str(tmp_path), log=quiet)
    sentinels = set(tok.additional_special_tokens_ids)
    for i in range(len(t5)):
        s = t5[i]
        enc = s["text_enc"][s["text_enc"] != tok.pad].tolist()
        dec = s["labels"][s["loss_mask"] == 1].tolist()
        # filling each sentinel of the encoder input with the decoder's span restores the text
        spans, current = {}, None
        for t in dec[:-1]:
            if t in sentinels:
                current = t
                spans[t] = []
            else:
                spans[current].append(t)
        restored = [t for e in enc for t in (spans[e] if e in sentinels else [e])]
        start, end, target = (int(v) for v in t5.samples_mapping[i])
        assert dec[-1] == tok.eos_token_id and s["text_dec"][0] == tok.bos_token_id
        assert restored == [t for j in range(start, end) for t in ds[j].tolist()][:target]


def test_lang_and_append_eod_errors(corpus, tmp_path, capsys):
    root, path, vocab, _ = corpus
    base = ["--input", path, "--output-prefix", str(tmp_path / "x"), "--tokenizer-type", "BertWordPieceLowerCase",
            "--vocab-file", vocab]
    with pytest.raises(SystemExit):
        preprocess_data.main(base + ["--split-sentences", "--lang", "klingon"])
    assert "no Punkt model" in capsys.readouterr().err
    assert preprocess_data.main(base + ["--append-eod"]) == 1
    assert "no end-of-document token" in capsys.readouterr().err
    assert preprocess_data.main(base + ["--split-sentences", "--lang", "german"]) == 0
