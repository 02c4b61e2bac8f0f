"""Mixture of experts trained through the real entry point (pretrain_gpt.py's body) on gloo processes.

The same data, seed and global batch trained for 10 steps at expert parallel size 2 (and with tensor
and pipeline parallelism) give the losses of one process holding every expert (EP 1, the micro-batches
accumulated): the routing happens per micro-batch either way, so the same tokens meet the same experts
and the same capacity. Top-2 gating with argmax second experts (--disable-moe-top2-2nd-expert-sampling)
is deterministic, and capacity factor 1 with 4 experts drops tokens (the reported drop fraction is > 0),
so dropping is part of what must agree. The iteration line carries "moe loss" (Megatron-DeepSpeed's
name: the coefficient times the layers' summed auxiliary losses) and "moe drop fraction".

Tolerance rtol 2e-5 as tests/families/gpt/test_parity.py (fp32 sums in another order; the expert outputs
travel through all-to-alls and come back bit for bit, the gradients are summed in another order). A
mis-routed expert (wrong expert parallel rank order), a missing expert gradient reduction or an expert
gradient averaged over the wrong group moves the loss by 1e-3 or more within 10 steps. Clipping is on
(--clip-grad 1.0, Megatron's default), so the global norm with experts must agree too.
"""
import re

import pytest

from tests.distributed import run_distributed
from tests.training.cli import SMALL_GPT

MOE = ("--num-experts 4 --expert-interval 1 --topk 2 --disable-moe-top2-2nd-expert-sampling --hidden-dropout 0 "
       "--attention-dropout 0 --train-iters 10 --global-batch-size 8 --lr-warmup-iters 0").split()
RTOL = 2e-5
FIELD = r"\| {}: (\S+) \|"


def _train(rank: int, world_size: int, argv: list[str]):
    """pretrain_gpt.py's body in this process: (iteration, loss) history and what it printed."""
    import contextlib
    import io

    from megatron_ds.config import parse_args
    from megatron_ds.families import pretrain

    cfg, ignored = parse_args(argv)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        state = pretrain(cfg, ignored)
    return state.history, out.getvalue()


def _run(world, extra=()):
    results = run_distributed(_train, world, SMALL_GPT + MOE + list(extra), timeout=900)
    history, stdout = results[-1]  # the last rank holds the last pipeline stage and prints
    assert [it for it, _ in history] == list(range(1, 11))
    return [loss for _, loss in history], stdout


def _field(stdout: str, name: str) -> list[float]:
    return [float(v) for v in re.findall(FIELD.format(re.escape(name)), stdout)]


@pytest.fixture(scope="module")
def reference():
    # one validation pass at the end (--eval-iters 1): it draws no random numbers (argmax routing, no
    # dropout), so the training losses are those of a run without it
    return _run(1, ["--eval-iters", "1"])


def test_reference_reports_moe_fields(reference):
    losses, stdout = reference
    assert len(set(losses)) == 10  # the steps change the model (mock tokens are random: little to learn)
    moe_loss, dropped, lm = _field(stdout, "moe loss"), _field(stdout, "moe drop fraction"), _field(stdout, "lm loss")
    assert len(moe_loss) == len(dropped) == len(lm) == 10
    # coefficient 0.1 x 2 MoE layers x l_aux (about 1 for balanced top-2 routing: E * sum(me * ce) / E ...)
    assert all(0.05 < v < 1.0 for v in moe_loss)
    assert all(0.0 < v < 0.5 for v in dropped)  # capacity factor 1 drops some routes
    # lm loss on the line is the language-model loss; the loss trained on adds the moe loss
    for total, a, b in zip(losses, lm, moe_loss):
        assert total == pytest.approx(a + b, rel=1e-5)  # the printed values have 7 digits
    valid = re.search(r"validation loss at iteration 10 on validation set \| lm loss value: (\S+) \| "
                      r"lm loss PPL: \S+ \| moe loss value: (\S+) \| moe drop fraction value: (\S+) \|", stdout)
    assert valid is not None, stdout[-2000:]


def test_ep2_dp2_equals_ep1(reference):
    """4 processes, DP 4: experts split over expert parallel groups of 2, their gradients averaged over
    the 2 ranks holding the same experts; vs one process holding all 4 experts."""
    losses, stdout = _run(4, ["--moe-expert-parallel-size", "2"])
    assert losses == pytest.approx(reference[0], rel=RTOL)
    assert _field(stdout, "moe drop fraction") == pytest.approx(_field(reference[1], "moe drop fraction"), rel=1e-5)


@pytest.mark.parametrize("expert_tp", [False, True])
def test_tp2_ep2_equals_ep1(reference, expert_tp):
    """TP 2 x DP 2 with EP 2: without expert tensor parallelism DeepSpeed's expert parallel group is the
    two TP ranks of a replica (each holds 2 whole experts and half of every expert's capacity slots);
    with it each TP rank holds half of every expert and the group is 2 data parallel ranks."""
    extra = ["--tensor-model-parallel-size", "2", "--moe-expert-parallel-size", "2"]
    losses, _ = _run(4, extra + (["--enable-expert-tensor-parallelism"] if expert_tp else []))
    # Split experts sum their matmuls in another order; Adam amplifies that noise on the gradients
    # clipping scales (measured: 1e-7 relative without clipping, up to 4.3e-5 by step 9 with it), so
    # 1e-4 there; a wrong expert gradient norm or reduction moves the losses from step 2 on by far more.
    assert losses == pytest.approx(reference[0], rel=1e-4 if expert_tp else RTOL)


