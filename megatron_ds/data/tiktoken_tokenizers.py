"""tiktoken-file tokenizers: Megatron-LM's TikTokenizer and Meta's Llama 3 tokenizer (Llama3Tokenizer).

Both read their rank files here (no tiktoken registry, no download) and encode with a
``tiktoken.Encoding`` built from those ranks. Special-token strings inside the text become their
ids (``allowed_special="all"``), as both upstreams' tokenize does.
"""
from __future__ import annotations

import base64
import binascii
import json
import os
import re

from megatron_ds.data.tokenizer_base import AbstractTokenizer, TokenizerError, clean_text

# Megatron-LM core_v0.19.0, megatron/core/tokenizers/text/libraries/tiktoken_tokenizer.py
# (_PATTERN_TIKTOKEN_V1/_V2, DEFAULT_TIKTOKEN_MAX_VOCAB, SPECIAL_TOKENS, SPECIAL_TOKEN_TEMPLATE).
TIKTOKEN_PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+|[^\\r\\n\\p{L}\\p{N}]?"
          "[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|"
          "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
}
TIKTOKEN_DEFAULT_VOCAB = 2**17
TIKTOKEN_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>")
# --tiktoken-num-special-tokens' default (megatron/training/config/training_config.py)
TIKTOKEN_NUM_SPECIAL_TOKENS = 1000

# Meta's llama3 repository, llama/tokenizer.py (Tokenizer.pat_str, num_reserved_special_tokens and
# the special-token list; ids follow the ranks: <|begin_of_text|> = 128000 in the released file).
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                  r"\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPECIAL_TOKENS = (
    "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
    "<|reserved_special_token_2|>", "<|reserved_special_token_3|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|reserved_special_token_4|>", "<|eot_id|>",
    *(f"<|reserved_special_token_{i}|>" for i in range(5, 256 - 5)))


class _TiktokenFile(AbstractTokenizer):
    """What both share: ``_enc`` (tiktoken.Encoding), ``_specials`` (token -> id), ``_ranks``
    (bytes -> id), ``pattern``, ``_eod``, ``bos``."""

    def _build(self, name, ranks: dict, specials: dict, pattern: str):
        import tiktoken

        self._ranks, self._specials, self.pattern = ranks, specials, pattern
        self._enc = tiktoken.Encoding(name, pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials)
        # The core's encode with allowed_special="all" spelled as its set: what Encoding.encode calls,
        # without rebuilding the set and a thread pool (encode_batch) for every text.
        self._allowed = frozenset(specials)
        core = getattr(self._enc, "_core_bpe", None)
        self._core_encode = core.encode if hasattr(core, "encode") else \
            (lambda text, allowed: self._enc.encode(text, allowed_special=allowed))

    @property
    def eod(self):
        return self._eod

    def _encode_one(self, text):
        try:
            return self._core_encode(text, self._allowed)
        except UnicodeEncodeError:  # lone surrogates
            return self._core_encode(clean_text(text), self._allowed)

    def _encode(self, texts):
        return [self._encode_one(t) for t in texts]

    def tokenize(self, text):
        return self.tokenize_batch([text])[0]

    def detokenize(self, ids):
        return self._enc.decode([int(i) for i in ids], errors="replace")

    @property
    def vocab(self):
        """Token -> id, each token's bytes spelled as GPT-2's byte-level BPE spells them (unique,
        unlike a UTF-8 decoding of partial characters; tokenizer.json's vocabulary)."""
        from megatron_ds.data.bpe_reference import bytes_to_unicode

        spell = bytes_to_unicode()
        vocab = {"".join(spell[b] for b in t): i for t, i in self._ranks.items()}
        vocab.update(self._specials)
        return vocab

    @property
    def inv_vocab(self):
        return {i: t for t, i in self.vocab.items()}

    def hf_tokenizer_object(self):
        """The same tokenizer as a ``tokenizers.Tokenizer`` (byte-level BPE whose merges are read
        off the ranks with transformers' TikTokenConverter, the conversion transformers itself uses
        for tiktoken files), special tokens at their ids."""
        from transformers.convert_slow_tokenizer import TikTokenConverter

        ranks = self._ranks
        converter = TikTokenConverter(pattern=self.pattern, extra_special_tokens=list(self._specials))
        converter.load_tiktoken_bpe = lambda _path: ranks
        tok = converter.converted()
        missing = {t: i for t, i in self._specials.items() if tok.token_to_id(t) != i}
        if missing:  # specials before the ranks (TikTokenizer): the converter appended them instead
            from tokenizers import AddedToken, Tokenizer, models

            vocab, merges = converter.extract_vocab_merges_from_model(None)
            vocab.update(self._specials)
            bpe = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, ignore_merges=True))
            bpe.pre_tokenizer, bpe.decoder = tok.pre_tokenizer, tok.decoder
            bpe.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in self._specials])
            tok = bpe
        return tok


