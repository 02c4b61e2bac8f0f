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
    # saved in the background (Megatron-LM's --async-save), waited for at the exit: DeepSpeed's bf16 ZeRO-1
    # optimizer, whose fp32 partitions are views of flat buffers, copied while training waits
    ("bf16_zero1_dp2_async_save", 2, ["--bf16", "--zero-stage", "1", "--async-save", "--use-persistent-ckpt-worker"]),
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


def test_resubmitting_a_finished_run_is_harmless(tmp_path):
    """The last job of a chain finds the run complete: no training, no sampler running dry."""
    ckpt = str(tmp_path / "ckpt")
    _run(1, RUN + ["--train-iters", "2", "--save", ckpt])
    assert _run(1, RUN + ["--train-iters", "2", "--load", ckpt, "--save", ckpt]) == []
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read() == "2"


def test_load_with_other_shape_fails_fast(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    _run(1, RUN + ["--train-iters", "1", "--save", ckpt])
    with pytest.raises(Exception, match=r"num_layers: checkpoint 4 vs now 2; hidden_size: checkpoint 64 vs now 32"):
        _run(1, RUN + ["--load", ckpt, "--num-layers", "2", "--hidden-size", "32"])


def _crash_in_second_save(rank, world_size, argv):
    """Like train_losses, but DeepSpeed dies half-way through writing global_step4."""
    import deepspeed

    from tests.training.common import train_losses

    original = deepspeed.DeepSpeedEngine.save_checkpoint

    def dying_save(self, save_dir, tag=None, **kwargs):
        if tag == "global_step4":
            os.makedirs(os.path.join(save_dir, tag), exist_ok=True)
            with open(os.path.join(save_dir, tag, "mp_rank_00_model_states.pt"), "wb") as f:
                f.write(b"half a file")
            raise RuntimeError("node lost during save")
        return original(self, save_dir, tag=tag, **kwargs)

    deepspeed.DeepSpeedEngine.save_checkpoint = dying_save
    try:
        train_losses(rank, world_size, argv)
    except RuntimeError as exc:
        return str(exc)
    return "no crash"


def test_crash_during_save_leaves_previous_checkpoint_loadable(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    argv = RUN + ["--train-iters", "6", "--save", ckpt, "--save-interval", "2"]
    assert run_distributed(_crash_in_second_save, 1, argv, timeout=300) == ["node lost during save"]
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read() == "2"
    assert open(os.path.join(ckpt, "latest")).read() == "global_step2"
    resumed = _run(1, RUN + ["--train-iters", "6", "--load", ckpt])
    assert [it for it, _ in resumed] == [3, 4, 5, 6]


def test_finetune_loads_weights_and_restarts_at_iteration_one(tmp_path):
    """--finetune; then Megatron-LM's --pretrained-checkpoint, continual pretraining's resubmittable job:
    the first job finds no checkpoint in --load and starts as --finetune from the pretrained one, the
    next resumes from what the first saved in --load -- together the uninterrupted --finetune run."""
    ckpt, run_dir = str(tmp_path / "ckpt"), str(tmp_path / "run")
    trained = _run(1, RUN + ["--save", ckpt])
    fresh = _run(1, RUN + ["--train-iters", "2"])
    tuned = _run(1, RUN + ["--train-iters", "3", "--load", ckpt, "--finetune"])
    assert [it for it, _ in tuned] == [1, 2, 3]
    # --finetune restarts the data at sample 0, which the loaded weights were trained on for 10 steps:
    # their loss there is clearly below a fresh model's (~0.2 nats here; run-to-run noise is 0)
    assert tuned[0][1] < fresh[0][1] - 0.05
    assert trained[0] == fresh[0]  # same seed, same first batch: the comparison is like for like

    # bf16 from the fp32 checkpoint, at its layout (DeepSpeed's loader) and at PP 2 (resharded): either way
    # DeepSpeed's bf16 optimizer's fp32 masters must take the loaded weights too, else its first step writes
    # the random initial weights back (measured: step 2's loss then 0.2 nats above, a fresh model's).
    # Dropout off: the two layouts draw other masks. bf16 rounding: within 5e-3 of fp32.
    finetune = RUN + ["--train-iters", "3", "--load", ckpt, "--finetune", "--hidden-dropout", "0",
                      "--attention-dropout", "0"]
    fp32 = _run(1, finetune)
    for bf16 in (_run(1, finetune + ["--bf16"]), _run(2, finetune + ["--bf16", "--pipeline-model-parallel-size", "2"])):
        assert [loss for _, loss in bf16] == pytest.approx([loss for _, loss in fp32], rel=5e-3)

    job = RUN + ["--train-iters", "3", "--load", run_dir, "--save", run_dir, "--pretrained-checkpoint", ckpt]
    first = _run(1, job + ["--exit-interval", "2"])
    assert open(os.path.join(run_dir, "latest_checkpointed_iteration.txt")).read() == "2"
    assert first + _run(1, job) == tuned


class _Payload:
    """Stands for an arbitrary pickled object (which could run code when unpickled)."""


def test_checkpoint_files_load_weights_only(tmp_path):
    import torch

    from megatron_ds.errors import ConfigError
    from megatron_ds.checkpoint.checkpointing import WeightsOnlyCheckpointEngine
    from megatron_ds.parallel.random import rng_state

    engine = WeightsOnlyCheckpointEngine()
    good = tmp_path / "good.pt"
    torch.save({"module": {"w": torch.ones(2)}, "rng": rng_state(), "iteration": 5}, good)
    assert engine.load(str(good))["iteration"] == 5  # our own client state passes weights_only
    bad = tmp_path / "bad.pt"
    torch.save({"module": {}, "extra": _Payload()}, bad)
    with pytest.raises(ConfigError, match="refusing to unpickle .*bad.pt"):
        engine.load(str(bad))
