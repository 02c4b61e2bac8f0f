"""Zero-shot GPT evaluation as Megatron computes it (``tasks/zeroshot_gpt`` of Megatron-LM and
Megatron-DeepSpeed: ``evaluate.py``, ``datasets.py``, ``detokenizer.py``; flags in ``tasks/main.py``).

WIKITEXT103 (``_build_wikitext103_dataset``): the file is read as bytes and decoded as UTF-8 (no
newline translation); ``num_original_tokens`` is ``len(text.strip().split(" "))`` of the raw text
(split on the space character only, so a newline does not separate words); the text then goes
through the detokenizer picked by the file's name (``get_detokenizer``: the first of ``ptb``,
``wiki``, ``lambada`` that the path contains) and is tokenized as one stream.

Windows (``_LMDataset``): window ``i`` holds tokens ``[i * o, i * o + seq_len]`` (``seq_len + 1``
tokens, padded with end-of-document), ``o`` being ``--overlapping-eval`` (at least 1; Megatron's
default 32). Target ``j`` of a window is token ``j + 1``; padding is never scored, and every window
but the first scores only its last ``o`` targets when ``o != seq_len``. There are
``max(ceil(max(n - 1 - o, 0) / o) + 1, 1)`` windows for ``n`` tokens.

Numbers (``evaluate_and_print_results``): ``avg loss = sum of scored NLL / (num_tokenized - 1)``,
``ppl = exp(min(20, avg loss))``, ``token ratio = (num_tokenized - 1) / (num_original - 1)`` and
``adjusted ppl = exp(min(20, avg loss * token ratio))``: the perplexity per word of the original
(whitespace-tokenized) WikiText, comparable across tokenizers.

LAMBADA is ``evaluate.py``'s ``lambada_samples`` / ``lambada_accuracy``, which already follow
``_LambadaDataset`` (strict: the whole last word; otherwise the last token).
"""
from __future__ import annotations

import math
import re

import numpy as np
import torch

from megatron_ds.inference.model import InferenceModel
from megatron_ds.progress import progress

MEGATRON_OVERLAPPING_EVAL = 32
"""``--overlapping-eval``'s default in Megatron's ``tasks/main.py``."""


def ptb_detokenizer(string: str) -> str:
    """Megatron's ``ptb_detokenizer``, rule for rule."""
    for old, new in ((" '", "'"), (" \n", "\n"), ("\n ", "\n"), (" n't", "n't"), (" N ", "1 "),
                     ("$ 1", "$1"), ("# 1", "#1")):
        string = string.replace(old, new)
    return string


_WIKI_BRACKETS = (r"\(\s*([^\)]*?)\s*\)", r"(\1)"), (r"\[\s*([^\]]*?)\s*\]", r"[\1]"), \
    (r"{\s*([^}]*?)\s*}", r"{\1}"), (r"\"\s*([^\"]*?)\s*\"", r'"\1"'), (r"'\s*([^']*?)\s*'", r"'\1'")


def wikitext_detokenizer(string: str) -> str:
    """Megatron's ``wikitext_detokenizer``, rule for rule and in its order (the order matters: the
    quote rules run after the punctuation ones, the heading rules after the brackets)."""
    string = string.replace("s '", "s'")
    # Megatron's pattern, slashes included: it only rewrites a literal "/' <digit>/" to "/'[0-9]/";
    # kept as is so the text equals Megatron's.
    string = re.sub(r"/' [0-9]/", r"/'[0-9]/", string)
    for old, new in ((" @-@ ", "-"), (" @,@ ", ","), (" @.@ ", "."), (" : ", ": "), (" ; ", "; "),
                     (" . ", ". "), (" ! ", "! "), (" ? ", "? "), (" , ", ", ")):
        string = string.replace(old, new)
    for pattern, repl in _WIKI_BRACKETS:
        string = re.sub(pattern, repl, string)
    for old, new in (("= = = =", "===="), ("= = =", "==="), ("= =", "=="), (" \u00b0 ", "\u00b0"),
                     (" \n", "\n"), ("\n ", "\n"), (" N ", " 1 "), (" 's", "'s")):
        string = string.replace(old, new)
    return string


def lambada_detokenizer(string: str) -> str:
    return string


DETOKENIZERS = {"ptb": ptb_detokenizer, "wiki": wikitext_detokenizer, "lambada": lambada_detokenizer}


