"""Tokenizers selected by `--tokenizer-type`, with Megatron's names, ids and EOD conventions.

Every tokenizer has `.name`, `.vocab_size` (unpadded; padding for tensor parallel is derived by the
config), `.eod`, `.tokenize(text)`, `.tokenize_batch(texts)` (the fast, batched path used by
preprocessing), `.detokenize(ids)` and, where meaningful, `.vocab` / `.inv_vocab`.

Nothing here touches the network: HF tokenizers load from a local `tokenizer.json` only.
(This module is `tokenizer.py`, not `tokenizers/`, so that `import tokenizers` keeps meaning the
HF package everywhere.)
"""
from __future__ import annotations

import json
import os

from megatron_ds.data.tiktoken_tokenizers import TIKTOKEN_NUM_SPECIAL_TOKENS
from megatron_ds.data.tokenizer_base import AbstractTokenizer, TokenizerError, clean_text

VALID_TYPES = (
    "GPT2BPETokenizer",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "Llama2Tokenizer",
    "HFTokenizer",
    "TikTokenizer",
    "Llama3Tokenizer",
    "NullTokenizer",
    "JapaneseSentencePiece",
    "BertWordPieceLowerCase",
    "BertWordPieceCase",
)
# Megatron-LM spells the HF tokenizer type differently from Megatron-DeepSpeed; accept both.
_ALIASES = {"HuggingFaceTokenizer": "HFTokenizer"}


def canonical_tokenizer_type(tokenizer_type: str | None) -> str | None:
    """One name per tokenizer type (both spellings of the HF type are the same tokenizer)."""
    return _ALIASES.get(tokenizer_type, tokenizer_type)


GPT2_VOCAB_SIZE = 50257  # what --mock-data uses without a tokenizer or --vocab-size


class _MappedTokenizer(AbstractTokenizer):
    """A tokenizer holding its vocabulary as dicts (`_vocab`, `_inv_vocab`) and its `_eod` id."""

    @property
    def vocab_size(self):
        return len(self._vocab)

    @property
    def eod(self):
        return self._eod

    @property
    def vocab(self):
        return self._vocab

    @property
    def inv_vocab(self):
        return self._inv_vocab


def _require_file(path, flag, tokenizer_type):
    if not path:
        raise TokenizerError(f"--tokenizer-type {tokenizer_type} needs {flag}")
    if not os.path.isfile(path):
        raise TokenizerError(f"{flag} {path} does not exist (needed by --tokenizer-type {tokenizer_type})")
    return str(path)


# GPT-2's pattern regrouped for speed; it splits text identically. tiktoken's regex engine runs a
# pattern containing a look-ahead on a slow backtracking VM, but hands each look-ahead-free
# sub-expression to a fast automaton. Grouping the first six alternatives makes them one such
# sub-expression (ordered alternation is associative), and `\s+(?!\S)|\s+` equals
# `\s+(?!\S)|\s` because the first branch fails only on a single whitespace character followed by
# a non-space. About 1.8x faster; tests/data/test_tokenizer.py checks ids against the reference.
_FAST_GPT2_PATTERN = r"""(?:'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+)|\s+(?!\S)|\s"""


def _tiktoken_ranks(vocab, merge_file):
    """tiktoken's mergeable ranks for this vocab/merges pair, or None when the pair is not laid out
    like GPT-2's (ids = the 256 bytes in byte-to-unicode order, then one new token per merge in
    merge order). tiktoken merges by the rank of the merged token, which equals following the
    merge list for files with that layout (OpenAI encodes GPT-2 itself this way); for any other
    layout we stay with HF tokenizers, which follows the merge list literally."""
    from megatron_ds.data.bpe_reference import bytes_to_unicode, read_merges

    byte_decoder = {c: b for b, c in bytes_to_unicode().items()}
    to_latin1 = {ord(c): b for c, b in byte_decoder.items()}  # token.translate(...) -> one char per byte
    chars = sorted(byte_decoder)  # GPT-2 numbers the byte tokens in the order of their characters
    ranks = {}
    for rank, ch in enumerate(chars):
        if vocab.get(ch) != rank:
            return None
        ranks[bytes([byte_decoder[ch]])] = rank
    for rank, (left, right) in enumerate(read_merges(merge_file), start=len(chars)):
        token = left + right
        if vocab.get(token) != rank:
            return None
        ranks[token.translate(to_latin1).encode("latin-1")] = rank
    return ranks


