"""Checkpoints of Megatron-LM's MoE layer (model/mlm_moe.py) with its experts split over expert parallel ranks
(checkpoint/stacked_experts.py), through the real entry point on 2 gloo processes (DP 2; 2 layers, hidden 32,
4 experts, top-2, SwiGLU, a shared expert, aux + z losses, all-to-all dispatch).

A run of 4 steps saves at step 2; runs resumed from step 2 at another (or the same) expert parallel size must
continue as the uninterrupted run: losses of steps 3-4, and the step-4 weights (read back by
``load_consolidated``: every expert under the EP 1 name and shape, the ranks' stacked tensors joined along the
expert dimension) and optimizer state (fp32 masters, Adam moments, step) equal the uninterrupted run's:

- EP 2 -> EP 2, EP 2 -> EP 1 and DP 2 x EP 2 -> TP 2 x EP 2 with sequence parallelism (the expert parallel
  group then spans the tensor parallel ranks, whose files each hold one rank's experts) under ZeRO-0
  (DeepSpeed's per expert parallel rank optimizer files);
- EP 2 -> TP 2 x ETP 2 (each expert's MLP split over the tensor parallel ranks), at EP 1 and, on 4 processes,
  at EP 2 (each (expert parallel, tensor parallel) rank's stacked experts file holds its part of its experts);
  their own step-4 checkpoints are read back merging the tensor parallel parts;
- EP 1 -> EP 2 under ZeRO 1 (--use-distributed-optimizer: each rank's experts' slice written into DeepSpeed's
  partitioned optimizer), whose own step-4 checkpoint at EP 2 is then read back from ZeRO shards partitioned
  over the expert data parallel groups;
- on 4 processes, 4 layers at PP 2 x DP 2 x EP 2 on the interleaved schedule (2 model chunks per rank, whose
  engine saves the chunks' parameter names: pipeline/chunks.py ``pipeline_name``) -> the same, -> EP 1
  interleaved, -> ZB-H1 at EP 2, -> 1F1B at EP 2, and -> TP 2 x ETP 2 with sequence parallelism, interleaved
  (whose own step-4 checkpoint is read back merging the tensor parallel parts).

Tolerances: fp32, another EP size sums the same numbers in another order (the experts' tokens travel through
all-to-alls, their gradients are reduced over other groups; tests/training/test_mlm_moe.py compares EP 2 with
EP 1 at rtol 2e-5): losses within 2e-5 relative, weights and optimizer state within rtol 1e-5 / atol 1e-6. A
lost expert parallel rank's experts (DeepSpeed's module file holds data parallel rank 0's only) or a lost Adam
moment moves the step-3 loss or the weights by far more. The checkpoint is complete only with every stacked
experts file in its manifest (a kill before the manifest leaves an interrupted save, tests/checkpoint/
test_integrity.py).
"""
import json
import os

import pytest
import torch

from tests.checkpoint.test_reshard import _optimizer_state
from tests.distributed import run_distributed
from tests.training.cli import SMALL_GPT
from tests.training.common import train_losses
from megatron_ds.checkpoint import load_consolidated
from megatron_ds.checkpoint.format import EXPERT_TENSOR_PARALLEL_SIZE, MANIFEST, read_meta
from megatron_ds.families.gpt.gpt_family import GPT

pytestmark = pytest.mark.timeout(900)
MOE = ("--num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 0.01 --moe-z-loss-coeff 0.001 --swiglu "
       "--disable-bias-linear --moe-shared-expert-intermediate-size 16 --hidden-dropout 0 --attention-dropout 0 "
       "--train-iters 4 --global-batch-size 8 --lr-warmup-iters 0 --lr 1e-2 --moe-token-dispatcher-type alltoall "
       "--save-interval 2").split()
LOSS = dict(rel=2e-5)
CLOSE = dict(rtol=1e-5, atol=1e-6)
ZERO1 = ["--use-distributed-optimizer"]
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
ETP2 = ["--expert-tensor-parallel-size", "2"]


def _ep(n):
    return ["--expert-model-parallel-size", str(n)]


