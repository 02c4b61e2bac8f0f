"""BERT and T5 checkpoints reshaped at --load: saved at one (TP, PP) layout, resumed at another, they continue as
the uninterrupted run (the method of tests/checkpoint/test_reshard.py for the GPT: a 6-step run saves at 3 and
6, the tracker is pointed back at 3, the other layout resumes to 6; compared are the losses of steps 4-6 and
the step-6 weights, consolidated from both checkpoints by the family's layer specs).

BERT: TP 2 x PP 2 -> one process (the MLM head, pooler, binary head and token-type table on the last / first
stage, the tied embedding on both). T5: PP 2 split at 1 -> TP 2 without a pipeline (encoder and decoder stages
merged, the layers split over TP). fp32, dropout off, --adam-eps 1e-4. Losses: test_reshard.py's FP32 tolerance
(its docstring gives the reasons: the layouts sum in other orders). Weights: atol 1e-5 instead of its 1e-6,
because BERT's tied word embedding is noisier across layouts than the GPT's: two uninterrupted 6-step runs at
TP 2 x PP 2 and at one process differ there by up to 3.5e-6 (measured; the masked-LM gradient of a rarely seen
token's row is a near-cancelling sum, and Adam divides it by its own small magnitude). A lost optimizer state
or LR step moves weights by ~1e-4 (test_reshard.py), ten times more.
"""
import os

import pytest
import torch

from tests.checkpoint.test_reshard import FP32
from tests.distributed import run_distributed
from tests.families.bert.test_bert_parity import TINY_BERT, bert_losses
from tests.families.t5.test_t5_parity import TINY_T5, t5_train_losses

pytestmark = pytest.mark.timeout(1200)
SIX = ["--train-iters", "6", "--adam-eps", "1e-4"]
WEIGHTS = dict(FP32["weights"], atol=1e-5)  # see the module docstring


def _run(fn, base, layout, extra):
    tp, pp = layout
    argv = [*base, *SIX, "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp), *extra]
    return run_distributed(fn, tp * pp, argv, timeout=900)[-1]


def _weights(path, family, iteration=None):
    from megatron_ds.checkpoint import load_consolidated
    from megatron_ds.families import get_family

    return load_consolidated(path, iteration, family=get_family(family), log=lambda *a: None).state_dict


@pytest.mark.parametrize("family", ["bert", "t5"])
def test_resumes_at_another_layout_as_the_uninterrupted_run(family, tmp_path):
    fn, base, saved_at, resumed_at, split = {
        "bert": (bert_losses, TINY_BERT, (2, 2), (1, 1), []),
        "t5": (t5_train_losses, TINY_T5, (1, 2), (2, 1), ["--pipeline-model-parallel-split-rank", "1"]),
    }[family]
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "resumed")
    straight = _run(fn, base, saved_at, [*split, "--save", ckpt, "--save-interval", "3"])
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("3")
    resumed = _run(fn, base, resumed_at, ["--load", ckpt, "--save", out])
    assert [it for it, _ in resumed] == [4, 5, 6]
    assert [loss for _, loss in resumed] == pytest.approx([loss for _, loss in straight[3:]], **FP32["loss"])
    want, got = _weights(ckpt, family, 6), _weights(out, family)
    assert sorted(want) == sorted(got)
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, **WEIGHTS, msg=lambda m, name=name: f"{name}: {m}")
