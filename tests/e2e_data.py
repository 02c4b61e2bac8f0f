"""Real preprocessed data for end-to-end tests, made once per test session (offline): a corpus of
standard-library docstrings, a byte-level BPE trained on it, and .bin/.idx from preprocess_data."""
from __future__ import annotations

import contextlib
import dataclasses
import io
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def make_e2e_data(workdir: Path, corpus_mb: float = 1.0, vocab_size: int = 1024) -> dict:
    from megatron_ds.cli.quickstart_gpt import PRESETS, prepare_data

    preset = dataclasses.replace(PRESETS["cpu"], corpus_mb=corpus_mb, vocab=vocab_size)
    with contextlib.redirect_stdout(io.StringIO()):
        prefix, vocab, merges, _, _ = prepare_data(str(workdir), preset, workers=2)
    return {"prefix": prefix, "vocab": vocab, "merges": merges}
