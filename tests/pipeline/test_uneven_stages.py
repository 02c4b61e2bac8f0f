"""Uneven pipeline stages train as the single-process model does, and their checkpoints reshard.

A 5-layer GPT, fp32, dropout off (its streams depend on the layout), trained 6 steps:
- at PP 1 in one process (the reference, saving at step 6);
- at PP 2 by Megatron-DeepSpeed's --pp-partition-method type:transformer: DeepSpeed's balance of the 5
  transformer layers puts 3 on the first stage and 2 on the second (BLOOM's run used the same flag),
  saving at steps 3 and 6;
- at PP 3 by Megatron-LM's --decoder-first-pipeline-num-layers 1: 1 layer first, the other 4 split over
  the 2 remaining stages (transformer_layer.py get_transformer_layer_offset);
- on the interleaved schedule at PP 2 with 3 chunks per rank by Megatron-LM's
  --account-for-embedding-in-pipeline-split: (5 + 1) / 2 = 3 per rank, 1 per chunk, the embedding taking the
  first chunk's place: rank 0 holds the embedding, layers 1 and 3; rank 1 layers 0, 2 and 4 and the output layer;
- from the PP 2 run's step-3 checkpoint at PP 1: DeepSpeed's layer files are per global layer index,
  so the 3 + 2 split loads into one stage and continues to the reference's steps 4-6 and final weights;
  and at PP 2 split 2 + 3, where each stage's saved optimizer state is of other layers (resharded: the
  checkpoint's signature records uneven stages' layers).

Tolerances as tests/checkpoint/test_reshard.py's fp32 case: the layouts sum the same numbers in other
orders (~1e-7 relative per op); losses within 2e-5 relative after a few AdamW steps, weights far below
atol 1e-6 (lr x relative gradient error per step).
"""
import os

import pytest
import torch

from tests.distributed import run_distributed
from tests.training.common import TINY_GPT, train_losses
from megatron_ds.families.gpt.gpt_family import GPT

RUN = TINY_GPT + ["--num-layers", "5", "--global-batch-size", "4", "--hidden-dropout", "0",
                  "--attention-dropout", "0", "--train-iters", "6", "--adam-eps", "1e-4"]
LOSS = dict(rel=2e-5)
WEIGHTS = dict(rtol=1e-5, atol=1e-6)


def _losses_and_parts(rank, world_size, argv):
    """``train_losses``, and the first layer of each stage of the DeepSpeed PipelineModule the run built
    (``PipelineModule.parts``: spec 0 the embedding, 1-5 the transformer layers, 6 the final norm, 7 the output
    layer; None: no PipelineModule)."""
    from megatron_ds.model.pipeline_model import PipelineModel

    parts, init = [], PipelineModel.__init__

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        parts.append(list(self.parts))

    PipelineModel.__init__ = recording_init
    try:
        return train_losses(rank, world_size, argv), parts[0] if parts else None
    finally:
        PipelineModel.__init__ = init


def _train(world, *extra, parts=None):
    out = run_distributed(_losses_and_parts, world, RUN + list(extra), timeout=300)
    if parts is not None:
        assert [p for _, p in out] == [parts] * world
    return out[-1][0]


def _weights(path, iteration=None):
    from megatron_ds.checkpoint import load_consolidated

    return load_consolidated(path, iteration, log=lambda *a: None, family=GPT).state_dict


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("pp1"))
    return _train(1, "--save", ckpt, "--save-interval", "6"), ckpt


@pytest.fixture(scope="module")
def pp2_three_two(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("pp2"))
    losses = _train(2, "--pipeline-model-parallel-size", "2", "--pp-partition-method", "type:transformer",
                    "--save", ckpt, "--save-interval", "3", parts=[0, 4, 8])
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("3")  # resume from the middle of the run
    return losses, ckpt


def test_pp2_three_and_two_layers_trains_as_one_process(reference, pp2_three_two):
    want, _ = reference
    got, _ = pp2_three_two
    assert [it for it, _ in got] == list(range(1, 7))
    assert [loss for _, loss in got] == pytest.approx([loss for _, loss in want], **LOSS)


def test_megatron_lm_first_stage_layers_train_as_one_process(reference):
    want, _ = reference
    got = _train(3, "--pipeline-model-parallel-size", "3", "--decoder-first-pipeline-num-layers", "1",
                 parts=[0, 2, 4, 8])
    assert [loss for _, loss in got] == pytest.approx([loss for _, loss in want], **LOSS)


def test_interleaved_chunks_with_the_embedding_accounted_for_train_as_one_process(reference):
    want, _ = reference
    got = _train(2, "--pipeline-model-parallel-size", "2", "--account-for-embedding-in-pipeline-split",
                 "--num-virtual-stages-per-pipeline-rank", "3")
    assert [loss for _, loss in got] == pytest.approx([loss for _, loss in want], **LOSS)


def test_uneven_checkpoint_resumes_at_another_split_of_as_many_stages(reference, pp2_three_two):
    """The 3 + 2 checkpoint at 2 + 3 (--decoder-first-pipeline-num-layers 2): the same TP, PP and DP, but each
    stage's optimizer state belongs to other layers, so the checkpoint must be resharded, not loaded as it is."""
    (want, _), (_, ckpt) = reference, pp2_three_two
    resumed = _train(2, "--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "2",
                     "--load", ckpt, parts=[0, 3, 8])
    assert [it for it, _ in resumed] == [4, 5, 6]
    assert [loss for _, loss in resumed] == pytest.approx([loss for _, loss in want[3:]], **LOSS)


def test_uneven_checkpoint_resumes_in_one_stage(reference, pp2_three_two, tmp_path):
    (want, want_ckpt), (_, ckpt) = reference, pp2_three_two
    out = str(tmp_path / "resumed")
    resumed = _train(1, "--load", ckpt, "--save", out)
    assert [it for it, _ in resumed] == [4, 5, 6]
    assert [loss for _, loss in resumed] == pytest.approx([loss for _, loss in want[3:]], **LOSS)
    expected, got = _weights(want_ckpt), _weights(out)
    assert sorted(expected) == sorted(got)
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, **WEIGHTS, msg=lambda m, name=name: f"{name}: {m}")
