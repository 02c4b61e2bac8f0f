"""The interleaved 1F1B schedule end to end: parity with one process, exact resume, checkpoints
that a non-interleaved pipeline loads, and --dry-run.

Parity tolerance: rtol 2e-5, as tests/families/gpt/test_parity.py argues for fp32 layouts (different
summation orders perturb a loss by ~1e-7 relative, a few Adam steps amplify that by at most a few
tens; a real bug moves the loss by 1e-3 or more). In practice the runs agree to the last bits:
each layer computes the same operations on the same numbers and every parameter accumulates its
micro-batch gradients in the same order; only the global grad norm (for clipping) sums its
per-parameter terms in another order, which moves weights by an ulp.
Dropout is off wherever layouts are compared: the order in which chunks draw from a stage's
dropout stream differs between schedules.
"""
import os

import pytest
import torch

from megatron_ds.families import main
from tests.distributed import run_distributed
from tests.training.common import LLAMA_FLAGS, TINY_GPT, train_losses

NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]
STEPS = ["--train-iters", "5", "--global-batch-size", "8", *NO_DROPOUT]
RTOL = 2e-5
INTERLEAVE = ["--num-layers-per-virtual-pipeline-stage", "1"]


def _losses(world, argv, timeout=600):
    results = run_distributed(train_losses, world, argv, timeout=timeout)
    for other in results:  # the loss is broadcast over the pipeline: every rank reports the same
        assert other == results[-1]
    return results[-1]


def _layout(tp, pp):
    return ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]


@pytest.fixture(scope="module")
def reference():
    return _losses(1, TINY_GPT + STEPS)


def test_pp2_v2_matches_single_process(reference):
    losses = _losses(2, TINY_GPT + STEPS + _layout(1, 2) + INTERLEAVE)
    assert [it for it, _ in losses] == [1, 2, 3, 4, 5]
    assert [x for _, x in losses] == pytest.approx([x for _, x in reference], rel=RTOL)
    assert losses[-1][1] < losses[0][1]  # it trains: equal losses would otherwise prove little


def losses_and_sent_sizes(rank, world_size, argv):
    """``train_losses`` and the element count of every tensor this rank's pipeline messages sent
    (``isend`` is only called by the executor's p2p; the TP all-gathers are collectives)."""
    sizes = []
    isend = torch.distributed.isend

    def counting(tensor, *args, **kwargs):
        sizes.append(tensor.numel())
        return isend(tensor, *args, **kwargs)

    torch.distributed.isend = counting
    try:
        return train_losses(rank, world_size, argv), sizes
    finally:
        torch.distributed.isend = isend


@pytest.mark.slow
@pytest.mark.parametrize("extra, parts", [([], 2), (["--sequence-parallel"], 2),
                                          (["--no-scatter-gather-tensors-in-pipeline"], 1)],
                         ids=["tp", "tp_sequence_parallel", "tp_whole_messages"])
