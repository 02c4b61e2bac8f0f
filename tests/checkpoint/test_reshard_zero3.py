"""ZeRO-3 checkpoints (``--no-pipeline-parallel --zero-stage 3``) move to other layouts, both ways,
and consolidate / export.

One chain of three runs, all with the same 6-step schedule:

- A: ZeRO-3 at DP 2 (TP 1), straight through steps 1-6, saving at 3 and 6;
- B: A's step-3 checkpoint resumed at TP 2 x DP 1 under ZeRO-1 on the pipeline engine (other DP,
  TP, stage and engine), steps 4-6, saving after each;
- C: B's step-5 checkpoint (ZeRO-1, TP 2, DP 1) resumed into ZeRO-3 at TP 1 x DP 2, step 6.

B's and C's losses must equal A's, and their final weights A's (``load_consolidated``). Sharper:
B's and C's saved fp32 masters and Adam moments at step 6 (read through the ZeRO-1 and ZeRO-3
files) must equal A's (read through the ZeRO-3 files): a lost moment would differ by its own size.
The ZeRO-3 reader itself is checked against DeepSpeed's own ``zero_to_fp32`` on A's files.

Tolerances are the fp32 ones of test_reshard.py (same model, same reasons): other layouts sum
the same numbers in other orders, ~1e-7 relative per op. Moments: exp_avg_sq is a square of
gradients (~1e-8 here), exp_avg ~1e-4; rtol 1e-4 plus an atol of 1e-6 of each tensor's largest
value covers reordered sums, while a fresh or missing moment is off by 100%.
"""
import os

import pytest
import torch

from tests.checkpoint.common import layout_flags
from tests.checkpoint.test_reshard import FP32, _optimizer_state, _weights
from tests.distributed import run_distributed
from tests.training.common import TINY_GPT, train_losses
from megatron_ds.families.gpt.gpt_family import GPT

RUN = TINY_GPT + ["--global-batch-size", "8", "--hidden-dropout", "0", "--attention-dropout", "0",
                  "--vocab-size", "500", "--train-iters", "6", "--adam-eps", "1e-4", "--save-interval", "3"]
ZERO3 = ["--zero-stage", "3", "--no-pipeline-parallel"]


def _run(layout, extra):
    tp, pp, dp = layout
    return run_distributed(train_losses, tp * pp * dp, RUN + layout_flags(tp, pp) + list(extra), timeout=600)[-1]


def _point_tracker(ckpt, iteration):
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    a, b, c = (str(tmp_path_factory.mktemp(n)) for n in ("zero3_a", "zero1_b", "zero3_c"))
    straight = _run((1, 1, 2), [*ZERO3, "--save", a])
    _point_tracker(a, 3)
    resumed_b = _run((2, 1, 1), ["--zero-stage", "1", "--load", a, "--save", b, "--save-interval", "1"])
    _point_tracker(b, 5)
    resumed_c = _run((1, 1, 2), [*ZERO3, "--load", b, "--save", c])
    return dict(a=a, b=b, c=c, straight=straight, resumed_b=resumed_b, resumed_c=resumed_c)


def _same_weights(want, got):
    assert sorted(want) == sorted(got)
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, **FP32["weights"], msg=lambda m, name=name: f"{name}: {m}")


def _same_optimizer_state(want_and_step, got_and_step):
    (want, want_step), (got, got_step) = want_and_step, got_and_step
    assert want_step == got_step == 6
    assert sorted(want) == sorted(got)
    for name in want:
        for key, tensor in want[name].items():
            torch.testing.assert_close(got[name][key], tensor, rtol=1e-4, atol=1e-6 * tensor.abs().max().item(),
                                       msg=lambda m, name=name, key=key: f"{name} {key}: {m}")


def test_zero3_reader_matches_deepspeeds_zero_to_fp32(chain):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from megatron_ds.checkpoint import load_consolidated

    ours = load_consolidated(chain["a"], 6, log=lambda *a: None, family=GPT).state_dict
    theirs = get_fp32_state_dict_from_zero_checkpoint(chain["a"], tag="global_step6")
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name  # the same bits, read another way


def test_zero3_dp2_resumes_at_tp2_zero1_dp1(chain):
    straight = chain["straight"]
    assert [it for it, _ in chain["resumed_b"]] == [4, 5, 6]
    assert [loss for _, loss in chain["resumed_b"]] == pytest.approx([loss for _, loss in straight[3:]],
                                                                      **FP32["loss"])
    _same_weights(_weights(chain["a"], 6), _weights(chain["b"], 6))
    _same_optimizer_state(_optimizer_state(chain["a"], 6), _optimizer_state(chain["b"], 6))


def test_zero1_tp2_resumes_into_zero3_dp2(chain):
    assert [it for it, _ in chain["resumed_c"]] == [6]
    assert [loss for _, loss in chain["resumed_c"]] == pytest.approx([loss for _, loss in chain["straight"][5:]],
                                                                      **FP32["loss"])
    _same_weights(_weights(chain["a"], 6), _weights(chain["c"], 6))
    _same_optimizer_state(_optimizer_state(chain["a"], 6), _optimizer_state(chain["c"], 6))


def test_zero3_checkpoint_exports_to_hf(chain, tmp_path):
    """tools/checkpoint/to_hf.py on a ZeRO-3 checkpoint: the weights come from the partitions."""
    from safetensors.torch import load_file

    from megatron_ds.cli import to_hf

    out = str(tmp_path / "hf")
    assert to_hf.main(["--load", chain["a"], "--iteration", "6", "--out", out]) == 0
    wte = load_file(os.path.join(out, "model.safetensors"))["transformer.wte.weight"]
    assert torch.equal(wte, _weights(chain["a"], 6)["tied_modules.embed.word_embeddings.weight"])
