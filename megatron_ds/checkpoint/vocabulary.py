"""The tokenizer a checkpoint was trained with, compared with this run's before a tensor is read.

Row ``i`` of the embedding and output layers is the token its training tokenizer numbers ``i``.
Loaded under another tokenizer those rows mean other tokens, yet nothing fails: the padded
vocabulary is a layout field that loading reshards (``reshard.py``) like the TP size. So every
checkpoint records its tokenizer (``TOKENIZER`` in META: type, vocabulary size, EOD id and a digest
of the id -> token mapping) and ``--load`` compares it with this run's, refusing a difference in one
line that names both sides.

What is compared: the vocabulary size and the EOD id; the mapping's digest where both sides have
one (a tokenizer with a vocabulary dict), which also tells two vocabularies of one size apart; the
tokenizer type only where a digest is missing (the same id -> token mapping under two types, a
GPT-2 BPE from vocab.json and from tokenizer.json, fills the rows with the same tokens).
Checkpoints written before the record: their real vocabulary size and recorded tokenizer type;
imports from Hugging Face without a tokenizer and the oldest checkpoints: the padded vocabulary at
the layout that saved them (this tokenizer must pad to the same rows there).

``--allow-vocab-change`` (ours: Megatron-DeepSpeed's ``check_checkpoint_args`` in
megatron/checkpointing.py only asserts ``tokenizer_type`` and ``padded_vocab_size`` equal, with no
way to extend a vocabulary) loads such a checkpoint on purpose: the vocabulary rows are resized to
this tokenizer (``fit_vocab_rows``) and one line says how.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Callable

import torch

from megatron_ds.checkpoint import tp as tp_rules
from megatron_ds.config.family import ModelFamily
from megatron_ds.data.tokenizer import canonical_tokenizer_type
from megatron_ds.errors import ConfigError
from megatron_ds.parallel.utils import pad_vocab_size

TOKENIZER = "tokenizer"  # the META entry: tokenizer_record's dict
ALLOW_FLAG = "--allow-vocab-change"
_MEGATRON_DIVISIBLE_BY = 128  # --make-vocab-size-divisible-by's default, for records without it


def _digest(tokenizer) -> str | None:
    """A digest of the id -> token mapping; None for a tokenizer without a vocabulary dict."""
    try:
        vocab = tokenizer.vocab
    except (AttributeError, NotImplementedError):
        return None
    pairs = sorted((int(i), str(t)) for t, i in vocab.items())
    return hashlib.sha256(json.dumps(pairs, ensure_ascii=False).encode("utf-8")).hexdigest()[:16]


def tokenizer_record(tokenizer, tokenizer_type: str | None, eod: int | None) -> dict:
    """What a checkpoint records of the tokenizer it was trained with (``TOKENIZER``):
    ``tokenizer_type`` the run's resolved --tokenizer-type (None: --mock-data alone), ``eod`` the
    EOD id the model family uses (None: BERT WordPiece, which has none)."""
    return {"type": canonical_tokenizer_type(tokenizer_type), "vocab_size": int(tokenizer.vocab_size),
            "eod": None if eod is None else int(eod), "digest": _digest(tokenizer)}


def saved_tokenizer(meta: dict) -> dict | None:
    """The tokenizer facts a checkpoint's META holds: its record, or for checkpoints from before it
    the real vocabulary size and tokenizer type; imports and older ones only their padded rows
    (``rows``) with the padding rule that gave them; None for a META without a signature either."""
    if meta.get(TOKENIZER):
        return meta[TOKENIZER]
    sig, config = meta.get("signature", {}), meta.get("config") or {}
    if meta.get("vocab_size") and "imported_from" not in meta:  # an import's is its rows, not a tokenizer's
        return {"type": canonical_tokenizer_type((config.get("data") or {}).get("tokenizer_type")),
                "vocab_size": int(meta["vocab_size"]), "eod": None, "digest": None}
    if "padded_vocab_size" not in sig:
        return None
    return rows_only(sig["padded_vocab_size"], (config.get("model") or {}).get("make_vocab_size_divisible_by"),
                     sig.get("tensor_model_parallel_size", 1))


def rows_only(rows: int, divisible_by: int | None, tp: int) -> dict:
    """Facts of a checkpoint that recorded only its vocabulary rows, padded by ``divisible_by`` x ``tp``."""
    return {"rows": int(rows), "divisible_by": int(divisible_by or _MEGATRON_DIVISIBLE_BY), "tp": int(tp)}


def _differences(saved: dict, now: dict) -> list[str]:
    """``field: checkpoint X vs now Y`` for each fact that differs."""
    if "rows" in saved:
        d, t = saved["divisible_by"], saved["tp"]
        mine = pad_vocab_size(now["vocab_size"], d, t)
        if mine == pad_vocab_size(saved["rows"], d, t):
            return []
        return [f"vocabulary rows: checkpoint {saved['rows']} vs {mine} for this tokenizer's {now['vocab_size']} "
                f"tokens (padded to a multiple of {d} x TP {t})"]
    diffs = []
    if saved["vocab_size"] != now["vocab_size"]:
        diffs.append(f"vocabulary size: checkpoint {saved['vocab_size']} vs now {now['vocab_size']}")
    if None not in (saved.get("eod"), now["eod"]) and saved["eod"] != now["eod"]:
        diffs.append(f"EOD id: checkpoint {saved['eod']} vs now {now['eod']}")
    digests = (saved.get("digest"), now["digest"])
    if None not in digests and digests[0] != digests[1] and not diffs:
        diffs.append(f"same size, other tokens: digest checkpoint {digests[0]} vs now {digests[1]}")
    types = (saved.get("type"), now["type"])
    if None not in types and types[0] != types[1] and (None in digests or digests[0] != digests[1]):
        diffs.append(f"tokenizer type: checkpoint {types[0]} vs now {types[1]}")
    return diffs


def _trained_with(meta: dict) -> str:
    """`` (--tokenizer-type X --vocab-file F ...)``: the checkpoint's tokenizer flags, where recorded."""
    data = (meta.get("config") or {}).get("data") or {}
    flags = [(f"--{k.replace('_', '-')}", data.get(k)) for k in ("tokenizer_type", "vocab_file", "merge_file",
                                                                   "tokenizer_model")]
    named = " ".join(f"{flag} {value}" for flag, value in flags if value)
    return f" ({named})" if named else ""