def detokenizer_for(path: str, name: str = "auto"):
    """``name`` from DETOKENIZERS, ``none``, or ``auto``: the first key the path contains, as
    Megatron's ``get_detokenizer`` (which returns None, and then fails, when none matches)."""
    if name == "none":
        return lambada_detokenizer
    if name != "auto":
        return DETOKENIZERS[name]
    for key, fn in DETOKENIZERS.items():
        if key in path:
            return fn
    raise ValueError(f"{path}: the name contains none of {', '.join(DETOKENIZERS)}, which is how Megatron "
                     f"picks the detokenizer; pass --detokenizer wiki (or ptb, none)")


def lm_windows(tokens, seq_len: int, pad_id: int, overlapping_eval: int | None) -> tuple[np.ndarray, np.ndarray]:
    """``[windows, seq_len + 1]`` token ids and ``[windows, seq_len]`` 0/1 loss mask of Megatron's
    ``_LMDataset`` (see the module docstring)."""
    stride = max(1, seq_len if overlapping_eval is None else overlapping_eval)
    tokens = np.asarray(tokens, dtype=np.int64)
    count = max(math.ceil(max(len(tokens) - 1 - stride, 0) / stride) + 1, 1)
    ids = np.full((count, seq_len + 1), pad_id, dtype=np.int64)
    starts = np.arange(count) * stride
    target = starts[:, None] + 1 + np.arange(seq_len)[None, :]  # absolute index of each target
    mask = target < len(tokens)
    if stride != seq_len:
        # Later windows repeat the previous window's targets except their last `stride`.
        mask[1:, :max(seq_len - stride, 0)] = False
    for row, start in enumerate(starts):
        chunk = tokens[start:start + seq_len + 1]
        ids[row, :len(chunk)] = chunk
    return ids, mask.astype(np.int64)


def count_original_tokens(raw_text: str) -> int:
    """Megatron's ``num_original_tokens``: the raw text split on single spaces."""
    return len(raw_text.strip().split(" "))


def read_text(path: str) -> str:
    """The file as Megatron reads it: bytes decoded as UTF-8, line endings untouched."""
    with open(path, "rb") as f:
        return f.read().decode("utf-8")


def _masked_nll(model: InferenceModel, ids: np.ndarray, mask: np.ndarray, batch_size: int,
                show_progress: bool) -> float:
    total = 0.0
    with progress(total=len(ids), desc="wikitext", unit="windows", enabled=show_progress) as bar:
        for start in range(0, len(ids), batch_size):
            x = torch.as_tensor(ids[start:start + batch_size]).to(model.device)
            m = torch.as_tensor(mask[start:start + batch_size]).to(model.device)
            losses = model.token_losses(x[:, :-1], x[:, 1:])
            total += float((losses.double() * m).sum())
            bar.update(len(x))
    return total


def wikitext_perplexity(model: InferenceModel, raw_text: str, tokenizer, *, seq_len: int,
                        overlapping_eval: int | None, detokenize, batch_size: int = 4,
                        show_progress: bool = True) -> dict:
    """Megatron's WIKITEXT103 numbers for ``raw_text`` (see the module docstring)."""
    if model.max_positions is not None and seq_len > model.max_positions:
        raise ValueError(f"--seq-length {seq_len} exceeds the model's {model.max_positions} positions")
    num_original = count_original_tokens(raw_text)
    tokens = tokenizer.tokenize(detokenize(raw_text))
    if len(tokens) < 2 or num_original < 2:
        raise ValueError("the text is too short: Megatron's averages divide by the token counts minus one")
    # Megatron pads with end-of-document; padding sits after the text under causal attention and is
    # never scored, so its id changes no number, and id 0 exists in every model (a NullTokenizer's
    # end-of-document may lie past the checkpoint's vocabulary).
    ids, mask = lm_windows(tokens, seq_len, 0, overlapping_eval)
    nll = _masked_nll(model, ids, mask, batch_size, show_progress)
    loss = nll / (len(tokens) - 1)
    ratio = (len(tokens) - 1) / (num_original - 1)
    return {"task": "WIKITEXT103", "avg_loss": loss, "ppl": math.exp(min(20, loss)),
            "adjusted_ppl": math.exp(min(20, loss * ratio)), "token_ratio": ratio,
            "num_original_tokens": num_original, "num_tokenized_tokens": len(tokens),
            "scored_tokens": int(mask.sum()), "windows": len(ids), "seq_length": seq_len,
            "overlapping_eval": overlapping_eval}
