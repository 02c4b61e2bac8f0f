"""fp16 ZeRO-0 checkpoints move between layouts on one GPU (fp16 needs CUDA: DeepSpeed's loss
scaling does not run on the CPU; tests/checkpoint/test_reshard_plain.py covers the file formats on
the CPU).

- fp16 saved by the pipeline engine and resumed on the plain engine (``--no-pipeline-parallel``):
  another layout, so the checkpoint is resharded -- the fp16 optimizer's fp32 masters, Adam
  moments, step and dynamic loss scale read by name and written into the new run's fp16
  optimizer. The resumed steps must equal the straight run's (RUN_TO_RUN: GPU kernels are not
  bitwise reproducible between processes) and so must the loss scale: a fresh scaler would restart
  at 2^20 and skip steps again.
- bf16 (DeepSpeed's bf16 optimizer) resumed into fp16 ZeRO-0: the other direction; fp16 and bf16
  round differently, so the losses are compared as test_gpu_training.py compares optimizers
  (3%), and the resumed run must not skip a step at the carried-over scale it starts from.
"""
import pytest

from tests.gpu.helpers import RUN_TO_RUN, SHAPE, data_flags, run_cli

pytestmark = pytest.mark.gpu

ITERS = 12
FP16 = ["--fp16", "--initial-loss-scale", "1048576"]


def _train(data, *extra):
    return run_cli(SHAPE + data_flags(data) + ["--train-iters", str(ITERS), *extra])


def _close(a, b, tol):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) <= tol["atol"] + tol["rtol"] * abs(y), (i, x, y, a, b)


def test_fp16_zero0_resumes_on_the_plain_engine(e2e_data, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    straight = _train(e2e_data, *FP16, "--save", ckpt, "--save-interval", "6")
    with open(f"{ckpt}/latest_checkpointed_iteration.txt", "w") as f:
        f.write("6")
    resumed = _train(e2e_data, *FP16, "--no-pipeline-parallel", "--load", ckpt)
    assert "resharded from" in resumed["stdout"]
    assert [x["iteration"] for x in resumed["lines"]] == list(range(7, ITERS + 1))
    _close(resumed["losses"], straight["losses"][6:], RUN_TO_RUN)
    assert [x["loss scale"] for x in resumed["lines"]] == [x["loss scale"] for x in straight["lines"][6:]]


def test_bf16_resumes_into_fp16_zero0(e2e_data, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    straight = _train(e2e_data, "--bf16", "--save", ckpt, "--save-interval", "6")
    with open(f"{ckpt}/latest_checkpointed_iteration.txt", "w") as f:
        f.write("6")
    # 2^12: far below an overflow for gradients of this size, so no step of the resumed run is skipped
    resumed = _train(e2e_data, "--fp16", "--initial-loss-scale", "4096", "--load", ckpt)
    assert "resharded from" in resumed["stdout"]
    assert [x["iteration"] for x in resumed["lines"]] == list(range(7, ITERS + 1))
    assert sum(x["number of skipped iterations"] for x in resumed["lines"]) == 0
    _close(resumed["losses"], straight["losses"][6:], dict(rtol=3e-2, atol=0.0))
