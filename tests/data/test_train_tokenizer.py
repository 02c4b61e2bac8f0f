"""tools/train_tokenizer.py: GPT-2-layout BPE files and SentencePiece models usable by our tokenizers."""
import importlib
import json
from pathlib import Path

import pytest

from megatron_ds.data.bpe_reference import ReferenceBPE, bytes_to_unicode, read_merges
from megatron_ds.data.tokenizer import build_tokenizer
from tests.data.test_tokenizer import VARIED, fuzz_texts, training_corpus

ROOT = Path(__file__).resolve().parents[2]
train_tokenizer = importlib.import_module("megatron_ds.cli.train_tokenizer")


def test_bpe_files_have_gpt2_layout(tmp_path):
    corpus = training_corpus(tmp_path / "c.jsonl")
    assert train_tokenizer.main(["--input", str(corpus), "--vocab-size", "512",
                                 "--output-dir", str(tmp_path / "t")]) == 0
    vocab = json.loads((tmp_path / "t" / "vocab.json").read_text(encoding="utf-8"))
    merges = read_merges(tmp_path / "t" / "merges.txt")
    assert (tmp_path / "t" / "merges.txt").read_text(encoding="utf-8").startswith("#version: 0.2\n")
    assert len(vocab) == 512 and vocab["<|endoftext|>"] == 511
    # GPT-2's layout, spelled out: the 256 byte symbols in character order, then one per merge.
    assert [vocab[c] for c in sorted(bytes_to_unicode().values())] == list(range(256))
    assert [vocab[a + b] for a, b in merges] == list(range(256, 511))
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "t" / "vocab.json"),
                          merge_file=str(tmp_path / "t" / "merges.txt"), log=None)
    assert tok.backend == "tiktoken"  # the layout admits the fast backend
    ref = ReferenceBPE(tmp_path / "t" / "vocab.json", tmp_path / "t" / "merges.txt")
    held_out = fuzz_texts(50, seed=77)
    assert tok.tokenize_batch(held_out) == [ref.encode(t) for t in held_out]
    assert tok.detokenize(tok.tokenize(VARIED[12])) == VARIED[12]
    # The merges are used: a sentence from the training distribution takes fewer tokens than
    # bytes (with no merges applied it would take exactly one token per byte).
    assert len(tok.tokenize(VARIED[1])) < len(VARIED[1].encode())


def test_sentencepiece_model(tmp_path):
    corpus = training_corpus(tmp_path / "c.jsonl")
    assert train_tokenizer.main(["--input", str(corpus), "--type", "sentencepiece", "--vocab-size", "400",
                                 "--model-type", "unigram", "--output-dir", str(tmp_path / "sp")]) == 0
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(tmp_path / "sp" / "tokenizer.model"), log=None)
    text = "The quick brown fox jumps over the lazy dog."
    assert tok.detokenize(tok.tokenize(text)) == text
    assert tok.eod == tok.vocab["<EOD>"]


def test_vocab_too_small(tmp_path, capsys):
    with pytest.raises(SystemExit):
        train_tokenizer.main(["--input", "x.jsonl", "--vocab-size", "100", "--output-dir", str(tmp_path)])
    assert "too small" in capsys.readouterr().err
    assert train_tokenizer.main(["--input", str(tmp_path / "none.jsonl"), "--vocab-size", "300",
                                 "--output-dir", str(tmp_path)]) == 1


@pytest.mark.parametrize("kind", ["bpe", "sentencepiece"])
def test_a_vocabulary_smaller_than_asked_is_reported(tmp_path, capsys, kind):
    """Four short lines cannot give 5000 tokens: the trained size is said, and it is the files' size."""
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["hello world", "hello there", "the world",
                                                                      "there and back"]))
    assert train_tokenizer.main(["--input", str(corpus), "--type", kind, "--vocab-size", "5000",
                                 "--output-dir", str(tmp_path / "t")]) == 0
    if kind == "bpe":
        size = len(json.loads((tmp_path / "t" / "vocab.json").read_text(encoding="utf-8")))
    else:
        size = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=str(tmp_path / "t" / "tokenizer.model"),
                               log=None).vocab_size
    assert size < 5000
    assert f"WARNING: the trained vocabulary has {size} tokens, fewer than --vocab-size 5000" in capsys.readouterr().err
