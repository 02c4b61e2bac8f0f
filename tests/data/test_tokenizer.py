"""Tokenizers: the native GPT-2 encoders against the pure-Python reference BPE (and HF transformers
when the real GPT-2 files are present), Megatron's EOD conventions, and clear errors."""
import importlib
import json
import random
from pathlib import Path

import pytest

from megatron_ds.data.bpe_reference import ReferenceBPE
from megatron_ds.data.tokenizer import (
    GPT2BPETokenizer,
    TokenizerError,
    build_tokenizer,
    clean_text,
)

ROOT = Path(__file__).resolve().parents[2]
GPT2_DIR = ROOT / ".." / "shared" / "data" / "gpt2"
GPT2_VOCAB, GPT2_MERGES = GPT2_DIR / "gpt2-vocab.json", GPT2_DIR / "gpt2-merges.txt"
needs_gpt2 = pytest.mark.skipif(not (GPT2_VOCAB.is_file() and GPT2_MERGES.is_file()),
                                reason="GPT-2 vocab/merges not found in ../shared/data/gpt2")

VARIED = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces and trailing spaces   ",
    "trailing newline\n",
    "trailing newlines\n\n\n",
    "a\n\n\nb",
    "word   \n  \n\tnext",
    "tabs\tand\t\tdouble\t tab-space",
    "\r\nwindows\r\nline endings\r\n",
    "I'm sure you're right, they've said we'll go, he'd know, it's fine, don't.",
    "CAPITAL 'S 'T 'RE 'VE 'M 'LL 'D and 'x 'quoted'",
    "日本語のテキストです。東京都は日本の首都です。",
    "カタカナとひらがな、漢字。　全角スペース",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flags 🇯🇵 ✨",
    "def f(x):\n    return x ** 2  # square\n\n\nclass A:\n\tpass\n",
    'if (a && b) { printf("%d\\n", a[i]); } // C code',
    "{\"json\": [1, 2.5, -3e10, null, true]}",
    "numbers 123 4567 3.14159 1,000,000 ５６７ ٣٤٥",
    "Ünïcödé ÀÉÎÕÜ ß straße façade naïve coöperate",
    "combining e\u0301 a\u0308 n\u0303 and zero\u200bwidth\u200djoiner",
    "\u00a0nbsp\u2009thin space\u3000ideographic\u2028line sep",
    "русский текст, ελληνικά, עברית, العربية, हिन्दी",
    "Ω≈ç√∫˜µ≤≥÷ ∀x∈ℝ: x²≥0 → ⊤",
    "<|endoftext|> inside text is just text",
    "   ",
    "\n",
    "",
    "x",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa " * 3,
    "URL https://example.com/path?q=1&r=two#frag and mail a.b@c.org",
    "mixed123abc456 _under_score__ CamelCaseWord snake_case",
    "\x00\x01\x02 control \x1b[31m ansi \x7f del",
]

_POOL = (
    list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
    + list(" \t\n\r\u00a0\u3000\u2009") * 4
    + list("'''\".,;:!?-_()[]{}<>/\\@#$%^&*+=|~`")
    + list("日本語東京かなカナ한국어中文ñéüßøå€£¥©®™")
    + ["😀", "👍🏽", "👨‍👩‍👧", "\u0301", "\u200d", "'s", "'ll", "'re", "  ", "\n\n"]
)


def fuzz_texts(n, seed):
    rng = random.Random(seed)
    return ["".join(rng.choice(_POOL) for _ in range(rng.randrange(1, 60))) for _ in range(n)]


def _tool(name):
    return importlib.import_module(f"megatron_ds.cli.{name}")  # the body of tools/<name>.py


