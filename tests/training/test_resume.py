"""Resume is exact: 10 steps straight == 5 steps, save, fresh processes, load, 5 more steps.

Bitwise (==) on CPU fp32: the same operations run in the same order on the same numbers, so any
difference means state was lost -- weights, Adam moments, LR schedule step, consumed samples
(data position) or RNG streams. Dropout is on, so the RNG states must be restored too.
"""
import json
import os

import pytest

from tests.distributed import run_distributed
from tests.training.common import TINY_GPT, train_losses

RUN = TINY_GPT + ["--train-iters", "10", "--global-batch-size", "8", "--hidden-dropout", "0.1",
                  "--attention-dropout", "0.1"]


def _run(world, argv):
    return run_distributed(train_losses, world, argv, timeout=600)[-1]


@pytest.mark.parametrize("name,world,extra", [
    ("pp1", 1, []),
    ("zero1_dp2", 2, ["--zero-stage", "1"]),
    ("pp2", 2, ["--pipeline-model-parallel-size", "2"]),
    ("bf16_pp2", 2, ["--bf16", "--pipeline-model-parallel-size", "2"]),
])
def test_resume_equals_straight_run(tmp_path, name, world, extra):
    straight = _run(world, RUN + extra)
    ckpt = str(tmp_path / "ckpt")
    first = _run(world, RUN + extra + ["--save", ckpt, "--save-interval", "100", "--exit-interval", "5"])
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read() == "5"
    meta = json.load(open(os.path.join(ckpt, "global_step5", "megatron_ds_config.json")))
    assert meta["signature"]["num_layers"] == 4
    second = _run(world, RUN + extra + ["--load", ckpt])
    assert [it for it, _ in first] == [1, 2, 3, 4, 5]
    assert [it for it, _ in second] == [6, 7, 8, 9, 10]
    assert first + second == straight


def test_load_with_other_shape_fails_fast(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    _run(1, RUN + ["--train-iters", "1", "--save", ckpt])
    with pytest.raises(Exception, match=r"num_layers: checkpoint 4 vs now 2; hidden_size: checkpoint 64 vs now 32"):
        _run(1, RUN + ["--load", ckpt, "--num-layers", "2", "--hidden-size", "32"])
