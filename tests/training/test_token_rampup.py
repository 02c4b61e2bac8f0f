"""Token-based training and batch-size ramp-up, trained end to end on CPU, with resume.

Expected values are hand-computed from Megatron-DeepSpeed's rules, not read back from the code:
* ramp-up (megatron/microbatches.py RampupBatchsizeNumMicroBatches): --rampup-batch-size 2 2 12 with
  --global-batch-size 6 has (6-2)/2 = 2 increments of 12/2 = 6 samples; the batch at consumed samples
  c is 2 + 2*int(c/6) while c <= 12, then 6. Consumed 0,2,4 -> 2; 6,10 -> 4; 14,20,... -> 6.
* iterations of the --train-samples 40 run (megatron/training.py update_train_iters): the ramp loop
  runs while c <= 12: 5 iterations reaching c = 14, then (40-14)//6 = 4 more: 9.
* --train-tokens 480 at seq 16 (30 samples): consumed samples 2,4,6,10,14,20,26,32 -> the run ends
  after iteration 8 (26*16 = 416 < 480 <= 32*16 = 512), before the 9-iteration cap.
* LR (megatron/optimizer_param_scheduler.py get_lr with token warmup/decay, stepped with the tokens
  consumed before the step): warmup 64 tokens, linear decay to 400 tokens.
"""
from __future__ import annotations

import re

import pytest

from tests.distributed import run_distributed
from tests.training.common import TINY_GPT

RAMP = TINY_GPT + ["--seq-length", "16", "--train-samples", "40", "--rampup-batch-size", "2", "2", "12",
                   "--global-batch-size", "6", "--lr-warmup-iters", "0", "--lr-decay-style", "linear",
                   "--min-lr", "1e-4", "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
TOKENS = ["--train-tokens", "480", "--lr-warmup-tokens", "64", "--lr-decay-tokens", "400"]
EXPECTED_BATCHES = [2, 2, 2, 4, 4, 6, 6, 6, 6]
LINE = re.compile(r"iteration +(\d+)/ +(\d+) \| consumed samples: +(\d+) \|(?: consumed tokens: +(\d+) \|)?"
                  r".*learning rate: ([0-9.E+-]+) \| global batch size: +(\d+) \| lm loss: ([0-9.E+-]+)")


def _train(rank, world_size, argv):
    import contextlib
    import io

    from megatron_ds.config import parse_args
    from megatron_ds.families import pretrain

    cfg, ignored = parse_args(argv)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        state = pretrain(cfg, ignored)
    return {"history": state.history, "tokens": state.consumed_train_tokens, "log": out.getvalue()}


def _run(argv, world=1):
    result = run_distributed(_train, world, argv, timeout=600)[-1]
    rows = [m.groups() for m in LINE.finditer(result["log"])]
    result["rows"] = [(int(it), int(total), int(samples), int(tok) if tok else None, float(lr), int(gbs))
                      for it, total, samples, tok, lr, gbs, _ in rows]
    return result


def _expected_lr(tokens_before: int, max_lr=1e-3, min_lr=1e-4, warmup=64, decay=400) -> float:
    if tokens_before <= warmup:
        return max_lr * tokens_before / warmup
    if tokens_before > decay:
        return min_lr
    return min_lr + (1 - (tokens_before - warmup) / (decay - warmup)) * (max_lr - min_lr)


def test_train_tokens_with_rampup_token_lr_and_resume_mid_ramp(tmp_path):
    straight = _run(RAMP + TOKENS)
    rows = straight["rows"]
    batches = EXPECTED_BATCHES[:8]
    samples = [sum(batches[:i + 1]) for i in range(8)]
    assert [r[0] for r in rows] == list(range(1, 9))  # stopped by tokens, not by the 9-iteration cap
    assert [r[2] for r in rows] == samples and [r[3] for r in rows] == [16 * s for s in samples]
    assert straight["tokens"] == 512
    tokens_before = [0] + [16 * s for s in samples[:-1]]
    for row, before in zip(rows, tokens_before):
        # the line prints 4 significant digits (%.3E): compare at that precision
        assert row[4] == pytest.approx(_expected_lr(before), rel=1e-3, abs=1e-9), row

    ckpt = str(tmp_path / "ckpt")
    first = _run(RAMP + TOKENS + ["--save", ckpt, "--save-interval", "100", "--exit-interval", "4"])
    second = _run(RAMP + TOKENS + ["--load", ckpt, "--save", ckpt, "--save-interval", "100"])
    # exact on CPU fp32: same operations on the same numbers; any lost state (consumed samples or
    # tokens, ramp position, LR schedule's token count, RNG) changes a loss or a printed field
    assert first["history"] + second["history"] == straight["history"]
    assert first["rows"] + second["rows"] == rows
    assert [r[1] for r in rows] == [9] * 8  # the line's total is the --train-samples cap (update_train_iters)
    assert second["tokens"] == 512


def test_rampup_on_the_plain_engine_matches_the_pipeline_engine():
    pipe = _run(RAMP + ["--train-samples", "20"])
    plain = _run(RAMP + ["--train-samples", "20", "--no-pipeline-parallel"])
    # update_train_iters: 5 ramp iterations reach 14 samples, then (20-14)//6 = 1 more
    assert [r[5] for r in plain["rows"]] == [r[5] for r in pipe["rows"]] == EXPECTED_BATCHES[:6]
    assert [r[2] for r in pipe["rows"]] == [2, 4, 6, 10, 14, 20]  # consumed samples
    assert pipe["rows"][0][3] is None  # no token flags: Megatron's line without the token field
    # same model, data and order; the two engines accumulate micro-batch gradients in a different
    # order, so fp32 rounding differs slightly
    for (_, a), (_, b) in zip(pipe["history"], plain["history"]):
        assert a == pytest.approx(b, rel=1e-4)


def test_megatron_lm_step_batch_size_schedule_trains_its_sizes_and_resumes(tmp_path):
    # Megatron-LM's StepBatchsizeNumMicroBatchesCalculator (core_v0.19.0): "0:2 128:4 0.32K:6" at seq 16 is
    # batch 2 from 0 samples, 4 from 128/16 = 8, 6 from 320/16 = 20; update_train_iters runs while consumed < 30:
    # consumed 0,2,4,6 -> 2; 8,12,16 -> 4; 20,26 -> 6; 32 >= 30: 9 iterations. Split into words as an unquoted
    # array expansion passes it (NVIDIA's examples/gpt3 script); quoted, the same.
    base = TINY_GPT + ["--seq-length", "16", "--train-samples", "30", "--lr-warmup-iters", "0",
                       "--lr-decay-style", "linear", "--min-lr", "1e-4"]
    steps = ["--step-batch-size-schedule", "0:2", "128:4", "0.32K:6"]
    straight = _run(base + steps)
    assert [r[5] for r in straight["rows"]] == [2, 2, 2, 2, 4, 4, 4, 6, 6]
    assert [r[2] for r in straight["rows"]] == [2, 4, 6, 8, 12, 16, 20, 26, 32]
    assert [r[1] for r in straight["rows"]] == [9] * 9
    ckpt = str(tmp_path / "ckpt")
    quoted = ["--step-batch-size-schedule", "0:2 128:4 0.32K:6"]
    first = _run(base + quoted + ["--save", ckpt, "--save-interval", "100", "--exit-interval", "5"])
    second = _run(base + quoted + ["--load", ckpt, "--save", ckpt, "--save-interval", "100"])
    assert first["history"] + second["history"] == straight["history"]
    assert first["rows"] + second["rows"] == straight["rows"]
