"""A sequence-length warm-up trained end to end on CPU, on both of Megatron-DeepSpeed's paths.

The per-step lengths are checked against the transcription of DeepSpeed's CurriculumScheduler in
tests/config/test_curriculum.py; that the model really trained on the cut batches is checked by
step 1 of the warm-up (8 tokens) giving exactly the loss of a --seq-length 8 run on the same mock
samples (numpy's generator draws a sample's first 9 tokens identically for 9 or 33 of them).
"""
from __future__ import annotations

import json
import re

import pytest

from tests.config.test_curriculum import TranscribedScheduler
from tests.distributed import run_distributed
from tests.training.common import TINY_GPT
from tests.training.test_token_rampup import _train

BLOCK = {"enabled": True, "curriculum_type": "seqlen", "min_difficulty": 8, "max_difficulty": 32,
         "schedule_type": "fixed_linear", "schedule_config": {"total_curriculum_step": 4, "difficulty_step": 8}}
ITERS = 5
# no dropout: Megatron seeds it per pipeline stage, so PP 2 and PP 1 would draw different masks
ARGV = TINY_GPT + ["--train-iters", str(ITERS), "--eval-interval", "2", "--hidden-dropout", "0",
                   "--attention-dropout", "0"]
SEQLEN = re.compile(r"iteration +(\d+)/.*\| curriculum seqlen: +(\d+) \|")


def _run(tmp_path, argv, world, block=BLOCK):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"curriculum_learning": block} if block else {}))
    result = run_distributed(_train, world, argv + ["--deepspeed_config", str(path)], timeout=600)[-1]
    result["seqlens"] = [(int(it), int(n)) for it, n in SEQLEN.findall(result["log"])]
    return result


def test_warmup_lengths_tokens_and_cut_batches_on_both_engines(tmp_path):
    ref = TranscribedScheduler(BLOCK)
    expected = [ref.update(step) for step in range(1, ITERS + 1)]
    assert expected == [8, 16, 24, 32, 32]  # floor(8 + 24 n / 4) rounded down to 8
    pipe = _run(tmp_path, ARGV + ["--pipeline-model-parallel-size", "2"], 2)
    plain = _run(tmp_path, ARGV + ["--no-pipeline-parallel"], 1)
    for result in (pipe, plain):
        assert result["seqlens"] == list(enumerate(expected, start=1))
        assert result["tokens"] == 2 * sum(expected)  # micro 2 x DP 1 samples x the step's length
        # validation after steps 2 and 4, at the full length, between cut steps: the pipeline engine
        # must re-send activation shapes each time (a stale shape fails DeepSpeed's receive)
        assert result["log"].count("validation loss at iteration") >= 2
    # same model and samples; the engines accumulate in a different order (fp32 rounding)
    assert [a for _, a in pipe["history"]] == pytest.approx([b for _, b in plain["history"]], rel=1e-4)
    short = _run(tmp_path, ARGV + ["--no-pipeline-parallel", "--seq-length", "8", "--train-iters", "1"], 1,
                 block=None)
    assert short["history"][0] == plain["history"][0]  # step 1: exactly what an 8-token run trains


def test_evaluation_runs_at_the_full_length(tmp_path):
    """After one 8-token step, the final validation equals that of the same weights evaluated by a plain
    32-token run: an 8-token run's checkpoint, loaded with --skip-train (Megatron-DeepSpeed's evaluate
    resets curriculum_seqlen to --seq-length; the plain engine passes no curriculum_seqlen in eval)."""
    one_step = {**BLOCK, "schedule_type": "fixed_discrete", "schedule_config": {"difficulty": [8, 32], "max_step": [1]}}
    argv = ARGV + ["--no-pipeline-parallel", "--train-iters", "1"]
    warm = _run(tmp_path, argv, 1, block=one_step)
    ckpt = str(tmp_path / "ckpt")
    short = _run(tmp_path, argv + ["--seq-length", "8", "--save", ckpt], 1, block=None)
    full = _run(tmp_path, argv + ["--load", ckpt, "--skip-train"], 1, block=None)
    assert warm["history"][0] == short["history"][0]  # the same step, so the same weights
    value = re.compile(r"validation loss at iteration 1 on validation set \| lm loss value: (\S+)")
    assert value.findall(warm["log"]) == value.findall(full["log"]) != []
    assert value.findall(warm["log"]) != value.findall(short["log"])  # an 8-token evaluation differs