_SWAPPED = "are --vocab-file and --merge-file swapped?"


def _read_gpt2_vocab(path) -> dict:
    """vocab.json: one JSON object of token -> id. Anything else is one line naming the file."""
    try:
        with open(path, encoding="utf-8") as f:
            vocab = json.load(f)
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        looks_like_merges = _first_line(path).startswith("#version")
        why = _SWAPPED + " (it looks like a merges.txt)" if looks_like_merges else type(exc).__name__
        raise TokenizerError(f"--vocab-file {path} is not JSON; expected GPT-2's vocab.json, a JSON object of "
                             f"token -> id ({why})") from None
    if not isinstance(vocab, dict) or not all(isinstance(i, int) for i in vocab.values()):
        raise TokenizerError(f"--vocab-file {path} is JSON but not a vocabulary; expected GPT-2's vocab.json, "
                             f"a JSON object of token -> integer id")
    return vocab


def _first_line(path) -> str:
    with open(path, "rb") as f:
        return f.read(4096).decode("utf-8", "replace").lstrip().split("\n", 1)[0].strip()


def _check_merges(path) -> None:
    """merges.txt: an optional '#version' line, then 'left right' pairs (read in full later; the
    first pair is enough to tell a merges file from a vocab.json or some other file)."""
    with open(path, "rb") as f:
        head = f.read(4096).decode("utf-8", "replace").splitlines()
    pairs = [line for line in head[:-1] or head if line and not line.startswith("#version")]
    if head and head[0].lstrip().startswith("{"):
        raise TokenizerError(f"--merge-file {path} is JSON; expected GPT-2's merges.txt, one 'left right' pair "
                             f"per line ({_SWAPPED})")
    if pairs and len(pairs[0].split(" ")) != 2:
        raise TokenizerError(f"--merge-file {path} is not a merges.txt: its first line {pairs[0][:40]!r} is not "
                             f"a 'left right' pair")


