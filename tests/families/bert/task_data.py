"""Tiny MNLI-format and RACE-format data sets and a WordPiece vocabulary, written by the tests that
fine-tune (no downloads). The label is a rule of the text, so a small model can learn it:

- MNLI: sentence 2 holds "yes" (entailment), "no" (contradiction) or "maybe" (neutral) among random words;
- RACE: the right option holds "right", the three others only random words.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = [f"w{i}" for i in range(40)]
KEYS = {"entailment": "yes", "contradiction": "no", "neutral": "maybe"}
MNLI_HEADER = ("index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\t"
               "sentence1_parse\tsentence2_parse\tsentence1\tsentence2\tlabel1\tgold_label")


def write_vocab(path: Path) -> Path:
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "right", *KEYS.values(), *WORDS, ".", "?"]
    path.write_text("\n".join(tokens) + "\n")
    return path


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def write_mnli(path: Path, n: int, seed: int) -> Path:
    """An MNLI TSV file of ``n`` rows (12 columns, as train.tsv), labels in turn."""
    rng = random.Random(seed)
    rows = [MNLI_HEADER]
    for i in range(n):
        label = list(KEYS)[i % 3]
        b = _words(rng, 3).split() + [KEYS[label]]
        rng.shuffle(b)
        rows.append("\t".join([str(i), "0", "0", "fiction", "()", "()", "()", "()", _words(rng, 5) + " .",
                               " ".join(b) + " .", label, label]))
    path.write_text("\n".join(rows) + "\n")
    return path


def write_race(folder: Path, articles: int, seed: int) -> Path:
    """A RACE folder of ``articles`` article files with 4 questions each, answers in turn."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for a in range(articles):
        questions, options, answers = [], [], []
        for q in range(4):
            answer = (a + q) % 4
            opts = [_words(rng, 2) for _ in range(4)]
            opts[answer] = f"{rng.choice(WORDS)} right"
            questions.append(_words(rng, 3) + (" _ ." if q % 2 else " ?"))
            options.append(opts)
            answers.append("ABCD"[answer])
        article = {"answers": answers, "options": options, "questions": questions,
                   "article": _words(rng, 12) + " .", "id": f"{a}.txt"}
        (folder / f"{a}.txt").write_text(json.dumps(article))
    return folder
