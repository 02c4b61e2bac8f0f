"""The T5 quickstart end to end at its tiny size (tools/quickstart.py --model t5): WordPiece
vocabulary, --split-sentences data, pretrain_t5.py on 2 processes as a pipeline split at rank 1 with
falling loss, the resumed run, span-prediction evaluation on held-out modules, and an export whose
tokenizer numbers text (and the T5 sentinels) as training did."""
from __future__ import annotations

import json
import math

import pytest

from tests.e2e_data import seed_masked_workdir

pytestmark = pytest.mark.timeout(900)


def test_quickstart_t5_tiny(tmp_path, capsys, masked_tiny_data):
    from megatron_ds.cli.quickstart import main
    from megatron_ds.families.t5.t5_quickstart import T5_PRESETS

    preset = T5_PRESETS["tiny"]
    work = tmp_path / "qs"
    seed_masked_workdir(masked_tiny_data, preset, work)  # BERT's tiny data: steps 1-3 built once per session
    assert main(["--model", "t5", "--workdir", str(work), "--size", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "--pipeline-model-parallel-split-rank 1" in out
    losses = [float(line.split("lm loss: ")[1].split(" ")[0]) for line in out.splitlines()
              if line.startswith(" iteration")]
    assert len(losses) == preset.iters and losses[-1] < losses[0]  # it learns
    assert "loaded checkpoint" in (work / "resume.log").read_text()
    ev = json.load(open(work / "evaluation.json"))
    assert ev["target_tokens"] > 0 and math.isfinite(ev["span_loss"]) and 0 <= ev["accuracy"] <= 1

    transformers = pytest.importorskip("transformers")
    from megatron_ds.config.schema import DataConfig
    from megatron_ds.data.tokenizer import build_tokenizer_for

    ours = build_tokenizer_for(DataConfig(tokenizer_type="BertWordPieceLowerCase",
                                          vocab_file=str(work / "tokenizer" / "vocab.txt")),
                               vocab_extra_ids=100, log=lambda *a: None)
    theirs = transformers.AutoTokenizer.from_pretrained(str(work / "hf"))
    text = "Return a new Counter with the default value; raise ValueError if the key is missing."
    assert theirs(text, add_special_tokens=False)["input_ids"] == ours.tokenize(text)
    sentinels = [f"<extra_id_{i}>" for i in (0, 99)]
    assert theirs.convert_tokens_to_ids(sentinels) == [ours.additional_special_tokens_ids[i] for i in (0, 99)]
    assert transformers.T5ForConditionalGeneration.from_pretrained(str(work / "hf")).config.vocab_size == ours.vocab_size