class GPT2BPETokenizer(_MappedTokenizer):
    """GPT-2 byte-level BPE from vocab.json + merges.txt, encoded natively.

    backend "tiktoken" (the fastest; used for GPT-2-layout files, see _tiktoken_ranks) or
    "tokenizers" (HF; any vocab/merges). tests/data/test_tokenizer.py proves both give the ids of
    bpe_reference.py. As in Megatron and GPT-2's own encoder, `<|endoftext|>` inside the input text
    is ordinary text, encoded piece by piece; only `eod` is the special id.
    """

    name = "GPT2BPETokenizer"

    def __init__(self, vocab_file, merge_file, backend="auto"):
        self._vocab = _read_gpt2_vocab(vocab_file)
        _check_merges(merge_file)
        if "<|endoftext|>" not in self._vocab:
            raise TokenizerError(f"{vocab_file} has no <|endoftext|> entry; it is not a GPT-2 style vocab.json")
        self._inv_vocab = {i: t for t, i in self._vocab.items()}
        self._eod = self._vocab["<|endoftext|>"]
        ranks = None
        if backend in ("auto", "tiktoken"):
            try:
                import tiktoken
            except ImportError:
                tiktoken = None
            ranks = _tiktoken_ranks(self._vocab, merge_file) if tiktoken else None
            if ranks is None and backend == "tiktoken":
                raise TokenizerError(f"{vocab_file} / {merge_file} cannot use the tiktoken backend "
                                     "(not installed, or the files are not in GPT-2's layout)")
        if ranks is not None:
            specials = {t: i for t, i in self._vocab.items() if i >= len(ranks)}
            enc = tiktoken.Encoding(f"gpt2bpe-{os.path.basename(str(vocab_file))}", pat_str=_FAST_GPT2_PATTERN,
                                    mergeable_ranks=ranks, special_tokens=specials)
            # The core's method skips a Python wrapper per call; the public one is the fallback.
            core = getattr(enc, "_core_bpe", None)
            self._encode_one = core.encode_ordinary if hasattr(core, "encode_ordinary") else enc.encode_ordinary
            self.backend, self._decode = "tiktoken", enc.decode
        elif backend in ("auto", "tokenizers"):
            self.backend = "tokenizers"
            self._build_hf(vocab_file, merge_file)
        else:
            raise TokenizerError(f"unknown GPT-2 BPE backend {backend!r}; use auto, tiktoken or tokenizers")

    def _build_hf(self, vocab_file, merge_file):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        # No normalizer, no prefix space, GPT-2's regex, no post-processor: GPT-2's pipeline.
        tok = Tokenizer(models.BPE.from_file(str(vocab_file), str(merge_file)))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        self._encode_one = lambda text: tok.encode(text, add_special_tokens=False).ids
        self._decode = lambda ids: tok.decode(ids, skip_special_tokens=False)

    def tokenize(self, text):
        try:
            return self._encode_one(text)
        except (UnicodeEncodeError, TypeError):  # lone surrogates (HF raises TypeError for them)
            return self._encode_one(clean_text(text))

    def detokenize(self, ids):
        return self._decode([int(i) for i in ids])


def _load_sentencepiece(model_file, tokenizer_type):
    import sentencepiece

    try:
        return sentencepiece.SentencePieceProcessor(model_file=str(model_file))
    except RuntimeError:  # "INTERNAL: could not parse ModelProto ..." from C++
        raise TokenizerError(f"--tokenizer-model {model_file} is not a SentencePiece model ({tokenizer_type} reads "
                             f"one; Meta's Llama 3 tiktoken tokenizer.model is Llama3Tokenizer's)") from None