def _read_megatron_tiktoken_json(path, max_vocab, offset) -> dict:
    """Megatron-LM's TikTokenizer vocabulary: a JSON list of {"rank", "token_bytes" (base64),
    "token_str"}, rank i at position i, the first 256 the single bytes (``reload_mergeable_ranks``).
    Ids are the rank + ``offset`` (the special tokens come first)."""
    try:
        with open(path, encoding="utf-8") as f:
            entries = json.load(f)
    except (ValueError, UnicodeDecodeError):
        raise TokenizerError(f"--tokenizer-model {path} is not JSON; TikTokenizer reads Megatron-LM's tiktoken "
                             f"vocabulary, a JSON list of {{rank, token_bytes, token_str}}") from None
    if not isinstance(entries, list):
        raise TokenizerError(f"--tokenizer-model {path} is not a JSON list of {{rank, token_bytes, token_str}}")
    ranks = {}
    for i, entry in enumerate(entries[:max_vocab]):
        try:
            token = base64.b64decode(entry["token_bytes"], validate=True)
            ok = entry["rank"] == i and (i >= 256 or token == bytes([i]))
        except (TypeError, KeyError, binascii.Error):
            ok = False
        if not ok:
            raise TokenizerError(f"--tokenizer-model {path}: entry {i} is not {{\"rank\": {i}, \"token_bytes\": "
                                 f"base64}}{' of byte ' + str(i) if i < 256 else ''}")
        ranks[token] = i + offset
    return ranks


class TikTokenizer(_TiktokenFile):
    """Megatron-LM's TikTokenizer (``TikTokenTokenizer``): ids 0..N-1 are the special tokens
    (--tokenizer-special-tokens, default <unk> <s> </s> <mask> <pad> <cls> <sep>, then
    <SPECIAL_i> fillers up to --tiktoken-num-special-tokens N), then the file's ranks shifted by N,
    cut to --vocab-size (default 2**17) minus N. eod is </s>; nothing is added around the text
    (no BOS), as upstream's text_to_ids. (Megatron-LM's legacy CustomTikTokenizer, before
    core/tokenizers, gave the same ids to ordinary text but encoded special-token strings as text,
    required only <unk> <s> </s> and took them as --tiktoken-special-tokens.)"""

    name = "TikTokenizer"

    def __init__(self, path, pattern="v2", num_special_tokens=TIKTOKEN_NUM_SPECIAL_TOKENS, special_tokens=None,
                 vocab_size=None):
        if pattern not in TIKTOKEN_PATTERNS:
            raise TokenizerError(f"--tiktoken-pattern {pattern!r}: expected v1 or v2")
        special_tokens = list(special_tokens or TIKTOKEN_SPECIAL_TOKENS)
        missing = [t for t in TIKTOKEN_SPECIAL_TOKENS if t not in special_tokens]
        if missing or len(set(special_tokens)) != len(special_tokens):
            raise TokenizerError(f"--tokenizer-special-tokens must be unique and include {' '.join(TIKTOKEN_SPECIAL_TOKENS)}"
                                 f" (TikTokenizer's ids){'; missing ' + ' '.join(missing) if missing else ''}")
        vocab_size = int(vocab_size or TIKTOKEN_DEFAULT_VOCAB)
        if not len(special_tokens) <= num_special_tokens < vocab_size:
            raise TokenizerError(f"TikTokenizer needs {len(special_tokens)} special tokens <= "
                                 f"--tiktoken-num-special-tokens {num_special_tokens} < --vocab-size {vocab_size}")
        specials = special_tokens + [f"<SPECIAL_{i}>" for i in range(len(special_tokens), num_special_tokens)]
        ranks = _read_megatron_tiktoken_json(path, vocab_size - num_special_tokens, num_special_tokens)
        if len(ranks) != vocab_size - num_special_tokens:
            raise TokenizerError(f"--tokenizer-model {path} holds {len(ranks)} tokens; --vocab-size {vocab_size} "
                                 f"needs {vocab_size - num_special_tokens} after --tiktoken-num-special-tokens "
                                 f"{num_special_tokens} (pass --vocab-size {len(ranks) + num_special_tokens})")
        self._build(os.path.basename(os.path.dirname(os.path.abspath(path))) or "tiktoken", ranks,
                    {t: i for i, t in enumerate(specials)}, TIKTOKEN_PATTERNS[pattern])
        self._vocab_size = vocab_size
        self._eod, self.bos = specials.index("</s>"), specials.index("<s>")
        self.pad, self.unk = specials.index("<pad>"), specials.index("<unk>")

    @property
    def vocab_size(self):
        return self._vocab_size

    def tokenize_batch(self, texts):
        return self._encode(list(texts))