def training_corpus(path, n_docs=400, seed=0):
    """A small JSONL corpus of varied text for training throwaway tokenizers."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n_docs):
            parts = rng.sample(VARIED, 6) + fuzz_texts(2, rng.randrange(10**6))
            f.write(json.dumps({"text": " ".join(parts)}) + "\n")
    return path


@pytest.fixture(scope="module")
def small_bpe(tmp_path_factory):
    d = tmp_path_factory.mktemp("bpe")
    corpus = training_corpus(d / "corpus.jsonl")
    assert _tool("train_tokenizer").main(["--input", str(corpus), "--vocab-size", "700",
                                          "--output-dir", str(d / "tok")]) == 0
    return str(d / "tok" / "vocab.json"), str(d / "tok" / "merges.txt")


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("sp")
    corpus = training_corpus(d / "corpus.jsonl")
    assert _tool("train_tokenizer").main(["--input", str(corpus), "--type", "sentencepiece", "--vocab-size", "300",
                                          "--output-dir", str(d / "sp")]) == 0
    return str(d / "sp" / "tokenizer.model")


def _assert_same_as_reference(vocab, merges, backend, texts):
    fast = GPT2BPETokenizer(vocab, merges, backend=backend)
    ref = ReferenceBPE(vocab, merges)
    assert fast.backend == backend
    for text in texts:
        expected = ref.encode(clean_text(text))
        assert fast.tokenize(text) == expected, repr(text)
    assert fast.tokenize_batch(texts) == [ref.encode(clean_text(t)) for t in texts]


@pytest.mark.parametrize("backend", ["tiktoken", "tokenizers"])
def test_trained_bpe_matches_reference(small_bpe, backend):
    _assert_same_as_reference(*small_bpe, backend, VARIED + fuzz_texts(300, seed=1))


@needs_gpt2
@pytest.mark.parametrize("backend", ["tiktoken", "tokenizers"])
def test_gpt2_matches_reference(backend):
    _assert_same_as_reference(str(GPT2_VOCAB), str(GPT2_MERGES), backend, VARIED + fuzz_texts(300, seed=2))


@needs_gpt2
def test_gpt2_matches_hf_transformers():
    transformers = pytest.importorskip("transformers")
    vocab = json.loads(GPT2_VOCAB.read_text(encoding="utf-8"))
    merges = [tuple(line.split(" ")) for line in GPT2_MERGES.read_text(encoding="utf-8").splitlines()
              if line and not line.startswith("#version")]
    hf = transformers.GPT2TokenizerFast(vocab=vocab, merges=merges)
    ours = build_tokenizer("GPT2BPETokenizer", vocab_file=str(GPT2_VOCAB), merge_file=str(GPT2_MERGES), log=None)
    assert ours.vocab_size == 50257 and ours.eod == 50256 == hf.eos_token_id
    # transformers turns "<|endoftext|>" in text into the special id; Megatron (and we) do not.
    texts = [t for t in VARIED + fuzz_texts(100, seed=3) if "<|endoftext|>" not in t]
    for text in texts:
        assert ours.tokenize(text) == hf(text)["input_ids"], repr(text)
    assert ours.tokenize("Hello world") == [15496, 995]  # GPT-2's published ids


@pytest.mark.parametrize("backend", ["tiktoken", "tokenizers"])
def test_bpe_round_trip_and_eod(small_bpe, backend):
    tok = GPT2BPETokenizer(*small_bpe, backend=backend)
    assert tok.eod == tok.vocab["<|endoftext|>"] == tok.vocab_size - 1
    for text in VARIED:
        assert tok.detokenize(tok.tokenize(text)) == text
    assert tok.tokenize("<|endoftext|>") != [tok.eod]  # text, not the special token
    assert tok.detokenize([tok.eod]) == "<|endoftext|>"


def test_lone_surrogates_become_replacement_char(small_bpe):
    tok = GPT2BPETokenizer(*small_bpe)
    assert tok.tokenize("a\ud800b") == tok.tokenize("a\ufffdb")
    assert tok.tokenize_batch(["x", "a\udfffb"])[1] == tok.tokenize("a\ufffdb")


def test_sentencepiece_megatron_conventions(sp_model):
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=sp_model)
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=sp_model, log=None)
    n = sp.get_piece_size()
    # Megatron appends <CLS> <SEP> <EOD> <MASK> after the model's pieces (and <PAD>: no pad piece).
    assert [tok.vocab[t] for t in ("<CLS>", "<SEP>", "<EOD>", "<MASK>", "<PAD>")] == [n, n + 1, n + 2, n + 3, n + 4]
    assert tok.eod == n + 2 and tok.vocab_size == n + 5
    assert tok.vocab["<s>"] == sp.bos_id() and tok.vocab["</s>"] == sp.eos_id()
    text = "hello world"
    assert tok.tokenize(text) == sp.encode(text)
    assert tok.tokenize(f"{text}<EOD>{text}") == sp.encode(text) + [tok.eod] + sp.encode(text)
    texts = ["plain text", "with <SEP> special", "", "日本語"]
    assert tok.tokenize_batch(texts) == [tok.tokenize(t) for t in texts]
    assert tok.detokenize(tok.tokenize(text)) == text
    # BERT/T5 data ids (megatron/tokenizer/tokenizer.py _SentencePieceTokenizer): --vocab-extra-ids sentinels
    # follow the specials, and like them are recognised in text
    t5 = build_tokenizer("SentencePieceTokenizer", tokenizer_model=sp_model, vocab_extra_ids=2, log=None)
    assert (t5.cls, t5.sep, t5.mask, t5.pad) == (n, n + 1, n + 3, n + 4)
    assert (t5.bos_token_id, t5.eos_token_id) == (sp.bos_id(), sp.eos_id())
    assert t5.additional_special_tokens_ids == [n + 5, n + 6] and t5.vocab_size == n + 7
    assert t5.tokenize(f"{text}<extra_id_1>") == sp.encode(text) + [n + 6]


def test_gpt_sentencepiece_uses_eos(sp_model):
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=sp_model)
    tok = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=sp_model, log=None)
    assert tok.eod == sp.eos_id() and tok.vocab_size == sp.get_piece_size()
    assert tok.tokenize("a <EOD> b") == sp.encode("a <EOD> b")


def test_hf_tokenizer_from_local_file_and_directory(small_bpe, tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    hf = Tokenizer(models.BPE.from_file(*small_bpe))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens(["<|endoftext|>"])
    hf.save(str(tmp_path / "tokenizer.json"))
    ref = ReferenceBPE(*small_bpe)
    for spec in (tmp_path, tmp_path / "tokenizer.json"):
        tok = build_tokenizer("HFTokenizer", tokenizer_model=str(spec), log=None)
        assert tok.eod == tok.vocab["<|endoftext|>"]
        assert tok.tokenize_batch(VARIED[:10]) == [ref.encode(t) for t in VARIED[:10]]
        assert tok.detokenize(tok.tokenize(VARIED[11])) == VARIED[11]
    # An explicit eos in tokenizer_config.json wins over the built-in guesses.
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "a"}}))
    assert build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path), log=None).eod == ref.encoder["a"]


def test_null_tokenizer():
    tok = build_tokenizer("NullTokenizer", vocab_size=100, log=None)
    assert tok.eod == 100 and tok.vocab_size == 101
    assert tok.tokenize("1 2  99") == [1, 2, 99]
    assert tok.tokenize_batch(["5", ""]) == [[5], []]
    assert tok.detokenize([3, 4]) == "3 4"
    with pytest.raises(TokenizerError, match="space-separated integers"):
        tok.tokenize("1 two")


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(tokenizer_type="GPT2Tokenizer"), "valid types: GPT2BPETokenizer, SentencePieceTokenizer"),
        (dict(tokenizer_type="BertWordPieceLowerCase"), "needs --vocab-file"),
        (dict(tokenizer_type="GPT2BPETokenizer", vocab_extra_ids=100), "--vocab-extra-ids is supported with the Bert"),
        (dict(tokenizer_type="GPT2BPETokenizer"), "needs --vocab-file"),
        (dict(tokenizer_type="GPT2BPETokenizer", vocab_file="nope.json", merge_file="nope.txt"),
         "nope.json does not exist"),
        (dict(tokenizer_type="SentencePieceTokenizer"), "needs --tokenizer-model"),
        (dict(tokenizer_type="HFTokenizer", tokenizer_model="gpt2"), "never downloads"),
        (dict(tokenizer_type="NullTokenizer"), "needs --vocab-size"),
    ],
)
def test_build_errors_are_clear(kwargs, message):
    with pytest.raises(TokenizerError, match=message):
        build_tokenizer(**kwargs, log=None)


def test_vocab_and_merges_that_are_not_what_they_claim(small_bpe, tmp_path):
    """A --vocab-file that is not JSON, the two files swapped, a merges file that is a vocabulary,
    a broken tokenizer.json: one TokenizerError naming the file and what was expected."""
    vocab, merges = small_bpe
    garbage = tmp_path / "garbage.bin"
    garbage.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
    listing = tmp_path / "list.json"
    listing.write_text("[1, 2, 3]")
    cases = [((merges, vocab), rf"--vocab-file {merges} is not JSON; expected GPT-2's vocab.json, a JSON object of "
                               rf"token -> id \(are --vocab-file and --merge-file swapped\? \(it looks like a merges"),
             ((garbage, merges), rf"--vocab-file {garbage} is not JSON; .* \(UnicodeDecodeError\)"),
             ((listing, merges), rf"--vocab-file {listing} is JSON but not a vocabulary"),
             ((vocab, vocab), rf"--merge-file {vocab} is JSON; expected GPT-2's merges.txt, .* swapped\?"),
             ((vocab, garbage), rf"--merge-file {garbage} is not a merges.txt")]
    for (v, m), message in cases:
        with pytest.raises(TokenizerError, match=message):
            build_tokenizer("GPT2BPETokenizer", vocab_file=str(v), merge_file=str(m), log=None)
    with pytest.raises(TokenizerError, match=rf"--tokenizer-model {garbage} is not a tokenizers tokenizer.json"):
        build_tokenizer("HFTokenizer", tokenizer_model=str(garbage), log=None)


def test_swapped_vocab_files_in_dry_run_are_one_line(small_bpe, capsys):
    from megatron_ds.families import main

    vocab, merges = small_bpe
    rc = main(("--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 16 --micro-batch-size 2 "
               "--train-iters 10 --lr 1e-3 --mock-data --dry-run --world-size 1").split()
              + ["--vocab-file", merges, "--merge-file", vocab])
    err = capsys.readouterr().err
    assert rc == 1
    assert err.startswith(f"error: --vocab-file {merges} is not JSON") and len(err.strip().splitlines()) == 1, err