class SentencePieceTokenizer(_MappedTokenizer):
    """Megatron's SentencePieceTokenizer: the model's pieces, then special tokens appended after
    them when the model lacks them (<CLS> <SEP> <EOD> <MASK>, and pad/bos/eos, then the
    --vocab-extra-ids sentinels <extra_id_0>..). `eod` is <EOD>; `cls sep mask pad bos_token_id
    eos_token_id additional_special_tokens_ids` as upstream's (BERT/T5 data).
    Special-token strings inside text map to their ids, as in Megatron."""

    name = "SentencePieceTokenizer"

    def __init__(self, model_file, vocab_extra_ids: int = 0):
        self._sp = _load_sentencepiece(model_file, self.name)
        n = self._sp.get_piece_size()
        self._vocab = {self._sp.id_to_piece(i): i for i in range(n)}
        self._inv_vocab = {i: t for t, i in self._vocab.items()}
        self._special: dict[str, int] = {}
        self._add_specials(n)
        self.additional_special_tokens = [f"<extra_id_{i}>" for i in range(int(vocab_extra_ids))]
        self.additional_special_tokens_ids = [self._add_special(t) for t in self.additional_special_tokens]

    def _add_specials(self, n):
        self.cls, self.sep, self._eod, self.mask = (self._add_special(t) for t in ("<CLS>", "<SEP>", "<EOD>", "<MASK>"))
        sp = self._sp
        self.pad, self.bos_token_id, self.eos_token_id = (
            self._add_special(self._sp.id_to_piece(sp_id) if 0 <= sp_id < n else fallback)
            for sp_id, fallback in ((sp.pad_id(), "<PAD>"), (sp.bos_id(), "<BOS>"), (sp.eos_id(), "<EOS>")))

    def _add_special(self, token) -> int:
        if token not in self._vocab:
            new_id = len(self._vocab)
            self._vocab[token], self._inv_vocab[new_id] = new_id, token
        self._special[token] = self._vocab[token]
        return self._vocab[token]

    def _encode(self, text_or_texts):
        try:
            return self._sp.encode(text_or_texts, out_type=int, num_threads=1)
        except RuntimeError:  # lone surrogates cannot cross into C++
            if isinstance(text_or_texts, str):
                return self._sp.encode(clean_text(text_or_texts), out_type=int)
            return self._sp.encode([clean_text(t) for t in text_or_texts], out_type=int, num_threads=1)

    def tokenize(self, text):
        ids, start = [], 0
        while self._special:
            # The earliest special token wins; text between them goes through SentencePiece.
            hits = [(text.find(t, start), t) for t in self._special]
            hits = [(pos, t) for pos, t in hits if pos >= 0]
            if not hits:
                break
            pos, token = min(hits)
            ids.extend(self._encode(text[start:pos]))
            ids.append(self._special[token])
            start = pos + len(token)
        ids.extend(self._encode(text[start:]))
        return ids

    def tokenize_batch(self, texts):
        texts = list(texts)
        plain = [i for i, t in enumerate(texts) if not any(s in t for s in self._special)]
        out: list = [None] * len(texts)
        # One thread: preprocessing parallelises over worker processes, one core each.
        for i, ids in zip(plain, self._encode([texts[i] for i in plain])):
            out[i] = ids
        for i, t in enumerate(texts):
            if out[i] is None:
                out[i] = self.tokenize(t)
        return out

    def detokenize(self, ids):
        # Megatron's rendering: each special token surrounded by spaces between decoded spans.
        ids = [int(i) for i in ids]
        special_ids = {i: t for t, i in self._special.items()}
        parts, last = [], 0
        for k, i in enumerate(ids):
            if i in special_ids:
                parts.append(self._sp.decode(ids[last:k]) + " " + special_ids[i] + " ")
                last = k + 1
        parts.append(self._sp.decode(ids[last:]))
        return "".join(parts)


class GPTSentencePieceTokenizer(SentencePieceTokenizer):
    """Megatron-LM's GPTSentencePieceTokenizer: the model's own pieces only, eod = the model's eos."""

    name = "GPTSentencePieceTokenizer"

    def _add_specials(self, n):
        if self._sp.eos_id() < 0:
            raise TokenizerError("the SentencePiece model defines no eos piece, "
                                 "which GPTSentencePieceTokenizer uses as eod")
        self._eod = self._sp.eos_id()


class Llama2Tokenizer(GPTSentencePieceTokenizer):
    """Megatron-LM's Llama2Tokenizer as its legacy megatron/training/tokenizer/tokenizer.py
    (``_Llama2Tokenizer``) defines it, Llama 2's convention: the model's own pieces, BOS prepended
    (``tokenize(s, bos=True, eos=False)``), eod = the model's eos. (core_v0.19.0 routes the name to
    its generic SentencePiece wrapper, which adds no BOS; Llama 2 was trained with it.)"""

    name = "Llama2Tokenizer"

    def _add_specials(self, n):
        super()._add_specials(n)
        if self._sp.bos_id() < 0:
            raise TokenizerError("the SentencePiece model defines no bos piece, which Llama2Tokenizer prepends")
        self.bos = self.bos_token_id = self._sp.bos_id()
        self.adds_bos = True

    def tokenize(self, text):
        return [self.bos] + super().tokenize(text)

    def tokenize_batch(self, texts):
        return [[self.bos] + ids for ids in super().tokenize_batch(texts)]


