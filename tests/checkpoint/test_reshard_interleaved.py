"""Resharded checkpoints into and out of the interleaved and ZB-H1 schedules' model chunks (pipeline/chunks.py),
whose parameters are named ``chunks.<c>.<global index>...`` and ``tied_weight`` (the word embedding the output
layer shares) rather than as the ``PipelineModule``'s layer files name them (``pipeline_name``).

The dense GPT of tests/checkpoint/test_reshard.py (4 layers, vocabulary 500 padded to 504 at TP 2 and 500 at
TP 1) trains 6 steps straight, saving at 3 and 6; runs resumed from step 3 at another layout must continue as
the uninterrupted run: losses of steps 4-6, step-6 weights and optimizer state (fp32, Adam moments, step):

- TP 2 -> PP 2 interleaved (2 virtual stages of one layer each) and -> PP 2 ZB-H1;
- PP 2 1F1B (DeepSpeed's pipeline engine) -> PP 2 interleaved: the same layer files, but the optimizer groups
  the chunks' parameters in another order, so the load reshards (it once needed --no-load-optim); -> PP 2
  ZB-H1: one chunk per rank, the optimizer's order is 1F1B's, DeepSpeed's own loader takes it as it is;
- PP 2 interleaved under ZeRO 1 (DeepSpeed's optimizer files then name the chunks' parameters) -> TP 2 without
  ZeRO (its step-6 checkpoint is read back with the chunks' names mapped); DeepSpeed's ds_to_universal cannot
  convert it, refused in one line (a universal checkpoint loads into model chunks: tests/checkpoint/
  test_universal.py).

Tolerances (fp32: other layouts sum the same numbers in other orders) and the argument that the weights and
moments after three steps tell a lost optimizer state: tests/checkpoint/test_reshard.py.
"""
import pytest
import torch

from megatron_ds.cli import to_universal
from tests.checkpoint.test_reshard import FP32, _check_resumed, _optimizer_state, _straight

INTERLEAVED = ["--num-layers-per-virtual-pipeline-stage", "1"]
ZBH1 = ["--enable-zbh1-pipeline"]


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    return _straight(tmp_path_factory, "tp2", (2, 1, 1), [])


@pytest.fixture(scope="module")
def pp2(tmp_path_factory):
    return _straight(tmp_path_factory, "pp2", (1, 2, 1), [])


def _resumed(straight, ckpt, layout, extra, tmp_path):
    """Losses of steps 4-6 and step-6 weights (``_check_resumed``), then the optimizer state."""
    _check_resumed(straight, ckpt, layout, extra, tmp_path, FP32)
    out = str(tmp_path / "resumed")
    (want, want_step), (got, got_step) = _optimizer_state(ckpt, 6), _optimizer_state(out)
    assert want_step == got_step == 6
    assert sorted(want) == sorted(got)
    for name in want:
        # the Adam moments; a ZeRO run's fp32 masters too, which an fp32 run without ZeRO keeps in its weights
        keys = want[name].keys() & got[name].keys()
        assert {"exp_avg", "exp_avg_sq"} <= keys, name
        for key in keys:
            torch.testing.assert_close(got[name][key], want[name][key], **FP32["weights"],
                                       msg=lambda m, n=name, k=key: f"{n} {k}: {m}")


@pytest.mark.parametrize("schedule", [INTERLEAVED, ZBH1], ids=["interleaved", "zbh1"])
def test_tp2_resumes_in_model_chunks(tp2, tmp_path, schedule):
    _resumed(*tp2, (1, 2, 1), schedule, tmp_path)


@pytest.mark.parametrize("schedule", [INTERLEAVED, ZBH1], ids=["interleaved", "zbh1"])
def test_1f1b_resumes_at_the_same_pp(pp2, tmp_path, schedule):
    _resumed(*pp2, (1, 2, 1), schedule, tmp_path)


def test_interleaved_zero1_resumes_at_tp2(tmp_path_factory, tmp_path, capsys):
    straight, ckpt = _straight(tmp_path_factory, "interleaved", (1, 2, 1), INTERLEAVED + ["--zero-stage", "1"])
    _resumed(straight, ckpt, (2, 1, 1), [], tmp_path)
    # DeepSpeed's ds_to_universal cannot take it (its patterns miss the chunks' names): one line, not its assertion
    capsys.readouterr()
    assert to_universal.main(["--load", ckpt, "--iteration", "3"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "interleaved or ZB-H1" in err and "--load" in err
