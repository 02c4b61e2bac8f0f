"""The quickstart end to end at its tiny size: every artefact it promises exists and is sound, and a
second run reuses them (no training) and still evaluates and generates."""
from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
import torch

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
    # a CPU run compiles nothing: DeepSpeed's inference-only shared-memory op is not built (it logged
    # "DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully" once per rank)
    assert "deepspeed_shm_comm" not in (work / "train.log").read_text()
    steps = ("1. corpus", "2. tokenizer", "3. preprocess", "4. train", "5. resume", "6. evaluate", "7. generate")
    assert_step_times(first, steps)

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
    assert_step_times(second, steps)


def assert_step_times(out: str, steps: tuple[str, ...]) -> None:
    """Each step's time when it ends, then the table of them all with the total."""
    ended = re.findall(r"^\[(\d\. \w+): \d+\.\d s\]$", out, re.M)
    assert tuple(ended) == steps
    table = out[out.index("\ntime per step:\n"):].splitlines()[2:len(steps) + 3]
    assert [row.rsplit(None, 2)[0].strip() for row in table] == [*steps, "total"]


def test_stage_clock_prints_each_step_when_it_ends_and_a_table(capsys):
    from megatron_ds.families.quickstart_steps import step, timed_stages

    now = [100.0]
    with timed_stages(clock=lambda: now[0]):
        now[0] += 0.5  # before the first step: counted in the total only
        step("1. corpus")
        now[0] += 2.0
        step("4. train 280 iterations (2 processes, tensor parallel 1, pipeline parallel 2, fp32)")
        now[0] += 95.3
        step("7. export to Hugging Face transformers")
        now[0] += 3.0
    out = capsys.readouterr().out
    assert out.index("[1. corpus: 2.0 s]") < out.index("=== 4. train 280") < out.index("[4. train: 95.3 s]")
    assert out.rstrip().endswith("time per step:\n  1. corpus     2.0 s\n  4. train     95.3 s\n"
                                 "  7. export     3.0 s\n  total       100.8 s")

    with pytest.raises(SystemExit), timed_stages(clock=lambda: now[0]):
        step("4. train")
        raise SystemExit("training failed")
    step("6. evaluate")  # outside a timed block: the title alone
    out = capsys.readouterr().out
    assert "time per step" not in out and "[4. train" not in out and out.endswith("=== 6. evaluate\n")


@pytest.mark.skipif(torch.cuda.is_available(), reason="names the CPU only where no GPU is visible")
def test_quickstart_names_the_cpu_to_deepspeed(monkeypatch):
    """Left to detect the CPU itself, DeepSpeed logs "Setting accelerator to CPU. If you have GPU or other
    accelerator, we were unable to detect it." in the middle of the quickstart's output."""
    from megatron_ds.families.quickstart_steps import cpu_named_to_deepspeed

    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    cpu_named_to_deepspeed()
    assert os.environ["DS_ACCELERATOR"] == "cpu"