class JapaneseSentencePiece(AbstractTokenizer):
    """--tokenizer-type JapaneseSentencePiece --vocab-file MODEL: the SentencePiece tokenizer of ABCI users'
    Megatron-DeepSpeed forks (megatron/tokenizer/tokenizer.py ``_JapaneseSentencePiece``). It ships in two
    definitions, told apart here by the model's pieces:
      * "abci" (kojimano/Megatron-DeepSpeed-ABCI, the ABCI Grand Challenge fork; llm-jp's July 2023
        branches): eod "<|endoftext|>", pad "<|padding|>"; "\n" becomes "<|endofline|>" before encoding
        and back after decoding. Chosen when the model has both "<|endoftext|>" and "<|endofline|>".
      * "llm-jp" (llm-jp/Megatron-DeepSpeed's main line, "feat: tokenizer-v2"): eod "</s>", pad "<pad>",
        "\r\n" becomes "\n", plain decoding.
    Both run the same two replacements in this order (the "\r\n" one finds nothing once "\n" is gone,
    unless the symbol is "\n" itself), encode with the model alone (no bos/eos added) and report the
    model's piece count as the vocabulary size."""

    def __init__(self, model_file):
        import sentencepiece

        self._sp = sentencepiece.SentencePieceProcessor(model_file=str(model_file))
        abci = self._has("<|endoftext|>") and self._has("<|endofline|>")
        self.variant = "abci" if abci else "llm-jp"
        eod, pad, self.eol_symbol = ("<|endoftext|>", "<|padding|>", "<|endofline|>") if abci else \
            ("</s>", "<pad>", "\n")
        if not self._has(eod):
            raise TokenizerError(f"--vocab-file {model_file}: the SentencePiece model has neither \"<|endoftext|>\" "
                                 f"with \"<|endofline|>\" nor \"</s>\", the end-of-document pieces of "
                                 f"JapaneseSentencePiece's two definitions")
        self._eod, self.pad_id = self._sp.piece_to_id(eod), self._sp.piece_to_id(pad)
        self.name = f"JapaneseSentencePiece ({self.variant} definition, eod {eod})"

    def _has(self, piece: str) -> bool:
        return self._sp.id_to_piece(self._sp.piece_to_id(piece)) == piece  # absent pieces map to <unk>

    @property
    def vocab_size(self):
        return self._sp.get_piece_size()

    @property
    def eod(self):
        return self._eod

    def _prepare(self, text: str) -> str:
        return text.replace("\n", self.eol_symbol).replace("\r\n", self.eol_symbol)

    def tokenize(self, text):
        return self.tokenize_batch([text])[0]

    def tokenize_batch(self, texts):
        texts = [self._prepare(t) for t in texts]
        try:  # one thread: preprocessing parallelises over worker processes, one core each
            return self._sp.encode(texts, out_type=int, num_threads=1)
        except RuntimeError:  # lone surrogates cannot cross into C++ (the forks crash there)
            return self._sp.encode([clean_text(t) for t in texts], out_type=int, num_threads=1)

    def detokenize(self, ids):
        text = self._sp.decode([int(i) for i in ids])
        return text.replace(self.eol_symbol, "\n") if self.variant == "abci" else text


def _find_hf_tokenizer_json(path, tokenizer_type):
    if not path:
        raise TokenizerError(
            f"--tokenizer-type {tokenizer_type} needs --tokenizer-model (a tokenizer.json or its directory)")
    path = str(path)
    if os.path.isdir(path):
        candidate = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(candidate):
            raise TokenizerError(f"{path} has no tokenizer.json (hub names are not downloaded; pass a local file)")
        return candidate
    if not os.path.isfile(path):
        raise TokenizerError(
            f"--tokenizer-model {path} does not exist; {tokenizer_type} loads a local tokenizer.json or a "
            "directory holding one and never downloads from the hub"
        )
    return path


_EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "[SEP]")


