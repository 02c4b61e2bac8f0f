"""GPT-2 byte-level BPE written the straightforward way, in pure Python.

This is the yardstick for the native encoders (tiktoken, HF `tokenizers`): the tests require
identical ids on varied text, and bench/preprocess.py measures it as "the pure-Python path" (it is
the algorithm Megatron's preprocess_data runs, one document at a time).

The algorithm, from GPT-2's published encoder:
1. split the text with GPT-2's regex (contractions, letter runs, digit runs, punctuation runs,
   whitespace runs where the last space sticks to the next word);
2. map each piece's UTF-8 bytes to printable unicode characters (bytes_to_unicode), so the BPE
   vocabulary never contains raw spaces or control bytes;
3. repeatedly merge the adjacent pair with the lowest merge rank (all its occurrences, left to
   right) until no adjacent pair has a rank;
4. look each resulting symbol up in vocab.json.
"""
from __future__ import annotations

import json
from functools import lru_cache

import regex

# GPT-2's pre-tokenization pattern. `\s+(?!\S)` leaves the last space of a whitespace run to be
# glued to the following word (" world"), which is why "a  b" becomes ["a", " ", " b"].
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


@lru_cache(maxsize=None)
def bytes_to_unicode() -> dict[int, str]:
    """Byte -> printable character. Printable latin-1 bytes map to themselves; the other 68 bytes
    (controls, space, soft hyphen ...) map to chr(256 + k) in byte order."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def read_merges(path) -> list[tuple[str, str]]:
    """merges.txt: an optional '#version' line, then one 'left right' pair per line, by rank."""
    merges = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.rstrip("\n")
            if not line or line.startswith("#version"):
                continue
            left, right = line.split(" ")
            merges.append((left, right))
    return merges


class ReferenceBPE:
    def __init__(self, vocab_file, merges_file):
        with open(vocab_file, encoding="utf-8") as f:
            self.encoder: dict[str, int] = json.load(f)
        self.decoder = {i: s for s, i in self.encoder.items()}
        self.ranks = {pair: rank for rank, pair in enumerate(read_merges(merges_file))}
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {c: b for b, c in self.byte_encoder.items()}
        self.pattern = regex.compile(GPT2_PATTERN)
        # Words repeat constantly in text; GPT-2's encoder caches them too, so the benchmark
        # compares against the reference as it is actually used.
        self.cache: dict[str, list[str]] = {}

    def bpe(self, word: str) -> list[str]:
        if word in self.cache:
            return self.cache[word]
        symbols = list(word)
        while len(symbols) > 1:
            pairs = set(zip(symbols, symbols[1:]))
            best = min(pairs, key=lambda p: self.ranks.get(p, float("inf")))
            if best not in self.ranks:
                break
            merged, i = [], 0
            while i < len(symbols):
                if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == best:
                    merged.append(symbols[i] + symbols[i + 1])
                    i += 2
                else:
                    merged.append(symbols[i])
                    i += 1
            symbols = merged
        self.cache[word] = symbols
        return symbols

    def encode(self, text: str) -> list[int]:
        ids = []
        for piece in self.pattern.findall(text):
            word = "".join(self.byte_encoder[b] for b in piece.encode("utf-8"))
            ids.extend(self.encoder[s] for s in self.bpe(word))
        return ids

    def decode(self, ids) -> str:
        text = "".join(self.decoder[int(i)] for i in ids)
        return bytes(self.byte_decoder[c] for c in text).decode("utf-8", errors="replace")
