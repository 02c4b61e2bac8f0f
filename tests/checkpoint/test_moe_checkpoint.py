"""Mixture-of-experts checkpoints with the real entry point (tiny GPT, 4 layers, MoE on layers 2
and 4 -- Megatron-DeepSpeed's default --expert-interval 2 -- so at PP 2 both stages hold one).

- Resume is bitwise at EP 2 (DP 2): 10 steps straight == 5, save, fresh processes, load, 5 more;
  top-2 gating with DeepSpeed's second-expert sampling and dropout on, so the RNG streams must
  come back too. The checkpoint holds DeepSpeed's own MoE files (mp_rank files without experts,
  one file per expert with its global id, ZeRO-0's optimizer per expert parallel rank).
- Reshape at --load: a checkpoint saved at EP 2 resumes at EP 1 (ZeRO-0: DeepSpeed's optimizer
  file per expert parallel rank; ZeRO-1: shards whose experts carry local ids, partitioned over
  the expert data parallel group), one saved at PP 2 at PP 1, one saved at TP 2 with experts
  split over TP (--enable-expert-tensor-parallelism: each GeLU expert split as the dense MLP) at
  TP 1, and all continue as the uninterrupted run does (losses of steps 4-6, then the step-6
  weights by ``load_consolidated``, which reads the experts by their global ids at either EP size).
  The EP case keeps DeepSpeed's default routing: top-1 with token dropping, whose random token
  selection (``use_rts``) draws from the RNG streams the checkpoint restores (TP and PP unchanged).
  A TP or PP change restarts those streams (each saved state belongs to a rank that no longer
  exists), so those cases drop nothing: PP without token dropping (capacity = the largest expert
  load), TP with capacity factor 4 (capacity = every token of a micro-batch: the random priority
  then picks them all; DeepSpeed 0.19's no-dropping capacity is not padded to the TP size when
  experts are TP-split, which its token split then asserts on).
  The TP case compares steps 4-5 and the step-5 weights: at TP 2 the gate reads a hidden state
  whose row-parallel sums ran in another order (~1e-7), and at step 6 a token whose two best
  experts are that close switches expert (measured: step 6's loss 4.7e-5 relative apart, steps 4-5
  within 2e-5). Step 4 checks the loaded weights, step 5 the optimizer state that step 4 used.
  Its weights: split experts sum their matmuls in another order, which Adam amplifies on small
  gradients (tests/training/test_moe.py measures the same for TP 2 training against TP 1; here up
  to 9e-5 on the word embedding after two steps), so as tests/checkpoint/test_reshard.py's bf16
  case each tensor must differ from the uninterrupted run's by at most 0.2 of how far it moved in
  those steps: a lost master or Adam moment would make it differ by about as much as it moved.
  Tolerances as tests/checkpoint/test_reshard.py: fp32, the layouts sum the same numbers in other
  orders (EP 2 exchanges tokens all-to-all and reduces expert gradients over other groups; PP 2
  sums the tied embedding's gradient across stages): losses within 2e-5 relative, weights within
  rtol 1e-5 / atol 1e-6 -- a lost Adam moment or master would move weights of ~0.02 by ~1e-4.
- bf16 (BF16_Optimizer with --create-moe-param-group) saved at EP 2 resumes at EP 1: losses within
  5e-3 relative (test_reshard.py's bf16 reason), and, like its bf16 case, the saved fp32 masters and Adam
  moments at step 6 (experts read by global id) must differ from the uninterrupted run's by at most
  how far they moved in steps 4-6. Measured: 0.20 on AVX2 CPUs (an expert's first moment), 0.71 on
  AVX-512 ones (an expert's fp32 master); two uninterrupted bf16 runs at EP 2 and EP 1 differ by up
  to 0.54 over six steps (an expert's fp32 master: bf16 expert inputs round differently after the
  all-to-all), and a resume that drops the optimizer state (--no-load-optim) by 2.9, with Adam's
  step 3 instead of 6.
"""
import json
import os

import pytest
import torch

from tests.checkpoint.common import layout_flags
from tests.checkpoint.test_reshard import _optimizer_state
from tests.distributed import run_distributed
from tests.training.common import TINY_GPT, train_losses
from megatron_ds.families.gpt.gpt_family import GPT

pytestmark = pytest.mark.timeout(1500)
# Megatron-DeepSpeed's lines, whose --num-experts is DeepSpeed-MoE (an upstream line's is Megatron-LM's MoE)
MOE = ["--deepspeed", "--num-experts", "4", "--global-batch-size", "8"]
RESUME = TINY_GPT + MOE + ["--train-iters", "10", "--topk", "2", "--hidden-dropout", "0.1",
                           "--attention-dropout", "0.1"]
RESHAPE = TINY_GPT + MOE + ["--train-iters", "6", "--hidden-dropout", "0", "--attention-dropout", "0",
                            "--adam-eps", "1e-4"]
FP32 = dict(loss=dict(rel=2e-5), weights=dict(rtol=1e-5, atol=1e-6))
MOVED_FRACTION = 0.2


def _ep(n):
    return ["--moe-expert-parallel-size", str(n)]


def _run(world, argv):
    return run_distributed(train_losses, world, argv, timeout=900)[-1]