class HFTokenizer(_MappedTokenizer):
    """A local HF tokenizer (Megatron-LM's HuggingFaceTokenizer, Megatron-DeepSpeed's HFTokenizer):
    a directory with tokenizer.json, or the file itself. Ids are those of Megatron-LM's
    ``HuggingFaceTokenizer.text_to_ids``, ``AutoTokenizer.from_pretrained(dir)(text).input_ids``
    (special tokens included: BOS for Llama 3's files, none for Qwen's): where tokenizer_config.json
    lies beside tokenizer.json, transformers' AutoTokenizer loads the directory (local files only)
    and its configured backend encodes; a bare tokenizer.json (or a config AutoTokenizer refuses)
    encodes as the file says. --tokenizer-hf-no-include-special-tokens encodes without them
    (``tokens_to_ids(tokenize(text))`` there) and decodes dropping them. eod is the
    eos token (``HuggingFaceTokenizer.eod``), else the first of the usual end-of-text tokens."""

    name = "HFTokenizer"

    def __init__(self, tokenizer_model, spelled: str = "HFTokenizer", include_special_tokens: bool = True):
        from tokenizers import Tokenizer

        self.include_special_tokens = include_special_tokens

        path = _find_hf_tokenizer_json(tokenizer_model, spelled)
        source_dir = os.path.dirname(path)
        self.bos = self._auto = None
        if os.path.basename(path) == "tokenizer.json" and \
                os.path.isfile(os.path.join(source_dir, "tokenizer_config.json")):
            self._tok = self._from_auto_tokenizer(source_dir)
        if self._auto is None:
            try:
                self._tok = Tokenizer.from_file(path)
            except Exception as exc:  # noqa: BLE001 - the Rust library raises plain Exceptions for bad files
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                raise TokenizerError(f"--tokenizer-model {path} is not a tokenizers tokenizer.json ({first})") from None
        self._vocab = self._tok.get_vocab(with_added_tokens=True)
        self._inv_vocab = {i: t for t, i in self._vocab.items()}
        self._eod = self._vocab.get(self._eos_token(path, self._vocab))
        self._encode_batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        self.adds_bos = self.bos is not None and self.tokenize("")[:1] == [self.bos]

    def _from_auto_tokenizer(self, directory):
        import transformers
        from transformers import AutoTokenizer

        verbosity = transformers.logging.get_verbosity()
        transformers.logging.set_verbosity_error()  # its notes on the class it picks are not the user's concern
        try:
            auto = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        except Exception:  # noqa: BLE001 - a config transformers refuses (e.g. an old eos_token dict): the file alone
            return None
        finally:
            transformers.logging.set_verbosity(verbosity)
        if not getattr(auto, "is_fast", False):
            return None
        self._auto, self.bos = auto, auto.bos_token_id
        return auto.backend_tokenizer

    def _eos_token(self, path, vocab):
        if self._auto is not None and self._auto.eos_token in vocab:
            return self._auto.eos_token
        config = os.path.join(os.path.dirname(path), "tokenizer_config.json")
        if os.path.isfile(config):
            with open(config, encoding="utf-8") as f:
                eos = json.load(f).get("eos_token")
            if isinstance(eos, dict):
                eos = eos.get("content")
            if eos in vocab:
                return eos
        for name in _EOS_NAMES:
            if name in vocab:
                return name
        raise TokenizerError(
            f"cannot tell the end-of-document token of {path}: put a tokenizer_config.json with "
            f"\"eos_token\" next to it, or add one of {list(_EOS_NAMES)} to the vocabulary"
        )

    @property
    def vocab_size(self):
        return self._tok.get_vocab_size(with_added_tokens=True)

    def tokenize(self, text):
        add = self.include_special_tokens
        try:
            return self._tok.encode(text, add_special_tokens=add).ids
        except (UnicodeEncodeError, TypeError):  # lone surrogates
            return self._tok.encode(clean_text(text), add_special_tokens=add).ids

    def tokenize_batch(self, texts):
        texts, add = list(texts), self.include_special_tokens
        try:
            return [e.ids for e in self._encode_batch(texts, add_special_tokens=add)]
        except (UnicodeEncodeError, TypeError):
            return [e.ids for e in self._encode_batch([clean_text(t) for t in texts], add_special_tokens=add)]

    def detokenize(self, ids):
        # Megatron-LM's ids_to_text drops the special tokens when they are not included
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=not self.include_special_tokens)


