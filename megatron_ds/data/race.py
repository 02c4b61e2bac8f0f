"""RACE multiple-choice data as Megatron-LM's tasks/race/data.py reads it.

A --train-data / --valid-data path is one folder of the published RACE release (``RACE/train/middle``,
``RACE/dev/high``, ...); every ``*.txt`` file in it holds one article as JSON (one per line, as Megatron reads them): ``article``,
``questions``, ``options`` (four per question) and ``answers`` (``"A"``-``"D"``). Each question
becomes one sample of four sequences, one per option: the question with the option put in place of
its ``_`` (or appended after a space), cleaned, tokenized and cut to 128 tokens, is text A and the
article text B (``glue.pair_ids``). The label is the answer's position.
"""
from __future__ import annotations

import glob
import json
import os

import numpy as np

from megatron_ds.data.glue import clean_text, pair_ids
from megatron_ds.errors import DataError

NUM_CHOICES = 4
MAX_QA_LENGTH = 128  # tasks/race/data.py MAX_QA_LENGTH


def _articles(path: str):
    """The articles of one file: one JSON object per line, as Megatron reads them (the release has one)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line for line in f if line.strip()]
        articles = [json.loads(line) for line in lines]
    except (OSError, ValueError) as exc:
        raise DataError(f"cannot read RACE article {path}: {exc}") from None
    for data in articles:
        missing = [k for k in ("article", "questions", "options", "answers") if k not in data]
        if missing or not len(data["questions"]) == len(data["options"]) == len(data["answers"]):
            raise DataError(f"{path}: a RACE article needs article, questions, options and answers of one length"
                            + (f" (missing {', '.join(missing)})" if missing else ""))
    return articles


def _question(path: str, question: str, options: list[str], answer: str, context_ids, tokenizer, max_seq_length):
    label = ord(answer) - ord("A") if len(answer) == 1 else -1
    if not 0 <= label < NUM_CHOICES or len(options) != NUM_CHOICES:
        raise DataError(f"{path}: a RACE question has {NUM_CHOICES} options and an answer A-D "
                        f"(got {len(options)} options, answer {answer!r})")
    rows = []
    for choice in options:
        qa = question.replace("_", choice) if "_" in question else " ".join([question, choice])
        qa_ids = tokenizer.tokenize(clean_text(qa))[:MAX_QA_LENGTH]
        rows.append(pair_ids(qa_ids, context_ids, max_seq_length, tokenizer.cls, tokenizer.sep, tokenizer.pad))
    ids, types, paddings = (np.array([r[i] for r in rows], dtype=np.int64) for i in range(3))
    return {"text": ids, "types": types, "padding_mask": paddings, "label": np.int64(label)}


def read_race(folder: str, tokenizer, max_seq_length: int) -> list[dict]:
    """The tokenized samples of one RACE folder (module docstring), ``uid`` numbering them from 0."""
    files = sorted(glob.glob(os.path.join(folder, "*.txt")))
    if not files:
        raise DataError(f"{folder} holds no RACE article (*.txt): pass a folder such as RACE/train/middle")
    samples = []
    for data in (article for path in files for article in _articles(path)):
        context_ids = tokenizer.tokenize(clean_text(data["article"]))
        for question, options, answer in zip(data["questions"], data["options"], data["answers"]):
            sample = _question(folder, question, options, answer, context_ids, tokenizer, max_seq_length)
            samples.append({**sample, "uid": np.int64(len(samples))})
    return samples