def test_resume_at_ep2_is_bitwise(tmp_path):
    argv = RESUME + _ep(2)
    straight = _run(2, argv)
    ckpt = str(tmp_path / "ckpt")
    first = _run(2, argv + ["--save", ckpt, "--save-interval", "100", "--exit-interval", "5"])
    files = sorted(os.listdir(os.path.join(ckpt, "global_step5")))
    # DeepSpeed's MoE layout (deepspeed/runtime/engine.py _save_moe_checkpoint): MoE layer k of the
    # module (layers 2 and 4), global experts 0-3, ZeRO-0 optimizer per expert parallel rank
    assert [f for f in files if f.startswith("layer_")] == sorted(
        f"layer_{k}_expert_{e}_mp_rank_00_model_states.pt" for k in (0, 1) for e in range(4))
    assert [f for f in files if f.startswith("expp_rank_")] == [
        "expp_rank_0_mp_rank_00_optim_states.pt", "expp_rank_1_mp_rank_00_optim_states.pt"]
    meta = json.load(open(os.path.join(ckpt, "global_step5", "megatron_ds_config.json")))
    assert meta["signature"]["expert_parallel_size"] == 2 and meta["signature"]["num_experts"] == [4]
    second = _run(2, argv + ["--load", ckpt])
    assert [it for it, _ in first] == [1, 2, 3, 4, 5]
    assert [it for it, _ in second] == [6, 7, 8, 9, 10]
    assert first + second == straight


def _weights(path, iteration=None):
    from megatron_ds.checkpoint import load_consolidated

    return load_consolidated(path, iteration, log=lambda *a: None, family=GPT).state_dict


@pytest.mark.parametrize("name,saved,resumed,extra,last", [
    # (world, flags) of the saving run and of the resuming run; flags of both; the last step compared
    ("ep2_to_ep1", (2, _ep(2)), (2, _ep(1)), [], 6),
    ("pp2_to_pp1", (2, layout_flags(1, 2)), (1, layout_flags(1, 1)), ["--disable-moe-token-dropping"], 6),
    ("ep2_zero1_to_ep1", (2, _ep(2)), (2, _ep(1)), ["--zero-stage", "1", "--create-moe-param-group"], 6),
    ("tp2_to_tp1_expert_tp", (2, layout_flags(2, 1)), (1, layout_flags(1, 1)),
     ["--enable-expert-tensor-parallelism", "--moe-train-capacity-factor", "4"], 5),
])
def test_reshape_continues_the_uninterrupted_run(tmp_path, name, saved, resumed, extra, last):
    ckpt = str(tmp_path / "saved")
    straight = _run(saved[0], RESHAPE + saved[1] + extra + ["--save", ckpt, "--save-interval", "1"])
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("3")  # resume from the middle of the run
    out = str(tmp_path / "resumed")
    got = _run(resumed[0], RESHAPE + resumed[1] + extra + ["--load", ckpt, "--save", out, "--exit-interval", str(last)])
    assert [it for it, _ in got] == list(range(4, last + 1))
    assert [loss for _, loss in got] == pytest.approx([loss for _, loss in straight[3:last]], **FP32["loss"])
    want, have, at3 = _weights(ckpt, last), _weights(out), _weights(ckpt, 3)
    assert sorted(want) == sorted(have)
    assert any(".deepspeed_experts.3." in k for k in want)  # every expert, by its global id
    for key, tensor in want.items():
        if "--enable-expert-tensor-parallelism" in extra:  # see the module docstring
            moved = (tensor - at3[key]).abs().max().item()
            assert (have[key] - tensor).abs().max().item() <= MOVED_FRACTION * moved, key
        else:
            torch.testing.assert_close(have[key], tensor, **FP32["weights"], msg=lambda m, key=key: f"{key}: {m}")


def test_bf16_reshape_carries_masters_and_moments(tmp_path):
    extra = ["--bf16", "--create-moe-param-group"]
    ckpt, out = str(tmp_path / "saved"), str(tmp_path / "resumed")
    straight = _run(2, RESHAPE + _ep(2) + extra + ["--save", ckpt, "--save-interval", "3"])
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("3")
    got = _run(2, RESHAPE + _ep(1) + extra + ["--load", ckpt, "--save", out])
    assert [it for it, _ in got] == [4, 5, 6]
    assert [loss for _, loss in got] == pytest.approx([loss for _, loss in straight[3:]], rel=5e-3)
    (at3, _), (want, want_step), (have, have_step) = (_optimizer_state(ckpt, 3), _optimizer_state(ckpt, 6),
                                                      _optimizer_state(out))
    assert want_step == have_step == 6
    assert any(".deepspeed_experts.3." in name for name in want)
    for name in want:
        for key, tensor in want[name].items():
            moved = (tensor - at3[name][key]).abs().max().item()
            assert (have[name][key] - tensor).abs().max().item() <= moved, (name, key)  # see the docstring


def test_each_layer_reopens_as_the_line_that_saved_it(tmp_path):
    """--num-experts 4 alone, saved from an upstream line (Megatron-LM's MoE: top-2 on every layer) and from a
    Megatron-DeepSpeed line (DeepSpeed-MoE on every second layer): the saved flags are the same but for --deepspeed,
    and each checkpoint reopens (tools, inference, export) as the layer that wrote it."""
    from megatron_ds.checkpoint.files import open_checkpoint
    from megatron_ds.config.moe_params import model_experts
    from megatron_ds.config.moe_selection import is_mlm_moe
    from tests.checkpoint.common import train

    for line, mlm, experts in (([], True, (4, 4, 4, 4)), (["--deepspeed"], False, (1, 4, 1, 4))):
        ckpt = str(tmp_path / ("mlm" if mlm else "ds"))
        train("gpt2", 1, 1, 1, 1, ["--save", ckpt, "--num-experts", "4", *line])
        m = open_checkpoint(ckpt, None, GPT).model
        assert (is_mlm_moe(m), model_experts(m)) == (mlm, experts)
        assert m.moe_router_topk == (2 if mlm else None) and m.topk == 1