def _run(argv, world=2):
    return run_distributed(train_losses, world, SMALL_GPT + MOE + argv, timeout=600)[-1]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{name: (losses of the uninterrupted run, its checkpoint folder)} of an EP 2 ZeRO-0 and an EP 1 ZeRO 1 run."""
    out = {}
    for name, flags in (("ep2", _ep(2)), ("ep1_zero1", _ep(1) + ZERO1)):
        ckpt = str(tmp_path_factory.mktemp(name))
        out[name] = (_run(flags + ["--save", ckpt]), ckpt)
    return out


def _resume(saved_run, flags, tmp_path, world=2):
    straight, ckpt = saved_run
    out = str(tmp_path / "resumed")
    got = _run(flags + ["--load", ckpt, "--ckpt-step", "2", "--save", out], world)
    assert [it for it, _ in got] == [3, 4]
    assert [loss for _, loss in got] == pytest.approx([loss for _, loss in straight[2:]], **LOSS)
    return ckpt, out


def _same_weights(want_dir, have_dir, layers=2):
    want, have = (load_consolidated(d, 4, family=GPT, log=lambda *a: None).state_dict for d in (want_dir, have_dir))
    assert sorted(want) == sorted(have)
    fc1 = [k for k in want if k.endswith("mlp.experts.linear_fc1.weight")]
    assert len(fc1) == layers and all(want[k].shape == (4, 2 * 64, 32) for k in fc1)  # all 4 experts (SwiGLU ffn 64)
    for key, tensor in want.items():
        torch.testing.assert_close(have[key], tensor, **CLOSE, msg=lambda m, key=key: f"{key}: {m}")


def _same_optimizer_state(want_dir, have_dir):
    (want, want_step), (have, have_step) = _optimizer_state(want_dir, 4), _optimizer_state(have_dir, 4)
    assert want_step == have_step == 4
    assert sorted(want) == sorted(have) and any(k.endswith("experts.linear_fc2.weight") for k in want)
    for name in want:
        for key, tensor in want[name].items():
            torch.testing.assert_close(have[name][key], tensor, **CLOSE, msg=lambda m, n=name, k=key: f"{n} {k}: {m}")


def test_ep2_checkpoint_holds_every_ranks_experts(saved):
    step = os.path.join(saved["ep2"][1], "global_step2")
    files = sorted(f for f in os.listdir(step) if f.startswith("stacked_experts_"))
    assert files == [f"stacked_experts_expp_rank_{r}_mp_rank_00_model_states.pt" for r in (0, 1)]
    manifest = json.load(open(os.path.join(step, MANIFEST)))
    assert all(f in json.dumps(manifest) for f in files)


@pytest.mark.parametrize("flags,world", [
    (_ep(2), 2), (_ep(1), 2), (TP2_SP + ["--expert-tensor-parallel-size", "1"] + _ep(2), 2), (TP2_SP + ETP2, 2),
    (TP2_SP + ETP2 + _ep(2), 4),
], ids=["ep2", "ep1", "tp2_sp_etp1_ep2", "tp2_sp_etp2", "tp2_sp_etp2_ep2"])
def test_ep2_resumes_at(saved, tmp_path, flags, world):
    ckpt, out = _resume(saved["ep2"], flags, tmp_path, world)
    _same_weights(ckpt, out)
    _same_optimizer_state(ckpt, out)


def test_ep1_zero1_resumes_at_ep2(saved, tmp_path):
    ckpt, out = _resume(saved["ep1_zero1"], _ep(2) + ZERO1, tmp_path)
    _same_weights(ckpt, out)
    _same_optimizer_state(ckpt, out)



PP2_4_LAYERS = ["--num-layers", "4", "--pipeline-model-parallel-size", "2"]
INTERLEAVED = ["--num-layers-per-virtual-pipeline-stage", "1"]


@pytest.fixture(scope="module")
def chunked(tmp_path_factory):
    """(losses, checkpoint folder) of an interleaved PP 2 x DP 2 x EP 2 run."""
    ckpt = str(tmp_path_factory.mktemp("interleaved_ep2"))
    return _run(PP2_4_LAYERS + INTERLEAVED + _ep(2) + ["--save", ckpt], world=4), ckpt


@pytest.mark.parametrize("flags", [INTERLEAVED + _ep(2), INTERLEAVED + _ep(1), ["--enable-zbh1-pipeline"] + _ep(2),
                                   _ep(2), INTERLEAVED + TP2_SP + ETP2],
                         ids=["interleaved_ep2", "interleaved_ep1", "zbh1_ep2", "1f1b_ep2", "interleaved_tp2_sp_etp2"])
def test_interleaved_ep2_resumes_at(chunked, tmp_path, flags):
    ckpt, out = _resume(chunked, PP2_4_LAYERS + flags, tmp_path, world=4)
    _same_weights(ckpt, out, layers=4)
    _same_optimizer_state(ckpt, out)


HEADS4 = ["--num-attention-heads", "4"]
TP4_ETP2 = HEADS4 + ["--tensor-model-parallel-size", "4", "--sequence-parallel", "--expert-tensor-parallel-size", "2"]


@pytest.fixture(scope="module")
def grid_saved(tmp_path_factory):
    """{name: (losses, checkpoint folder)} of runs on Megatron-LM's expert grid with ETP below TP, TP 4 x ETP 2:
    at EP 2 under ZeRO-0 (each rank a distinct shard), and at EP 1 under ZeRO 1 (ranks 0 and 2 hold the same
    halves of the experts, whose optimizer states ZeRO partitions over them: the expert data parallel group
    crosses tensor parallel ranks)."""
    out = {}
    for name, flags in (("ep2", _ep(2)), ("ep1_zero1", _ep(1) + ZERO1)):
        ckpt = str(tmp_path_factory.mktemp(f"tp4_etp2_{name}"))
        out[name] = (_run(TP4_ETP2 + flags + ["--save", ckpt], world=4), ckpt)
    return out


def test_expert_grid_writes_each_shard_once(grid_saved):
    """Stacked experts files come from expert data parallel rank 0 of each (EP, ETP) coordinate, named by its expert
    parallel and mp (TP) rank: at EP 2 the four distinct shards; at EP 1 ranks 2 and 3 hold the shards of ranks 0
    and 1 and write none (DeepSpeed's module files of all four TP ranks are there). The signature records ETP."""
    for name, expected in (("ep2", [(0, 0), (0, 1), (1, 2), (1, 3)]), ("ep1_zero1", [(0, 0), (0, 1)])):
        step = os.path.join(grid_saved[name][1], "global_step2")
        files = sorted(f for f in os.listdir(step) if f.startswith("stacked_experts_"))
        assert files == [f"stacked_experts_expp_rank_{r}_mp_rank_{m:02d}_model_states.pt" for r, m in expected], name
        assert all(os.path.exists(os.path.join(step, f"mp_rank_{m:02d}_model_states.pt")) for m in range(4)), name
        assert read_meta(step)["signature"][EXPERT_TENSOR_PARALLEL_SIZE] == 2


def _bitwise(want_dir, have_dir):
    want, have = (load_consolidated(d, 4, family=GPT, log=lambda *a: None).state_dict for d in (want_dir, have_dir))
    assert sorted(want) == sorted(have) and all(torch.equal(want[k], have[k]) for k in want)


@pytest.mark.parametrize("saved_as,flags,world", [
    ("ep2", TP4_ETP2 + _ep(2), 4), ("ep2", HEADS4 + TP2_SP + ETP2 + _ep(1), 2), ("ep2", HEADS4 + _ep(1), 1),
    ("ep1_zero1", TP4_ETP2 + _ep(1) + ZERO1, 4), ("ep1_zero1", HEADS4 + _ep(1) + ZERO1, 1),
], ids=["ep2_same", "ep2_to_tp2_etp2_ep1", "ep2_to_one_process", "ep1_zero1_same", "ep1_zero1_to_one_process"])
def test_expert_grid_resumes_at(grid_saved, tmp_path, saved_as, flags, world):
    """Each expert shard is written once (expert data parallel rank 0 of each ETP x EP coordinate), read back
    merging the parts of one ETP group's ranks (the signature records ETP), and loaded into the same layout (the
    weights of step 4 bitwise the uninterrupted run's) or another TP / ETP / EP layout: losses, weights and
    optimizer state continue as the uninterrupted run."""
    ckpt, out = _resume(grid_saved[saved_as], flags, tmp_path, world)
    _same_weights(ckpt, out)
    _same_optimizer_state(ckpt, out)
    if world == 4:
        _bitwise(ckpt, out)
