"""Context parallelism (--context-parallel-size, parallel/context_parallel.py): the same data, seed and global
batch trained for 5 steps with every sequence split into 2 x CP chunks over CP ranks gives the losses of the
same model trained at CP 1, for a GPT (learned positions, document-reset masks, DeepSpeed's pipeline engine)
and a Llama-style model (RoPE at the chunks' global positions, GQA, document resets, the plain engine), with
the ring (p2p) and the all-gather exchange, with TP 2 and with PP 2 (1F1B and interleaved); a checkpoint saved
at one CP size continues at another as the uninterrupted CP 1 run.

Dropout is off (its stream depends on the layout). Tolerance rtol 2e-5 as test_ulysses.py's (fp32 sums in
another order: attention merged block by block with the online softmax, the loss a sum of per-chunk sums,
gradients averaged over DP x CP); a wrong chunk, position or mask moves the loss by 1e-3 or more
(``test_the_comparisons_can_fail``).
"""
import pytest

from tests.distributed import run_distributed
from tests.training.common import LLAMA_FLAGS, TINY_GPT, train_losses

STEPS = ["--train-iters", "5", "--global-batch-size", "4", "--hidden-dropout", "0", "--attention-dropout", "0",
         "--num-layers", "2", "--lr-warmup-iters", "0"]
RTOL = 2e-5
# document resets: mock tokens are uniform over the vocabulary and the last id ends a document
# (vocabulary 16, EOD 15: about two documents end in every 33-token sample)
RESET = ["--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss", "--vocab-size", "16"]
# --calculate-per-token-loss: the loss tokens of the whole global batch divide the summed token losses (with
# --eod-mask-loss the micro-batches keep different counts, so it differs from the mean of their means)
LLAMA = LLAMA_FLAGS + ["--num-attention-heads", "4", "--num-key-value-heads", "2", "--no-pipeline-parallel",
                       "--calculate-per-token-loss"] + RESET


def _losses(cp, extra=(), tp=1, pp=1, steps=STEPS):
    argv = TINY_GPT + steps + ["--context-parallel-size", str(cp), "--tensor-model-parallel-size", str(tp),
                               "--pipeline-model-parallel-size", str(pp), *extra]
    results = run_distributed(train_losses, tp * pp * cp, argv, timeout=300)
    last = results[-1]  # the last pipeline stage's ranks
    assert [it for it, _ in last] == list(range(1, 6))
    for other in results[-tp * cp:]:  # every CP rank reports the whole sequence's loss
        assert other == last
    return [loss for _, loss in last]


@pytest.fixture(scope="module")
def llama_reference():
    return _losses(1, LLAMA)


@pytest.fixture(scope="module")
def gpt_reference():
    return _losses(1, RESET)


@pytest.mark.parametrize("comm,recompute", [("p2p", []), ("all_gather", ["--recompute-activations"]),
                                           ("p2p", ["--cp-block-kernel", "flash"])])
def test_llama_cp2_matches_cp1(llama_reference, comm, recompute):
    """all_gather with selective recompute: the attention core (its all-gather) reruns in backward. --cp-block-kernel
    flash: the blocks run torch's CPU flash operator (parallel/attention_blocks.py)."""
    assert _losses(2, LLAMA + ["--cp-comm-type", comm, *recompute]) == pytest.approx(llama_reference, rel=RTOL)


def test_gpt_cp2_on_the_pipeline_engine_matches_cp1(gpt_reference):
    assert _losses(2, RESET) == pytest.approx(gpt_reference, rel=RTOL)


def test_llama_cp4_matches_cp1(llama_reference):
    """4 ranks, 8 chunks of 4 positions: three hops around the ring."""
    assert _losses(4, LLAMA) == pytest.approx(llama_reference, rel=RTOL)


def test_llama_cp2_tp2_with_sequence_parallel_matches_cp1(llama_reference):
    """4 ranks: TP 2 (each holding one key/value group, its activations split over TP outside attention)
    x CP 2 (Megatron's order: the TP ranks adjacent, then CP)."""
    assert _losses(2, LLAMA + ["--sequence-parallel"], tp=2) == pytest.approx(llama_reference, rel=RTOL)