@dataclass(frozen=True)
class VocabChange:
    """A tokenizer change ``--allow-vocab-change`` accepted: the checkpoint's real vocabulary size
    (its rows where it recorded none) and this run's."""
    saved: int
    now: int

    @property
    def resizes(self) -> bool:
        return self.saved != self.now

    def describe(self, padded: int) -> str:
        if self.now > self.saved:
            return (f"embedding and output rows resized to this tokenizer's {self.now} tokens (padded {padded}): "
                    f"rows {self.saved}-{self.now - 1} are new and start at the mean of the checkpoint's "
                    f"{self.saved} rows")
        if self.now < self.saved:
            return (f"embedding and output rows cut to this tokenizer's {self.now} tokens (padded {padded}): "
                    f"the checkpoint's rows {self.now}-{self.saved - 1} are dropped")
        return f"vocabulary size unchanged ({self.now}): no rows resized"


def check_vocabulary(saved: dict | None, now: dict | None, *, path: str, allow_change: bool, padded: int,
                     meta: dict | None = None, log: Callable = print) -> VocabChange | None:
    """Compare a checkpoint's tokenizer facts (``saved_tokenizer``) with this run's
    (``tokenizer_record``; either None: nothing to compare). A difference is a ConfigError, or with
    ``allow_change`` (--allow-vocab-change) one line and the ``VocabChange`` to apply; None when
    they agree. ``padded``: this run's padded vocabulary; ``meta``: the checkpoint's META, whose
    tokenizer flags the refusal names."""
    if now is None or saved is None:
        return None
    diffs = _differences(saved, now)
    if not diffs:
        return None
    what = f"checkpoint {path} was trained with another tokenizer ({'; '.join(diffs)})"
    if not allow_change:
        raise ConfigError(f"{what}; train with its tokenizer{_trained_with(meta or {})}, or pass {ALLOW_FLAG} to "
                          f"resize its embedding and output rows to this tokenizer's {now['vocab_size']} tokens")
    change = VocabChange(saved=int(saved.get("vocab_size") or saved["rows"]), now=now["vocab_size"])
    log(f"NOTE: {ALLOW_FLAG}: {what}; {change.describe(padded)}")
    return change


@dataclass(frozen=True)
class VocabSettings:
    """What loading compares: this run's tokenizer (``tokenizer_record``; None: nothing) and whether
    --allow-vocab-change accepts a difference."""
    now: dict | None
    allow_change: bool = False

    def check(self, saved: dict | None, *, path: str, padded: int, meta: dict | None = None,
              log: Callable = print) -> VocabChange | None:
        return check_vocabulary(saved, self.now, path=path, allow_change=self.allow_change, padded=padded,
                                meta=meta, log=log)


def fit_vocab_rows(name: str, tensors: dict[str, torch.Tensor], padded: int, change: VocabChange | None,
                   family: ModelFamily) -> dict[str, torch.Tensor]:
    """``tensors`` (the full "weight" / "fp32" / Adam moments of parameter ``name``) with this run's
    ``padded`` vocabulary rows. Under an accepted vocabulary extension the rows of the new ids start
    at the mean of the checkpoint's real rows (an average token, not the zero or stale padding rows
    they would otherwise be), and their Adam moments at zero. ``family``: whose parameters they are."""
    out = {k: tp_rules.resize_vocab(name, t, padded, family) for k, t in tensors.items()}
    if change is None or change.now <= change.saved or not tp_rules.is_vocab_param(name, family):
        return out
    old, new = change.saved, change.now
    for key, t in out.items():
        t = t.clone()  # never write into a memory-mapped checkpoint file's tensor
        if key in ("weight", "fp32"):
            t[old:new] = t[:old].float().mean(dim=0).to(t.dtype)
        else:
            t[old:new] = 0
        out[key] = t
    return out