def read_tiktoken_bpe(path) -> dict:
    """A tiktoken rank file (Meta's Llama 3 ``tokenizer.model``, OpenAI's ``*.tiktoken``): one
    "base64-token rank" pair per line. Read here, as tiktoken.load.load_tiktoken_bpe reads it, but
    with no cache directory and no URL handling."""
    ranks = {}
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except (ValueError, binascii.Error):
                raise TokenizerError(f"--tokenizer-model {path} line {n} is not 'base64-token rank'; Llama3Tokenizer "
                                     f"reads Meta's tiktoken tokenizer.model (a SentencePiece model is "
                                     f"Llama2Tokenizer's, a tokenizer.json HuggingFaceTokenizer's)") from None
    return ranks


class Llama3Tokenizer(_TiktokenFile):
    """Meta's Llama 3 / 3.x tokenizer from its original ``tokenizer.model`` (a tiktoken rank file),
    as Meta's llama3 repository (llama/tokenizer.py) defines it: Llama 3's pattern and 256 special
    tokens after the ranks (<|begin_of_text|> 128000, <|end_of_text|> 128001, <|eot_id|> 128009 in
    the released file). tokenize prepends <|begin_of_text|> (Tokenizer.encode(bos=True), as the
    Llama3Tokenizer of Megatron-LM forks, e.g. HabanaAI's for Intel Gaudi, calls it; Megatron-LM
    itself has no such type); eod is <|end_of_text|>. The type name is those forks'.
    (A Llama 3 tokenizer.json directory is --tokenizer-type HuggingFaceTokenizer.)"""

    name = "Llama3Tokenizer"

    def __init__(self, path):
        ranks = read_tiktoken_bpe(path)
        if sorted(ranks.values()) != list(range(len(ranks))):
            raise TokenizerError(f"--tokenizer-model {path}: the ranks are not 0..{len(ranks) - 1}, each once")
        specials = {t: len(ranks) + i for i, t in enumerate(LLAMA3_SPECIAL_TOKENS)}
        self._build("llama3", ranks, specials, LLAMA3_PATTERN)
        self.bos, self._eod = specials["<|begin_of_text|>"], specials["<|end_of_text|>"]
        self.adds_bos = True

    @property
    def vocab_size(self):
        return len(self._ranks) + len(self._specials)

    def tokenize_batch(self, texts):
        out = []
        for text in texts:
            ids = [self.bos]
            for piece in meta_llama3_pieces(text):
                ids += self._encode_one(piece)
            out.append(ids)
        return out


# Meta's Tokenizer.encode (llama/tokenizer.py) encodes 400,000-character chunks, each cut inside any
# run of whitespace or of non-whitespace longer than 25,000 characters (tiktoken is slow, or
# overflows its stack, on such runs); the cuts change the ids, so they are Meta's here too.
LLAMA3_MAX_ENCODE_CHARS, LLAMA3_MAX_RUN_CHARS = 400_000, 25_000
_RUNS = re.compile(r"\s+|\S+")  # \s is str.isspace's set, the test Meta's _split_whitespaces_or_nonwhitespaces uses


def meta_llama3_pieces(text: str) -> list[str]:
    """The pieces Meta's Llama 3 Tokenizer.encode hands tiktoken one by one (the text itself when
    it is shorter than a run limit, which is nearly always)."""
    if len(text) <= LLAMA3_MAX_RUN_CHARS:
        return [text]
    pieces = []
    for i in range(0, len(text), LLAMA3_MAX_ENCODE_CHARS):
        chunk, start = text[i:i + LLAMA3_MAX_ENCODE_CHARS], 0
        for run in _RUNS.finditer(chunk):  # a cut after every 25,000 characters of one run
            for cut in range(run.start() + LLAMA3_MAX_RUN_CHARS, run.end(), LLAMA3_MAX_RUN_CHARS):
                pieces.append(chunk[start:cut])
                start = cut
        pieces.append(chunk[start:])
    return pieces