@pytest.mark.parametrize("schedule", [["--checkpoint-activations"],
                                      ["--num-layers", "4", "--num-layers-per-virtual-pipeline-stage", "1"],
                                      ["--enable-zbh1-pipeline"]], ids=["1f1b_recompute", "interleaved", "zbh1"])
def test_gpt_cp2_pp2_matches_cp1(gpt_reference, schedule):
    """4 ranks: PP 2 x CP 2 (the document ids cross the stage boundaries whole, the hidden state as each CP rank's
    two chunks): DeepSpeed's 1F1B engine with full recompute (each layer's forward, ring included, reruns in
    backward), and our executor's interleaved (4 layers: two model chunks per stage) and ZB-H1 schedules (the
    linear layers' weight gradients deferred; the ring's backward exchange runs in the input-gradient pass)."""
    reference = _losses(1, RESET + schedule[:2]) if "--num-layers" in schedule else gpt_reference
    assert _losses(2, RESET + schedule, pp=2) == pytest.approx(reference, rel=RTOL)


RESUME = TINY_GPT + STEPS + LLAMA + ["--zero-stage", "1"]


@pytest.fixture(scope="module")
def zero1_reference():
    return run_distributed(train_losses, 1, RESUME, timeout=300)[0]


@pytest.mark.parametrize("saved_at,resumed_at", [(2, 1), (1, 2)])
def test_checkpoint_resumes_at_another_cp_size(tmp_path, zero1_reference, saved_at, resumed_at):
    """The weights do not depend on CP: 2 steps with ZeRO 1 (the optimizer state sharded over the DP x CP
    ranks), saved, continue at the other CP size (resharded as a data parallel change) with the uninterrupted
    CP 1 run's losses."""
    ckpt = str(tmp_path / "ckpt")
    run_distributed(train_losses, saved_at, RESUME + ["--context-parallel-size", str(saved_at), "--save", ckpt,
                                                      "--save-interval", "100", "--exit-interval", "2"], timeout=300)
    second = run_distributed(train_losses, resumed_at, RESUME + ["--context-parallel-size", str(resumed_at),
                                                                 "--load", ckpt], timeout=300)[-1]
    assert [it for it, _ in second] == [3, 4, 5]
    assert [loss for _, loss in second] == pytest.approx([loss for _, loss in zero1_reference[2:]], rel=RTOL)


def test_fp8_delayed_scaling_at_cp2_matches_cp1():
    """FP8 (torchao's emulation on the CPU), delayed scaling, bf16: the linear layers cast each token as at CP 1
    when the CP ranks share one scale, as Megatron-LM's amax reduction group spans them
    (``get_amax_reduction_group(with_context_parallel=True)``): the amaxes are reduced over DeepSpeed's data
    parallel axis, DP x CP ranks. Tolerance: bf16 sums in another order (the attention merged block by block)
    can move a value across an FP8 rounding boundary: the TP resharding bound of test_fp8_delayed.py (5e-3)."""
    fp8 = ["--bf16", "--fp8-format", "hybrid", "--fp8-amax-history-len", "4", "--fp8-amax-compute-algo", "max"]
    assert _losses(2, LLAMA + fp8) == pytest.approx(_losses(1, LLAMA + fp8), rel=5e-3)


def test_cp_ranks_share_the_fp8_scales(tmp_path):
    """The group the loop reduces FP8 amaxes over (``ParallelState.sp_dp_group``) spans the CP ranks: two CP
    ranks seeing different amaxes end with the same scale (without CP in the group they would not)."""
    assert len(set(run_distributed(_scale_after_update, 2, [], timeout=120))) == 1


def _scale_after_update(rank, world_size, _):
    import torch

    from megatron_ds.parallel.fp8 import Fp8Recipe
    from megatron_ds.parallel.fp8_delayed import DelayedScaling, update_delayed_scaling
    from megatron_ds.parallel.groups import ParallelState

    ps = ParallelState(1, 1, cp=2)
    state = DelayedScaling(Fp8Recipe(granularity="delayed", amax_history_len=4), None)
    module = torch.nn.Module()
    module.fp8_scaling = state
    state.amax_history[0].fill_(1.0 + 7.0 * rank)
    update_delayed_scaling(module, ps.sp_dp_group)
    return float(state.scale[0])
