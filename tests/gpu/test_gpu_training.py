"""The real pretrain_gpt.py on one GPU: bf16 and fp16 (dynamic loss scale), recompute, Llama
options, ZeRO-2/3 on the plain engine, save/resume, all on real .bin/.idx data read by two
pinned-memory loader workers. A 4-layer model: about 15-30 s per run, mostly start-up.

Runs that share flags are made once per module (the bf16 run is the reference of several tests).
"""
import json
import math

import pytest

from tests.gpu.helpers import RUN_TO_RUN, SHAPE, data_flags, run_cli, startup_device
from tests.training.common import LLAMA_FLAGS

pytestmark = pytest.mark.gpu

ITERS = 12
_RUNS: dict = {}


def _train(data, *extra, iters=ITERS):
    argv = SHAPE + data_flags(data) + ["--train-iters", str(iters), *extra]
    key = tuple(argv)
    if key not in _RUNS:
        _RUNS[key] = run_cli(argv)
    return _RUNS[key]


def _learns(run, iters=ITERS, margin=0.3):
    """Every step logged, losses finite, and real text learned: the last losses clearly below the
    first (a 1024-token BPE vocabulary starts near ln 1024 = 6.9; the corpus is English text)."""
    losses = run["losses"]
    assert [x["iteration"] for x in run["lines"]] == list(range(1, iters + 1))
    assert all(loss is not None and math.isfinite(loss) for loss in losses), losses
    assert sum(losses[-3:]) / 3 < losses[0] - margin, losses


def _close(a, b, tol=RUN_TO_RUN):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) <= tol["atol"] + tol["rtol"] * abs(y), (i + 1, x, y, a, b)


def test_bf16_trains_on_the_gpu(e2e_data):
    run = _train(e2e_data, "--bf16")
    assert startup_device(run["stdout"]) == "cuda"
    _learns(run)
    last = run["lines"][-1]
    assert last["number of skipped iterations"] == 0  # bf16 has no loss scale to overflow
    assert last["TFLOP/s per GPU"] > 0 and last["peak memory (GB)"] > 0


def test_fp16_dynamic_loss_scale_skips_and_counts_overflow_steps(e2e_data, tmp_path):
    """An initial scale of 2^32 (the JSON's initial_scale_power; --initial-loss-scale has no effect
    under DeepSpeed, whose own default is 2^16) overflows fp16 gradients: those steps are skipped,
    counted in the iteration line, and the scale halves per overflow (the ZeRO-0 fp16 optimizers
    have no hysteresis) until steps go through: about 15 steps for gradients of this size, so the
    run is 40 steps long (steps are cheap; start-up dominates). The CPU counterpart, with the loss
    scale checked in backward, is tests/training/test_fp16.py."""
    config = tmp_path / "fp16.json"
    config.write_text(json.dumps({"fp16": {"enabled": True, "initial_scale_power": 32, "loss_scale_window": 1000}}))
    run = _train(e2e_data, "--fp16", "--deepspeed_config", str(config), iters=40)
    assert startup_device(run["stdout"]) == "cuda"
    skipped = sum(x["number of skipped iterations"] for x in run["lines"])
    scales = [x["loss scale"] for x in run["lines"]]
    assert 1 <= skipped < 30 and scales[-1] < 2.0 ** 32, (skipped, scales)
    assert scales == sorted(scales, reverse=True)  # only overflows move it within 40 steps (window 1000)
    _learns(run, iters=40, margin=0.2)  # fewer real steps than bf16's: the skipped ones did not update


def test_layers_are_compiled_by_default_and_train_as_eager_ones(e2e_data):
    """Regional compilation is the CUDA default: the kernels line says so, and the losses follow the
    eager layers' (no dropout here; inductor's bf16 fusions round differently, within run-to-run)."""
    compiled = _train(e2e_data, "--bf16")
    eager = _train(e2e_data, "--bf16", "--no-compile-layers")
    assert "transformer layers: each compiled with torch.compile" in compiled["stdout"]
    assert "transformer layers: eager" in eager["stdout"]
    assert "torch.compile of transformer" not in compiled["stderr"]  # no fallback to eager
    _close(compiled["losses"], eager["losses"], dict(rtol=2e-2, atol=0.0))


@pytest.mark.parametrize("flags", [["--recompute-granularity", "selective"], ["--checkpoint-activations"]],
                         ids=["selective", "full"])
def test_recompute_gives_the_same_losses(e2e_data, flags):
    plain = _train(e2e_data, "--bf16")
    recomputed = _train(e2e_data, "--bf16", *flags)
    _close(recomputed["losses"], plain["losses"])


def test_llama_options(e2e_data):
    run = _train(e2e_data, "--bf16", "--checkpoint-activations", *LLAMA_FLAGS)
    _learns(run)


@pytest.mark.parametrize("stage", ["2", "3"])
def test_zero_on_the_plain_engine(e2e_data, stage):
    """--no-pipeline-parallel with ZeRO-2/3 trains the same model as the pipeline engine's run.
    The optimizers differ in where bf16 gradients are accumulated and reduced (DeepSpeed's bf16
    optimizer vs ZeRO's), a few bf16 roundings per step: 3% of the loss covers that, while a
    wrong model, data order or LR schedule is off by far more after 12 steps."""
    run = _train(e2e_data, "--bf16", "--no-pipeline-parallel", "--zero-stage", stage)
    _learns(run)
    _close(run["losses"], _train(e2e_data, "--bf16")["losses"], dict(rtol=3e-2, atol=0.0))


# fp16 starts at 2^20 here: a few overflow steps early on, then real updates in both halves
@pytest.mark.parametrize("precision", [["--bf16"], ["--fp16", "--initial-loss-scale", "1048576"]],
                         ids=["bf16", "fp16"])
def test_resume_equals_the_straight_run(e2e_data, tmp_path, precision):
    straight = _train(e2e_data, *precision)
    ckpt = str(tmp_path / "ckpt")
    first = _train(e2e_data, *precision, "--save", ckpt, "--save-interval", "100", "--exit-interval", "6")
    second = _train(e2e_data, *precision, "--load", ckpt)
    assert [x["iteration"] for x in first["lines"]] == list(range(1, 7))
    assert [x["iteration"] for x in second["lines"]] == list(range(7, ITERS + 1))
    _close(first["losses"] + second["losses"], straight["losses"])
    # the loss scaler's state came back too: a fresh one would restart at 2^32 and skip again
    assert [x["loss scale"] for x in second["lines"]] == [x["loss scale"] for x in straight["lines"][6:]]
