"""What every tokenizer shares: the interface, its error type, and text clean-up.

Its own module so that tokenizer families in their own modules (wordpiece.py) and the
`build_tokenizer` factory in tokenizer.py both import it without importing each other.
"""
from __future__ import annotations

from megatron_ds.errors import ConfigError


class TokenizerError(ConfigError):
    """A tokenizer that cannot be built from the given files/flags."""


class AbstractTokenizer:
    name = "abstract"
    # Whether tokenize() puts the beginning-of-text id (``bos``) first, as Llama's tokenizers do.
    adds_bos = False

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    @property
    def eod(self) -> int:
        raise NotImplementedError

    def tokenize(self, text: str) -> list[int]:
        raise NotImplementedError

    def tokenize_batch(self, texts) -> list[list[int]]:
        return [self.tokenize(t) for t in texts]

    def detokenize(self, ids) -> str:
        raise NotImplementedError

    @property
    def vocab(self) -> dict:
        raise NotImplementedError(f"{self.name} has no vocabulary mapping")

    @property
    def inv_vocab(self) -> dict:
        raise NotImplementedError(f"{self.name} has no vocabulary mapping")


def clean_text(text: str) -> str:
    """Replace lone surrogates (JSON allows "\\ud800" escapes) by U+FFFD so the text is valid
    UTF-8; surrogate pairs become the character they encode. Megatron crashes on such lines."""
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