class NullTokenizer(AbstractTokenizer):
    """Text is already token ids, space separated. eod = N, so the vocabulary holds N + 1 ids."""

    name = "NullTokenizer"

    def __init__(self, vocab_size):
        self._n = int(vocab_size)

    @property
    def vocab_size(self):
        return self._n + 1

    @property
    def eod(self):
        return self._n

    def tokenize(self, text):
        try:
            ids = [int(x) for x in text.split()]
        except ValueError as exc:
            raise TokenizerError(f"NullTokenizer expects space-separated integers, got {text[:60]!r}") from exc
        if ids and (min(ids) < 0 or max(ids) > self._n):
            raise TokenizerError(f"NullTokenizer ids must lie in [0, {self._n}], got {min(ids)}..{max(ids)}")
        return ids

    def detokenize(self, ids):
        return " ".join(str(int(i)) for i in ids)


def build_tokenizer(tokenizer_type, *, vocab_file=None, merge_file=None, tokenizer_model=None,
                    vocab_size=None, vocab_extra_ids=0, tiktoken_pattern=None,
                    tiktoken_num_special_tokens=TIKTOKEN_NUM_SPECIAL_TOKENS, tokenizer_special_tokens=None,
                    hf_include_special_tokens=True, log=print):
    """The tokenizer for `--tokenizer-type`, checking that the flags it needs were given.
    `vocab_extra_ids` (--vocab-extra-ids, T5's sentinels) applies to the BERT WordPiece types;
    the tiktoken_* flags, --tokenizer-special-tokens and --vocab-size shape TikTokenizer;
    hf_include_special_tokens False (--tokenizer-hf-no-include-special-tokens) HuggingFaceTokenizer."""
    kind = canonical_tokenizer_type(tokenizer_type)
    if vocab_extra_ids and kind not in ("BertWordPieceLowerCase", "BertWordPieceCase", "SentencePieceTokenizer"):
        raise TokenizerError(f"--vocab-extra-ids is supported with the BertWordPieceLowerCase/BertWordPieceCase and "
                             f"SentencePieceTokenizer tokenizers only (as in Megatron-DeepSpeed), not {tokenizer_type}")
    if tokenizer_special_tokens and kind != "TikTokenizer":
        raise TokenizerError(f"--tokenizer-special-tokens is supported with --tokenizer-type TikTokenizer only "
                             f"(its special ids), not {tokenizer_type}; other tokenizers keep their files' tokens")
    if kind in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        from megatron_ds.data.wordpiece import BertWordPieceTokenizer

        tok = BertWordPieceTokenizer(_require_file(vocab_file, "--vocab-file", kind),
                                     lower_case=kind == "BertWordPieceLowerCase", vocab_extra_ids=vocab_extra_ids)
    elif kind == "GPT2BPETokenizer":
        tok = GPT2BPETokenizer(_require_file(vocab_file, "--vocab-file", kind),
                               _require_file(merge_file, "--merge-file", kind))
    elif kind == "SentencePieceTokenizer":
        tok = SentencePieceTokenizer(_require_file(tokenizer_model, "--tokenizer-model", kind), vocab_extra_ids)
    elif kind == "GPTSentencePieceTokenizer":
        tok = GPTSentencePieceTokenizer(_require_file(tokenizer_model, "--tokenizer-model", kind))
    elif kind == "Llama2Tokenizer":
        tok = Llama2Tokenizer(_require_file(tokenizer_model, "--tokenizer-model", kind))
    elif kind == "HFTokenizer":
        tok = HFTokenizer(tokenizer_model, tokenizer_type, include_special_tokens=hf_include_special_tokens)
    elif kind == "TikTokenizer":
        from megatron_ds.data.tiktoken_tokenizers import TikTokenizer

        tok = TikTokenizer(_require_file(tokenizer_model, "--tokenizer-model", kind), tiktoken_pattern or "v2",
                           tiktoken_num_special_tokens, tokenizer_special_tokens, vocab_size)
    elif kind == "Llama3Tokenizer":
        from megatron_ds.data.tiktoken_tokenizers import Llama3Tokenizer

        tok = Llama3Tokenizer(_require_file(tokenizer_model, "--tokenizer-model", kind))
    elif kind == "JapaneseSentencePiece":  # its forks pass the SentencePiece model as --vocab-file
        tok = JapaneseSentencePiece(_require_file(vocab_file, "--vocab-file", kind))
    elif kind == "NullTokenizer":
        if vocab_size is None:
            raise TokenizerError("--tokenizer-type NullTokenizer needs --vocab-size")
        tok = NullTokenizer(vocab_size)
    else:
        raise TokenizerError(f"unknown --tokenizer-type {tokenizer_type!r}; valid types: {', '.join(VALID_TYPES)}")
    if log:
        try:
            ids = f"eod id {tok.eod}"
        except TokenizerError:  # BERT WordPiece: no end-of-document token
            ids = f"cls {tok.cls}, sep {tok.sep}, mask {tok.mask}, pad {tok.pad}"
        ids += f", bos id {tok.bos} prepended" if getattr(tok, "adds_bos", False) else ""
        log(f"> building {tok.name} tokenizer: vocab size {tok.vocab_size}, {ids}")
    return tok


