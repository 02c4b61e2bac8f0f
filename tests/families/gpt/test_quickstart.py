"""The quickstart end to end at its tiny size: every artefact it promises exists and is sound, and a
second run reuses them (no training) and still evaluates and generates."""
from __future__ import annotations

import json

import numpy as np
import pytest

from megatron_ds.data.indexed_dataset import MMapIndexedDataset

pytestmark = pytest.mark.timeout(900)


def test_quickstart_tiny_builds_every_artefact_and_reuses_them(tmp_path, capsys):
    from megatron_ds.cli.quickstart import main
    from megatron_ds.families.gpt.gpt_quickstart import PRESETS, PROMPTS

    preset = PRESETS["tiny"]
    work = tmp_path / "qs"
    assert main(["--workdir", str(work), "--size", "tiny"]) == 0
    first = capsys.readouterr().out

    vocab = json.load(open(work / "tokenizer" / "vocab.json"))
    assert len(vocab) == preset.vocab and (work / "tokenizer" / "merges.txt").stat().st_size > 0
    ds = MMapIndexedDataset(str(work / "data" / "corpus_text_document"))
    tokens = np.concatenate([ds[i] for i in range(len(ds))])
    assert len(ds) > 10 and tokens.max() < preset.vocab
    assert (work / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == str(preset.iters)
    assert (work / "checkpoints" / f"global_step{preset.iters}").is_dir()
    assert " iteration" in (work / "train.log").read_text() and "loaded checkpoint" in (work / "resume.log").read_text()

    evaluation = json.load(open(work / "evaluation.json"))
    (ppl,) = evaluation["perplexity"].values()
    assert ppl["scored_tokens"] > 100 and 1 < ppl["perplexity"] < preset.vocab * 2  # a number, not inf/nan
    (lam,) = evaluation["lambada"].values()
    assert lam["samples"] > 0 and 0 <= lam["accuracy"] <= 1

    results = [json.loads(line) for line in open(work / "generated.jsonl")]
    assert [r["prompt"] for r in results] == PROMPTS
    for r in results:  # --no-stop-at-eod: exactly the requested number of new tokens, and some text
        assert r["new_tokens"] == preset.new_tokens and r["generated"].strip()
        assert r["generated"] in first  # printed

    assert main(["--workdir", str(work), "--size", "tiny"]) == 0
    second = capsys.readouterr().out
    assert second.count("reusing") >= 5  # corpus, tokenizer, data, both training stages
    assert "pretrain_gpt.py" not in second
    assert "tokens/s" in second and "where everything is" in second
