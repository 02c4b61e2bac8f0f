"""GLUE classification data as Megatron-LM's tasks/glue reads it: MNLI and QQP in their published TSV files.

Each file's first line is its header; the columns read are Megatron's (tasks/glue/mnli.py, qqp.py):

- MNLI (train.tsv, dev_matched.tsv, dev_mismatched.tsv): index in column 0, sentence1 / sentence2
  in columns 8 / 9, the gold label in the last column (contradiction 0, entailment 1, neutral 2).
  A test file (10 columns: no label) gets the label "contradiction", as Megatron's ``test_label``.
- QQP (train.tsv, dev.tsv): id, qid1, qid2, question1, question2, is_duplicate (6 columns; a row of
  another width or with an empty question is skipped, as Megatron does); a test file (3 columns:
  id, question1, question2) gets label 0.

A sample is ``[CLS] A [SEP] B [SEP]`` cut to ``max_seq_length`` and padded, with token types 0 / 1
and a padding mask (tasks/data_utils.py ``build_tokens_types_paddings_from_ids``, bit for bit,
including its padding of the token types with the pad id).
"""
from __future__ import annotations

import re

import numpy as np

from megatron_ds.errors import DataError

MNLI_LABELS = {"contradiction": 0, "entailment": 1, "neutral": 2}


def clean_text(text: str) -> str:
    """tasks/data_utils.py ``clean_text``: newlines and runs of spaces to one space, " . " to ". "."""
    text = re.sub(r"\s+", " ", text.replace("\n", " "))
    for _ in range(3):
        text = text.replace(" . ", ". ")
    return text


def pair_ids(a: list[int], b: list[int] | None, max_seq_length: int, cls: int, sep: int, pad: int):
    """(ids, types, paddings) of ``[CLS] a [SEP] b [SEP]``, Megatron's trimming and padding rules."""
    ids, types = [cls, *a, sep], [0] * (len(a) + 2)
    if b is not None:
        ids, types = ids + list(b), types + [1] * len(b)
    paddings = [1] * len(ids)
    trimmed = len(ids) >= max_seq_length
    if trimmed:  # Megatron cuts to max - 1, then always closes with [SEP]
        ids, types, paddings = ids[:max_seq_length - 1], types[:max_seq_length - 1], paddings[:max_seq_length - 1]
    if b is not None or trimmed:
        ids.append(sep)
        types.append(0 if b is None else 1)
        paddings.append(1)
    fill = max_seq_length - len(ids)
    return ids + [pad] * fill, types + [pad] * fill, paddings + [0] * fill


def _rows(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror}") from None
    if not lines:
        raise DataError(f"{path} is empty (a GLUE TSV file starts with its header line)")
    return [line.strip().split("\t") for line in lines]


def read_mnli(path: str) -> list[dict]:
    """MNLI samples ``{"text_a", "text_b", "label", "uid"}`` of one TSV file (module docstring)."""
    rows = _rows(path)
    is_test = len(rows[0]) == 10
    samples = []
    for n, row in enumerate(rows[1:], start=2):
        if len(row) < 10:
            raise DataError(f"{path}:{n}: {len(row)} columns, an MNLI row has at least 10")
        label = "contradiction" if is_test else row[-1].strip()
        if label not in MNLI_LABELS:
            raise DataError(f"{path}:{n}: label {label!r} is not one of {', '.join(MNLI_LABELS)}")
        samples.append({"text_a": clean_text(row[8].strip()), "text_b": clean_text(row[9].strip()),
                        "label": MNLI_LABELS[label], "uid": int(row[0])})
    return samples


def read_qqp(path: str) -> list[dict]:
    """QQP samples ``{"text_a", "text_b", "label", "uid"}`` of one TSV file (module docstring)."""
    rows = _rows(path)
    is_test = len(rows[0]) == 3
    samples = []
    for n, row in enumerate(rows[1:], start=2):
        if is_test:
            uid, a, b, label = row[0], row[1], row[2], "0"
        elif len(row) == 6:
            uid, a, b, label = row[0], row[3], row[4], row[5]
        else:
            continue  # Megatron: "index error, skipping"
        a, b = clean_text(a.strip()), clean_text(b.strip())
        if not a or not b:
            continue
        if label.strip() not in ("0", "1"):
            raise DataError(f"{path}:{n}: is_duplicate {label!r} is not 0 or 1")
        samples.append({"text_a": a, "text_b": b, "label": int(label), "uid": int(uid)})
    return samples


class ClassificationDataset:
    """Tokenized GLUE samples: ``{"text", "types", "padding_mask", "label", "uid"}`` as numpy arrays."""

    def __init__(self, name: str, samples: list[dict], tokenizer, max_seq_length: int):
        if not samples:
            raise DataError(f"{name}: no samples")
        self.name, self.samples = name, samples
        self.tokenizer, self.max_seq_length = tokenizer, max_seq_length

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, idx):
        s, tok = self.samples[idx], self.tokenizer
        ids, types, paddings = pair_ids(tok.tokenize(s["text_a"]), tok.tokenize(s["text_b"]), self.max_seq_length,
                                        tok.cls, tok.sep, tok.pad)
        return {"text": np.array(ids, dtype=np.int64), "types": np.array(types, dtype=np.int64),
                "padding_mask": np.array(paddings, dtype=np.int64), "label": np.int64(s["label"]),
                "uid": np.int64(s["uid"])}
