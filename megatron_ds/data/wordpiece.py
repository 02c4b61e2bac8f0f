"""BERT WordPiece tokenizers (`--tokenizer-type BertWordPieceLowerCase | BertWordPieceCase`).

Megatron-DeepSpeed's `_BertWordPieceTokenizer` (megatron/tokenizer/tokenizer.py) wraps Google's
`FullTokenizer` (megatron/tokenizer/bert_tokenization.py): BasicTokenizer (clean control characters,
space out CJK ideographs, split on whitespace, lower-case and strip accents when lower-casing,
split off punctuation) then greedy longest-match WordPiece with `##` continuations, `[UNK]` for
words it cannot cover or longer than 200 characters. Here the same pipeline runs in HF tokenizers
(BertNormalizer + BertPreTokenizer + WordPiece), which tests/data/test_bert_tokenizer.py checks
against a transcription of Google's code on varied text.

Ids follow Megatron: the vocabulary file's line numbers, then `[BOS]` and `[EOS]` appended when the
file lacks them, then `--vocab-extra-ids N` sentinels `<extra_id_0>`.. `<extra_id_{N-1}>` (T5).
Special tokens are never recognised inside text (Google's tokenizer splits "[CLS]" into "[", "cl",
"##s", "]" as well): they only enter samples through the datasets.
"""
from __future__ import annotations

import regex

from megatron_ds.data.tokenizer_base import AbstractTokenizer, TokenizerError, clean_text

# Where HF's BertNormalizer differs from Google's BasicTokenizer, the text is adjusted first
# (`_prepare`; only non-ASCII text can be affected; tests/data/test_bert_tokenizer.py covers each):
# - its CJK table starts a block at 0x2B920 where Google's has 0x2B820: space those ideographs out;
# - it drops private-use characters (category Co) as control characters, Google keeps them inside
#   the word, which then matches no WordPiece and becomes [UNK]: replace them by a letter that no
#   vocabulary token contains (a Yi syllable: no case, no decomposition), so that the word becomes
#   [UNK] here too;
# - it lower-cases character by character, where Python's str.lower() gives a word-final capital
#   sigma its final form: such text is lower-cased by Python first.
_CJK_GAP = regex.compile("([\U0002B820-\U0002B91F])")
_UNMATCHABLE = regex.compile(r"\p{Co}")
_FILLER_CANDIDATES = range(0xA000, 0xA48D)
_CAPITAL_SIGMA = "\u03a3"


def load_vocab(vocab_file) -> dict[str, int]:
    """bert_tokenization.load_vocab: token = the stripped line, id = the line number (a repeated
    token keeps its last line's number, so ids may have gaps, as upstream)."""
    vocab: dict[str, int] = {}
    try:
        with open(vocab_file, encoding="utf-8") as f:
            for index, line in enumerate(f):
                vocab[line.strip()] = index
    except UnicodeDecodeError:
        raise TokenizerError(f"--vocab-file {vocab_file} is not UTF-8 text; a BERT vocab.txt has one token a "
                             "line") from None
    if not vocab:
        raise TokenizerError(f"--vocab-file {vocab_file} is empty")
    return vocab


