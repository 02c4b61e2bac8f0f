"""Real preprocessed data for end-to-end tests, made once per test session (offline): a corpus of
standard-library docstrings, a byte-level BPE trained on it, and .bin/.idx from preprocess_data;
and the masked-LM quickstarts' WordPiece vocabulary and sentence data at their tiny size."""
from __future__ import annotations

import contextlib
import dataclasses
import io
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def make_e2e_data(workdir: Path, corpus_mb: float = 1.0, vocab_size: int = 1024) -> dict:
    from megatron_ds.cli.quickstart import run_tool
    from megatron_ds.families.gpt.gpt_quickstart import PRESETS, prepare_data

    preset = dataclasses.replace(PRESETS["cpu"], corpus_mb=corpus_mb, vocab=vocab_size)
    with contextlib.redirect_stdout(io.StringIO()):
        prefix, vocab, merges, _, _ = prepare_data(run_tool, str(workdir), preset, workers=2)
    return {"prefix": prefix, "vocab": vocab, "merges": merges}


# What the masked-LM quickstarts' steps 1-3 (corpus, WordPiece vocabulary, sentence data) depend on:
# presets equal in these fields build the same files.
_MASKED_DATA_FIELDS = ("corpus_mb", "heldout_modules", "vocab")


def make_masked_tiny_data(workdir: Path) -> dict:
    """Steps 1-3 of the masked quickstarts at the BERT "tiny" size, run once per session (about 20 s
    of CPU) by the same code the quickstarts call: {"workdir", "prefix", "heldout", "vocab",
    "preset"}."""
    from megatron_ds.cli.quickstart import run_tool
    from megatron_ds.families.bert.bert_quickstart import BERT_PRESETS
    from megatron_ds.families.masked_quickstart import prepare_data

    preset = BERT_PRESETS["tiny"]
    with contextlib.redirect_stdout(io.StringIO()):
        prefix, heldout, vocab = prepare_data(run_tool, str(workdir), preset, workers=1)
    built = sorted(p.relative_to(workdir) for p in workdir.rglob("*") if p.is_file())  # not later caches
    return {"workdir": workdir, "files": built, "prefix": prefix, "heldout": heldout, "vocab": vocab,
            "preset": preset}


def seed_masked_workdir(data: dict, preset, workdir: Path) -> None:
    """Put the session's steps 1-3 outputs into a quickstart's empty ``workdir`` when ``preset``
    builds the same files, so the quickstart reuses them (as its own second run would) and the test
    spends its time on training, evaluation and export. Building them fresh is the fixture's run."""
    assert not workdir.exists()
    if all(getattr(preset, f) == getattr(data["preset"], f) for f in _MASKED_DATA_FIELDS):
        for rel in data["files"]:
            (workdir / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(data["workdir"] / rel, workdir / rel)
