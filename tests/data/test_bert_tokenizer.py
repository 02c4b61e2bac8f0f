"""BertWordPieceLowerCase / BertWordPieceCase (HF tokenizers) equal Megatron-DeepSpeed's own BERT tokenizer
(megatron/tokenizer/bert_tokenization.py FullTokenizer, transcribed in tests/data/bert_tokenization_reference.py)
on the same vocabulary, and carry _BertWordPieceTokenizer's special ids (megatron/tokenizer/tokenizer.py)."""
from __future__ import annotations

import random

import pytest

from megatron_ds.data.tokenizer import TokenizerError, build_tokenizer
from tests.data import bert_tokenization_reference as ref
from megatron_ds.cli import train_tokenizer

# Characters chosen for the places where tokenizers differ: accents and their combining forms,
# case mappings that change length (İ, ß), Greek with the final sigma, CJK ideographs (incl. the
# 0x2B820 block HF's table lacks, and compatibility ideographs), Hangul syllables (decomposed by
# NFD), Japanese kana, Unicode and ASCII punctuation, symbols, emoji, whitespace of several kinds,
# control and format characters (dropped), private-use and unassigned ones (kept by Google's code).
_POOL = (list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789") * 4
         + list("éèêëÉÀàçÇñÑöÖüÜøÅåæœßİıŁłŞşĞğ") + ["e\u0301", "a\u0308"]
         + list("ΑΒΓΣσςαβγΩωΆάΌό") + list("一二三中国語日本東京") + ["\U0002B820", "\U0002B8FF", "\uF900", "\U00020000"]
         + list("한국어안녕하세요") + list("ひらがなカタカナ")
         + list(".,;:!?'\"()[]{}<>-_/\\@#$%^&*+=~`|") + list("¿¡«»“”‘’—–…·•§¶") + list("€£¥©®™°±×÷")
         + ["😀", "👍🏽", "ﬁ", "Ǆ", "Ⅻ", "①"]
         + [" "] * 12 + ["\t", "\n", "\r", "\u3000", "\xa0", "\u2028", "\u2009"]
         + ["\x00", "\x0b", "\x0c", "\x1f", "\x85", "\u200b", "\xad", "\ufeff", "\ufffd"]
         + ["\ue000", "\U000F0001", "\u0378", "\U0001FFFE"])


def _texts(n, seed, max_len=60):
    rng = random.Random(seed)
    texts = ["", "   ", "Hello, World! It's a test-case: ÉCOLE été café naïve résumé.",
             "The quick brown fox. unaffable UNAFFABLE Unaffable", "ΣΟΦΟΣ σοφός ΟΔΥΣΣΕΥΣ Σ", "İstanbul STRASSE Straße",
             "日本語のテキスト、中国语文本。한국어 텍스트", "[CLS] [SEP] [MASK] [PAD] <extra_id_0> [BOS]",
             "x" * 201, "y" * 200, "mixed" + "\ue000" + "word and \u0378 here", "a\u200bb c\xadd e\x00f",
             "tabs\tand\nnewlines\r\nand\u3000ideographic\xa0spaces"]
    for _ in range(n):
        texts.append("".join(rng.choice(_POOL) for _ in range(rng.randint(1, max_len))))
    return texts


@pytest.fixture(scope="module", params=[True, False], ids=["lowercase", "cased"])
def vocab(request, tmp_path_factory):
    """A WordPiece vocab.txt trained on text like the test's (tools/train_tokenizer.py --type wordpiece)."""
    lower = request.param
    out = tmp_path_factory.mktemp("wp")
    corpus = out / "corpus.jsonl"
    import json

    with open(corpus, "w", encoding="utf-8") as f:
        for t in _texts(400, seed=5, max_len=200):
            f.write(json.dumps({"text": t}) + "\n")
    argv = ["--input", str(corpus), "--type", "wordpiece", "--vocab-size", "600", "--output-dir", str(out),
            "--min-frequency", "1"]
    assert train_tokenizer.main(argv + ([] if lower else ["--cased"])) == 0
    return lower, str(out / "vocab.txt")


def test_ids_equal_megatron_tokenizer(vocab):
    lower, path = vocab
    ours = build_tokenizer("BertWordPieceLowerCase" if lower else "BertWordPieceCase", vocab_file=path, log=None)
    theirs = ref.FullTokenizer(path, do_lower_case=lower)
    texts = _texts(600, seed=11)
    got = ours.tokenize_batch(texts)
    for text, ids in zip(texts, got):
        want = theirs.convert_tokens_to_ids(theirs.tokenize(text))
        assert ids == want, (text, ids, want)
        assert ours.tokenize(text) == want
    # the texts exercise the interesting paths: unknown words and continuation pieces both occur
    flat = [i for ids in got for i in ids]
    assert ours.vocab["[UNK]"] in flat and any(ours.inv_vocab[i].startswith("##") for i in flat)


def test_special_and_extra_ids(vocab):
    lower, path = vocab
    file_vocab = ref.load_vocab(path)
    tok = build_tokenizer("BertWordPieceLowerCase", vocab_file=path, vocab_extra_ids=3, log=None)
    n = len(file_vocab)
    # _BertWordPieceTokenizer: [CLS]/[SEP]/[PAD]/[MASK] from the file, then [BOS], [EOS], <extra_id_k> appended
    assert (tok.cls, tok.sep, tok.pad, tok.mask) == tuple(file_vocab[t] for t in ("[CLS]", "[SEP]", "[PAD]", "[MASK]"))
    assert (tok.bos_token_id, tok.eos_token_id) == (n, n + 1)
    assert tok.additional_special_tokens_ids == [n + 2, n + 3, n + 4]
    assert tok.inv_vocab[n + 2] == "<extra_id_0>" and tok.vocab_size == n + 5
    assert list(tok.inv_vocab)[:n] == sorted(file_vocab.values())  # random replacements draw from this order
    # special-token strings in text are split like any other text, as upstream
    theirs = ref.FullTokenizer(path, do_lower_case=True)
    assert tok.tokenize("[CLS] <extra_id_0>") == theirs.convert_tokens_to_ids(theirs.tokenize("[CLS] <extra_id_0>"))
    with pytest.raises(TokenizerError, match="no end-of-document token"):
        tok.eod  # noqa: B018


def test_detokenize_follows_megatron(vocab):
    lower, path = vocab
    tok = build_tokenizer("BertWordPieceLowerCase" if lower else "BertWordPieceCase", vocab_file=path, log=None)
    ids = tok.tokenize("Hello , world . It 's here !")
    tokens = [tok.inv_vocab[i] for i in ids]
    # FullTokenizer.convert_tokens_to_string: join, glue ## pieces, tidy spaces before punctuation
    text = " ".join(tokens).replace(" ##", "").strip()
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
                 (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    assert tok.detokenize(ids) == text


def test_bad_vocab_files(tmp_path):
    path = tmp_path / "vocab.txt"
    path.write_text("a\nb\n[UNK]\n")
    with pytest.raises(TokenizerError, match=r"lacks \[CLS\], \[SEP\], \[PAD\], \[MASK\]"):
        build_tokenizer("BertWordPieceCase", vocab_file=str(path), log=None)
    with pytest.raises(TokenizerError, match="needs --vocab-file"):
        build_tokenizer("BertWordPieceCase", log=None)