def test_tp2_pp2_v2_matches_single_process(reference, extra, parts):
    """Each TP rank sends 1/TP of the [s, b, h] hidden state and of its gradient (scatter/gather; under
    sequence parallelism its own [s/tp, b, h] shard), all of it with the flag; losses equal either way."""
    # Megatron-LM's spelling of the chunk count
    argv = TINY_GPT + STEPS + _layout(2, 2) + ["--virtual-pipeline-model-parallel-size", "2"] + extra
    results = run_distributed(losses_and_sent_sizes, 4, argv, timeout=600)
    assert all(losses == results[-1][0] for losses, _ in results)
    assert [x for _, x in results[-1][0]] == pytest.approx([x for _, x in reference], rel=RTOL)
    s, b, h = (int(TINY_GPT[TINY_GPT.index(f) + 1]) for f in ("--seq-length", "--micro-batch-size", "--hidden-size"))
    for _, sizes in results:  # every rank sends activations and gradients
        assert sizes and set(sizes) == {s * b * h // parts}


@pytest.mark.slow
def test_pp4_v2_matches_single_process():
    """8 layers: 4 ranks x 2 chunks of one layer; 4 micro-batches per step, a multiple of PP 4.
    Attention within documents: the [b, s] int64 document ids travel with the hidden state."""
    argv = TINY_GPT + STEPS + ["--num-layers", "8", "--reset-attention-mask", "--reset-position-ids",
                               "--eod-mask-loss"]
    ref = _losses(1, argv)
    losses = _losses(4, argv + _layout(1, 4) + INTERLEAVE)
    assert [x for _, x in losses] == pytest.approx([x for _, x in ref], rel=RTOL)


@pytest.mark.slow
def test_dp2_zero1_recompute_untied_matches_single_process():
    """ZeRO-1 over two data parallel replicas, full activation recompute, untied output layer
    (Llama-style model): 2 micro-batches per replica and step, PP 2 x v 2."""
    argv = TINY_GPT + STEPS + LLAMA_FLAGS + ["--zero-stage", "1", "--checkpoint-activations"]
    ref = _losses(1, argv)
    losses = _losses(4, argv + _layout(1, 2) + INTERLEAVE)
    assert [x for _, x in losses] == pytest.approx([x for _, x in ref], rel=RTOL)


@pytest.mark.slow
def test_bf16_zero1_matches_non_interleaved_pipeline():
    """bf16 with DeepSpeed's bf16 optimizer (fp32 gradient accumulation, tied gradients in its
    fp32 buffers). Both runs round the same bf16 operations, but the grad norm's other order of
    summation moves an fp32 master by an ulp, and where that flips a weight's bf16 rounding the
    loss moves too: measured 1.1e-6 relative at step 4 on AVX-512 CPUs (identical on AVX2 ones).
    So RTOL, not equality: a chunk run out of order moves the loss by 1e-3 or more."""
    argv = TINY_GPT + STEPS + _layout(1, 2) + ["--bf16", "--zero-stage", "1", "--deepspeed_config",
                                                os.path.join("ds_configs", "zero1_bf16.json")]
    interleaved, plain = _losses(2, argv + INTERLEAVE), _losses(2, argv)
    assert [it for it, _ in interleaved] == [it for it, _ in plain] == [1, 2, 3, 4, 5]
    assert [x for _, x in interleaved] == pytest.approx([x for _, x in plain], rel=RTOL)


def _layer_files(path):
    return sorted(f for f in os.listdir(path) if f.startswith("layer_"))


@pytest.mark.slow
def test_resume_and_checkpoint_files_of_a_non_interleaved_pipeline(tmp_path):
    """Interleaved: 5 steps straight == 2 steps, save, load, 3 steps (bitwise, CPU fp32). The
    checkpoint's per-layer files equal those a non-interleaved PP 2 run writes, and such a run
    loads the interleaved checkpoint: its loss at step 3 is the straight run's."""
    base = TINY_GPT + STEPS + _layout(1, 2)
    inter, plain = str(tmp_path / "inter"), str(tmp_path / "plain")
    straight = _losses(2, base + INTERLEAVE)
    first = _losses(2, base + INTERLEAVE + ["--save", inter, "--exit-interval", "2"])
    second = _losses(2, base + INTERLEAVE + ["--load", inter])
    assert first + second == straight

    _losses(2, base + ["--save", plain, "--exit-interval", "2"])
    names = _layer_files(os.path.join(inter, "global_step2"))
    # embedding (0), 4 transformer layers, final norm (5); the tied output layer has no file of its own
    assert names == [f"layer_{i:02d}-model_00-model_states.pt" for i in range(6)]
    assert names == _layer_files(os.path.join(plain, "global_step2"))
    for name in names:
        a = torch.load(os.path.join(inter, "global_step2", name), weights_only=True)
        b = torch.load(os.path.join(plain, "global_step2", name), weights_only=True)
        assert a.keys() == b.keys()
        # the two runs differ only in the summation order of the grad norm that scales the
        # clipped update (~1e-7 relative); an unsynchronized tied copy or a wrong layer would differ
        # by the size of an update (lr 1e-3)
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-7)

    # the optimizer state of an interleaved run does not fit; the weights do
    loaded = _losses(2, base + ["--load", inter, "--no-load-optim", "--train-iters", "3"])
    assert [it for it, _ in loaded] == [3]
    assert loaded[0][1] == pytest.approx(straight[2][1], rel=RTOL)


def test_dry_run_prints_chunks_and_bubble(capsys):
    rc = main(TINY_GPT + ["--train-iters", "1", "--global-batch-size", "16", "--dry-run", "--world-size", "4",
                          "--num-layers", "8"] + _layout(1, 4) + INTERLEAVE)
    out = capsys.readouterr().out
    assert rc == 0
    assert "interleaved 1F1B, PP 4 x 2 chunk(s) per rank, 8 micro-batches" in out
    assert "rank 0: chunk 0: embedding, layer 0; chunk 1: layer 4" in out
    assert "rank 3: chunk 0: layer 3; chunk 1: layer 7, final norm, output layer" in out
    # (p-1)/(v m) = 3/16 against 1F1B's 3/8
    assert "= 3/(2 x 8) = 18.8% of compute (1F1B: (p-1)/m = 37.5%)" in out


@pytest.mark.parametrize("extra,message", [
    (["--global-batch-size", "12"], "micro-batches per step (6 = global batch / (micro batch x DP)) to be a "
                                    "multiple of --pipeline-model-parallel-size 4"),
    (["--num-layers-per-virtual-pipeline-stage", "3"], "8 layers / PP 4 = 2 layers per pipeline rank, not "
                                                        "divisible by --num-layers-per-virtual-pipeline-stage 3"),
    (["--pipeline-model-parallel-size", "1", "--world-size", "1"], "needs --pipeline-model-parallel-size >= 2"),
])
def test_dry_run_refuses_what_cannot_interleave(capsys, extra, message):
    argv = TINY_GPT + ["--train-iters", "1", "--global-batch-size", "16", "--dry-run", "--world-size", "4",
                       "--num-layers", "8"] + _layout(1, 4) + INTERLEAVE + extra
    assert main(argv) == 1
    assert message in capsys.readouterr().err