class BertWordPieceTokenizer(AbstractTokenizer):
    """Megatron's BERT tokenizer on HF tokenizers. `cls sep pad mask` are the vocabulary's
    `[CLS] [SEP] [PAD] [MASK]`; `bos_token_id`/`eos_token_id` `[BOS]`/`[EOS]`;
    `additional_special_tokens_ids` the T5 sentinels. There is no end-of-document token (upstream
    has none either): BERT/T5 data marks documents in the index, not with a token."""

    def __init__(self, vocab_file, lower_case: bool = True, vocab_extra_ids: int = 0):
        from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

        self.name = "BertWordPieceLowerCase" if lower_case else "BertWordPieceCase"
        self.lower_case = lower_case
        self._vocab = load_vocab(vocab_file)
        missing = [t for t in ("[CLS]", "[SEP]", "[PAD]", "[MASK]", "[UNK]") if t not in self._vocab]
        if missing:
            raise TokenizerError(f"--vocab-file {vocab_file} lacks {', '.join(missing)}; "
                                 f"{self.name} needs a BERT vocab.txt")
        self._inv_vocab = {i: t for t, i in self._vocab.items()}
        self._filler = _filler_for(self._vocab)
        # Only the file's tokens take part in WordPiece matching (as upstream, where the added
        # tokens can never match because BasicTokenizer has split their brackets off already).
        model = models.WordPiece(vocab=dict(self._vocab), unk_token="[UNK]", max_input_chars_per_word=200)
        tok = Tokenizer(model)
        tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True,
                                                    strip_accents=lower_case, lowercase=lower_case)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        self._tok = tok
        self.cls, self.sep = self._vocab["[CLS]"], self._vocab["[SEP]"]
        self.pad, self.mask = self._vocab["[PAD]"], self._vocab["[MASK]"]
        self.bos_token, self.eos_token = "[BOS]", "[EOS]"
        self.bos_token_id = self._add_token(self.bos_token)
        self.eos_token_id = self._add_token(self.eos_token)
        self.additional_special_tokens = [f"<extra_id_{i}>" for i in range(int(vocab_extra_ids))]
        self.additional_special_tokens_ids = [self._add_token(t) for t in self.additional_special_tokens]

    def _add_token(self, token: str) -> int:
        # Megatron's add_token: a new id = the current vocabulary size (len(vocab)).
        if token not in self._vocab:
            new_id = len(self._vocab)
            self._vocab[token], self._inv_vocab[new_id] = new_id, token
        return self._vocab[token]

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)  # upstream: FullTokenizer.vocab_size() = len(vocab), added tokens included

    @property
    def vocab(self) -> dict:
        return self._vocab

    @property
    def inv_vocab(self) -> dict:
        return self._inv_vocab

    @property
    def eod(self):
        raise TokenizerError(f"{self.name} has no end-of-document token (BERT/T5 data delimits documents in the "
                             "index); drop --append-eod")

    def _prepare(self, text: str) -> str:
        if text.isascii():
            return text
        if self.lower_case and _CAPITAL_SIGMA in text:
            text = text.lower()
        text = _CJK_GAP.sub(r" \1 ", text)
        if self._filler is not None:
            text = _UNMATCHABLE.sub(self._filler, text)
        return text

    def tokenize(self, text: str) -> list[int]:
        return self.tokenize_batch([text])[0]

    def tokenize_batch(self, texts) -> list[list[int]]:
        texts = [self._prepare(t) for t in texts]
        try:
            encs = self._tok.encode_batch(texts, add_special_tokens=False)
        except (UnicodeEncodeError, TypeError):  # lone surrogates cannot cross into Rust
            encs = self._tok.encode_batch([clean_text(t) for t in texts], add_special_tokens=False)
        return [e.ids for e in encs]

    def convert_ids_to_tokens(self, ids) -> list[str]:
        return [self._inv_vocab[int(i)] for i in ids]

    def detokenize(self, ids) -> str:
        """Megatron's decode: tokens joined by spaces, `##` continuations glued, then Google's
        clean-up of spaces before punctuation and contractions (convert_tokens_to_string)."""
        text = " ".join(self.convert_ids_to_tokens(ids)).replace(" ##", "").strip()
        for old, new in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                         (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
            text = text.replace(old, new)
        return text

    decode = detokenize


def _filler_for(vocab) -> str | None:
    """A letter in no vocabulary token (None when the vocabulary itself holds private-use
    characters: then they are dropped, as HF does)."""
    chars = set("".join(vocab))
    if any(_UNMATCHABLE.match(c) for c in chars):
        return None
    return next((chr(c) for c in _FILLER_CANDIDATES if chr(c) not in chars), None)