def test_pp2_with_moe_on_both_stages_equals_pp1(reference):
    """PP 2 x DP 2, EP 2: layer 1 (stage 0) and layer 2 (stage 1) are both MoE layers; the auxiliary
    loss of stage 0 crosses to stage 1 in the activation tuple and its gradient comes back."""
    losses, stdout = _run(4, ["--pipeline-model-parallel-size", "2", "--moe-expert-parallel-size", "2"])
    assert losses == pytest.approx(reference[0], rel=RTOL)
    assert _field(stdout, "moe loss") == pytest.approx(_field(reference[1], "moe loss"), rel=1e-5)


def test_full_recompute_equals_no_recompute(reference):
    """--checkpoint-activations reruns each layer's forward in backward: the auxiliary loss (and the
    drop fraction) must still count once."""
    losses, stdout = _run(1, ["--checkpoint-activations"])
    assert losses == pytest.approx(reference[0], rel=RTOL)
    assert _field(stdout, "moe loss") == pytest.approx(_field(reference[1], "moe loss"), rel=1e-5)


@pytest.mark.parametrize("zero", ["1", "2"])
def test_zero_with_moe_param_groups_equals_ep1(reference, zero):
    """ZeRO 1 and 2 (the plain engine) at DP 2, EP 2: DeepSpeed's ZeRO partitions and reduces the experts
    over their own optimizer groups (--create-moe-param-group)."""
    losses, _ = _run(2, ["--zero-stage", zero, "--create-moe-param-group", "--no-pipeline-parallel",
                         "--moe-expert-parallel-size", "2"])
    assert losses == pytest.approx(reference[0], rel=RTOL)


def test_bf16_ep2_equals_bf16_ep1():
    """bf16: DeepSpeed's BF16_Optimizer (pipeline engine, ZeRO 0) with its MoE parameter groups, at DP 2
    with the experts split (EP 2) and replicated (EP 1). lr 1e-2 so that ten steps move the loss by
    3%. bf16 rounds the activations and the expert outputs, summed in another order after the
    all-to-all: measured up to 1.2e-3 relative; 5e-3 leaves room (bf16 against fp32 differs by 5e-3
    here), while an expert gradient missing its reduction lets the replicas drift apart."""
    common = ["--bf16", "--create-moe-param-group", "--lr", "1e-2"]
    replicated, _ = _run(2, common)
    split, _ = _run(2, common + ["--moe-expert-parallel-size", "2"])
    assert split == pytest.approx(replicated, rel=5e-3)


def _train_fp16(rank: int, world_size: int, argv: list[str]):
    """``_train`` with DeepSpeed's fp16 path allowed on the CPU, as tests/training/test_fp16.py runs it
    (the CPU accelerator claims fp16; the run resolves as on a GPU)."""
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    import megatron_ds.training.pretrain as pretrain

    CPU_Accelerator.is_fp16_supported = lambda self: True
    prepare = pretrain.prepare
    pretrain.prepare = lambda *args, **kwargs: prepare(*args, **{**kwargs, "device_type": "cuda"})
    return _train(rank, world_size, argv)


def test_fp16_ep2_equals_fp16_ep1():
    """fp16: DeepSpeed's fp16 optimizer (pipeline engine, ZeRO 0, dynamic loss scale) with MoE parameter
    groups, experts split (EP 2) and replicated (EP 1) at DP 2. The loss scale multiplies the auxiliary
    loss's gradient with the LM loss's (engine.scale_fp16_loss hooks the total), so a scale applied to
    one part only, or an expert gradient norm taken per rank, parts the two runs. fp16 keeps 10 mantissa
    bits: the two orders of summation agree closer than bf16's (5e-3 there); 2.5e-3 here (measured
    3.2e-4 on AVX2 CPUs, 1.3e-3 at step 6 on AVX-512 ones, whose kernels sum in other orders again)."""
    common = ["--fp16", "--create-moe-param-group", "--lr", "1e-2"]
    replicated, _ = run_distributed(_train_fp16, 2, SMALL_GPT + MOE + common, timeout=900)[-1]
    split, stdout = run_distributed(_train_fp16, 2, SMALL_GPT + MOE + common + ["--moe-expert-parallel-size", "2"],
                                    timeout=900)[-1]
    assert [it for it, _ in split] == list(range(1, 11))
    assert [x for _, x in split] == pytest.approx([x for _, x in replicated], rel=2.5e-3)
    # the optimizer stepped (an overflow skips a step and halves the scale): most of the ten did
    skipped = [int(n) for n in re.findall(r"number of skipped iterations: +(\d+)", stdout)]
    assert len(skipped) == 10 and sum(skipped) < 5, skipped