class MockTokenizer:
    """--mock-data without a tokenizer: only the vocabulary size and an EOD id matter."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.eod = vocab_size - 1
        self.name = "mock"


def resolved_tokenizer_type(data, default_type: str = "GPT2BPETokenizer") -> str | None:
    """The tokenizer type a data section (``DataConfig``) means: --tokenizer-type, else the entry
    point's default (Megatron-DeepSpeed's pretrain_gpt.py passes args_defaults={'tokenizer_type':
    'GPT2BPETokenizer'}, pretrain_bert.py and pretrain_t5.py 'BertWordPieceLowerCase'); None for
    --mock-data without a --vocab-file (no tokenizer at all)."""
    if data.tokenizer_type is not None:
        return data.tokenizer_type
    return None if data.mock_data and not data.vocab_file else default_type


def build_tokenizer_for(data, log=print, *, vocab_extra_ids: int = 0, default_type: str = "GPT2BPETokenizer"):
    """The tokenizer a run's data section (``DataConfig``) names (``resolved_tokenizer_type``) with its
    files, or for --mock-data alone a ``MockTokenizer`` of --vocab-size ids. vocab_extra_ids:
    --vocab-extra-ids (T5 sentinels, BERT WordPiece tokenizers only)."""
    tokenizer_type = resolved_tokenizer_type(data, default_type)
    if tokenizer_type is None:
        return MockTokenizer(data.vocab_size or GPT2_VOCAB_SIZE)
    return build_tokenizer(tokenizer_type, vocab_file=data.vocab_file, merge_file=data.merge_file,
                           tokenizer_model=data.tokenizer_model, vocab_size=data.vocab_size,
                           vocab_extra_ids=vocab_extra_ids, log=log, **tokenizer_options(data))


def tokenizer_options(data) -> dict:
    """build_tokenizer's keywords beyond the files (TikTokenizer's, HuggingFaceTokenizer's) from a
    data section (``DataConfig``), a namespace with its field names or a dict of them (older
    checkpoints' configs lack them: Megatron-LM's defaults)."""
    get = data.get if isinstance(data, dict) else lambda k: getattr(data, k, None)
    return {"tiktoken_pattern": get("tiktoken_pattern"),
            "tiktoken_num_special_tokens": get("tiktoken_num_special_tokens") or TIKTOKEN_NUM_SPECIAL_TOKENS,
            "tokenizer_special_tokens": get("tokenizer_special_tokens"),
            "hf_include_special_tokens": not get("tokenizer_hf_no_include_special_tokens")}
