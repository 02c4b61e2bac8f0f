"""Megatron-LM's MoE layer (model/mlm_moe.py) trained through the real entry point on gloo processes.

The same data, seed and global batch trained for 5 steps with the experts split over 2 expert parallel ranks
(DP 2; all-to-all and all-gather token dispatch) and over 2 pipeline stages give the losses of one process
holding every expert (EP 1, the micro-batches accumulated): routing and the auxiliary losses are per
micro-batch either way, and an expert's initial weights do not depend on the expert parallel rank. The
iteration line carries "moe loss" (the weighted aux + z losses) and Megatron-LM's load_balancing_loss / z_loss.

Tolerance rtol 2e-5 as tests/training/test_moe.py (fp32 sums in another order: the routes travel through
all-to-alls or all-gathers and the expert gradients are summed over the expert data parallel group). A
mis-routed token, a missing or wrongly grouped expert gradient reduction moves the losses by far more within
5 steps. Clipping is on (--clip-grad 1.0), so the global norm with experts must agree too.
"""
import pytest

from tests.distributed import run_distributed
from tests.training.cli import SMALL_GPT
from tests.training.test_moe import _field, _train

MOE = ("--num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 0.01 --moe-z-loss-coeff 0.001 --swiglu "
       "--disable-bias-linear --moe-shared-expert-intermediate-size 16 --hidden-dropout 0 --attention-dropout 0 "
       "--train-iters 5 --global-batch-size 8 --lr-warmup-iters 0 --lr 1e-2").split()
RTOL = 2e-5


def _run(world, extra=(), moe=MOE):
    results = run_distributed(_train, world, SMALL_GPT + list(moe) + list(extra), timeout=600)
    history, stdout = results[-1]  # the last rank holds the last pipeline stage and prints
    assert [it for it, _ in history] == list(range(1, 6))
    return [loss for _, loss in history], stdout


@pytest.fixture(scope="module")
def reference():
    return _run(1)


def test_reference_reports_megatron_lms_moe_fields(reference):
    losses, stdout = reference
    lm, moe = _field(stdout, "lm loss"), _field(stdout, "moe loss")
    balance, z = _field(stdout, "load_balancing_loss"), _field(stdout, "z_loss")
    assert len(lm) == len(moe) == len(balance) == len(z) == 5
    # the balancing loss is about 1 when the routing is balanced (E sum_i f_i P_i with f_i = P_i = 1/E)
    assert all(0.9 < b < 1.5 for b in balance)
    for total, a, b in zip(losses, lm, moe):
        assert total == pytest.approx(a + b, rel=1e-5)  # the loss trained on adds the weighted MoE losses
    for m, b, zz in zip(moe, balance, z):  # 2 MoE layers, each 0.01 x its balancing loss + 0.001 x its z-loss
        assert m == pytest.approx(2 * (0.01 * b + 0.001 * zz), rel=1e-5)


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_ep2_equals_ep1(reference, dispatcher):
    """DP 2 with the 4 experts split 2 + 2 over the two ranks; their gradients averaged over the expert data
    parallel group (here each rank alone: DeepSpeed's reduction must not average them with the other rank's)."""
    losses, stdout = _run(2, ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", dispatcher])
    assert losses == pytest.approx(reference[0], rel=RTOL)
    assert _field(stdout, "moe loss") == pytest.approx(_field(reference[1], "moe loss"), rel=1e-5)


def test_pp2_equals_one_process(reference):
    """PP 2: one MoE layer per stage; stage 0's auxiliary loss crosses to stage 1 in the activation tuple."""
    losses, _ = _run(2, ["--pipeline-model-parallel-size", "2"])
    assert losses == pytest.approx(reference[0], rel=RTOL)


def test_resume_is_bitwise_with_the_expert_bias(tmp_path):
    """DP 2 at EP 1, auxiliary-loss-free balancing on: the routers' expert biases (persistent buffers, moved
    after every step) are saved and loaded with the weights, so a run stopped at step 3 and resumed equals the
    uninterrupted run bit for bit; the bias moves routing, so the runs with and without it differ."""
    extra = ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
             "--moe-router-bias-update-rate", "0.05"]
    straight, _ = _run(2, extra)
    ckpt = str(tmp_path / "ckpt")
    first = run_distributed(_train, 2, SMALL_GPT + MOE + extra + ["--save", ckpt, "--save-interval", "100",
                                                                  "--exit-interval", "3"], timeout=600)[-1][0]
    second = run_distributed(_train, 2, SMALL_GPT + MOE + extra + ["--load", ckpt], timeout=600)[-1][0]
    assert [it for it, _ in first] == [1, 2, 3] and [it for it, _ in second] == [4, 5]
    assert [loss for _, loss in first + second] == straight
    no_bias, _ = _run(2, extra[:2])
    assert no_bias[:1] == straight[:1] and no_bias[1:] != straight[1:]  # step 1 runs before any update


def test_zero1_ep2_equals_ep1(reference):
    """--use-distributed-optimizer (ZeRO 1) at DP 2 with the experts split: DeepSpeed's ZeRO optimizer partitions
    and reduces them over their expert optimizer groups, which the layer's marked parameters always get."""
    losses, _ = _run(2, ["--expert-model-parallel-size", "2", "--use-distributed-optimizer"])
    assert losses == pytest.approx(reference[0], rel=RTOL)


def test_bf16_ep2_equals_bf16_ep1():
    """bf16 (DeepSpeed's BF16_Optimizer, pipeline engine) at DP 2, experts split (EP 2) and replicated (EP 1).
    bf16 rounds the expert inputs and outputs, summed in another order after the all-to-all: measured up to 2.3e-5
    relative over the 5 steps, so 3e-4; a missing expert reduction or norm lets the replicas drift apart."""
    ep1, _ = _run(2, ["--bf16"])
    ep2, _ = _run(2, ["--bf16", "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"])
    assert ep2 == pytest.approx(ep1, rel=3e-4)


def test_full_recompute_equals_no_recompute(reference):
    """--recompute-granularity full reruns each layer's forward inside backward: the auxiliary losses still
    count once (the reported moe loss too)."""
    losses, stdout = _run(1, ["--recompute-granularity", "full", "--recompute-method", "uniform"])
    assert losses == pytest.approx(reference[0], rel=RTOL)
    assert _field(stdout, "moe loss") == pytest.approx(_field(reference[1], "moe loss"), rel=1e-5)


def test_pp2_ep2_equals_one_process(reference):
    """4 processes: PP 2 x DP 2 with each stage's experts split over its 2 data parallel ranks (EP 2)."""
    losses, _ = _run(4, ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2",
                         "--moe-token-dispatcher-type", "alltoall"])
    assert losses == pytest.approx(reference[0], rel=RTOL)


def test_per_layer_logging(reference):
    """--moe-per-layer-logging: each MoE layer's losses on the line too; the totals are their mean."""
    losses, stdout = _run(1, ["--moe-per-layer-logging"])
    assert losses == reference[0]
    for name in ("load_balancing_loss", "z_loss"):
        one, two = _field(stdout, f"{name} layer 1"), _field(stdout, f"{name} layer 2")
        assert len(one) == len(two) == 5 and one != two
        assert _field(stdout, name) == pytest.approx([(a + b) / 2 for a, b in zip(one, two)], rel=1e-5)


def test_tp2_equals_one_process(reference):
    """TP 2 at EP 1: both tensor parallel ranks hold whole experts and the same tokens, and compute them alike."""
    losses, _ = _run(2, ["--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"])
    assert losses == pytest.approx(reference[0], rel=RTOL)


@pytest.mark.parametrize("extra", [
    ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "1"],
    ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "1",
     "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"],
    ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "1",
     "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "allgather"],
    ["--tensor-model-parallel-size", "2", "--sequence-parallel"],  # Megatron-LM's default ETP = TP
], ids=["tp2_sp_etp1", "tp2_sp_etp1_ep2_alltoall", "tp2_sp_etp1_ep2_allgather", "tp2_sp_default_etp2"])
def test_sequence_parallel_equals_one_process(reference, extra):
    """Megatron sequence parallelism at TP 2 (one data parallel rank): each tensor parallel rank routes its half
    of every sequence. At EP 1 both hold all experts; at EP 2 the two tensor parallel ranks are the expert
    parallel group, the routes crossing between them. The balancing and z losses are those of the whole
    sequences (tokens per expert summed over the two ranks, as Megatron-LM's router), and the router's, shared
    experts' (and at EP 1 experts') gradients are summed over them: the losses, the reported MoE losses and the
    clipped gradient norm equal one process's. Without --expert-tensor-parallel-size (Megatron-LM's default, TP) each
    rank holds half of every expert's MLP (fc1's gate and up rows, fc2's columns) and runs it on both ranks' tokens."""
    losses, stdout = _run(2, extra)
    assert losses == pytest.approx(reference[0], rel=RTOL)
    for name in ("moe loss", "load_balancing_loss", "z_loss", "grad norm"):
        assert len(_field(stdout, name)) == 5, name
        assert _field(stdout, name) == pytest.approx(_field(reference[1], name), rel=1e-5), name


def test_sequence_parallel_seq_aux_loss_and_expert_bias():
    """The sequence-level balancing loss (each sequence's tokens per expert, summed over the ranks holding its
    parts) and the auxiliary-loss-free expert bias (its tokens per expert summed over them too) under sequence
    parallelism at TP 2 x EP 2 equal one process's."""
    extra = ["--moe-router-load-balancing-type", "seq_aux_loss", "--moe-router-score-function", "sigmoid",
             "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.05"]
    one, one_out = _run(1, extra)
    losses, stdout = _run(2, extra + ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                      "--expert-tensor-parallel-size", "1", "--expert-model-parallel-size", "2",
                                      "--moe-token-dispatcher-type", "alltoall"])
    assert losses == pytest.approx(one, rel=RTOL)
    assert len(_field(stdout, "seq_load_balancing_loss")) == 5
    assert _field(stdout, "seq_load_balancing_loss") == pytest.approx(_field(one_out, "seq_load_balancing_loss"),
                                                                      rel=1e-5)


@pytest.fixture(scope="module")
def reference_4_layers():
    return _run(1, ["--num-layers", "4"])


@pytest.mark.parametrize("schedule", [["--num-layers-per-virtual-pipeline-stage", "1"], ["--enable-zbh1-pipeline"]],
                         ids=["interleaved", "zbh1"])
def test_pp2_schedules_equal_one_process(reference_4_layers, schedule):
    """4 layers on 2 pipeline ranks, interleaved (2 chunks of one layer each) or ZB-H1: the executor
    (pipeline/executor.py) carries the layers' summed auxiliary loss between stages beside the hidden state, and
    its gradient back, so the losses (the balancing and z losses included) equal one process's."""
    losses, stdout = _run(2, ["--num-layers", "4", "--pipeline-model-parallel-size", "2", *schedule])
    assert losses == pytest.approx(reference_4_layers[0], rel=RTOL)
    assert len(_field(stdout, "moe loss")) == 5
    assert _field(stdout, "moe loss") == pytest.approx(_field(reference_4_layers[1], "moe loss"), rel=1e-5)


def test_sinkhorn_ep2_equals_ep1():
    """Sinkhorn routing balances each micro-batch's tokens on the rank that routes them (Megatron-LM's router:
    the tokens it sees), so the experts split over 2 expert parallel ranks train as one process holding all."""
    extra = ["--moe-router-load-balancing-type", "sinkhorn", "--moe-aux-loss-coeff", "0"]
    one, _ = _run(1, extra)
    losses, stdout = _run(2, extra + ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"])
    assert losses == pytest.approx(one, rel=RTOL)
    assert "load_balancing_loss" not in stdout  # no balancing loss: the routing balances


def test_etp2_with_biases_equals_one_process():
    """Linear biases on (no --disable-bias-linear): a split expert's fc1 bias is split with its rows, its fc2 bias
    added once to the partial sums (on the first tensor parallel rank, its gradient summed over both)."""
    with_bias = [a for a in SMALL_GPT + MOE if a != "--disable-bias-linear"]

    def run(world, extra=()):
        history, stdout = run_distributed(_train, world, with_bias + list(extra), timeout=600)[-1]
        return [loss for _, loss in history], stdout

    one, one_out = run(1)
    losses, stdout = run(2, ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                             "--expert-tensor-parallel-size", "2"])
    assert losses == pytest.approx(one, rel=RTOL)
    assert _field(stdout, "grad norm") == pytest.approx(_field(one_out, "grad norm"), rel=1e-5)


@pytest.mark.parametrize("ep", [1, 2])
def test_context_parallel_equals_one_process(reference, ep):
    """--context-parallel-size 2: each CP rank routes its two chunks of every sequence; the balancing and z losses
    are the whole sequences' (tokens per expert summed over the CP ranks) and trained at CP x the rank's part, as
    its language-model loss; at EP 2 the two CP ranks are the expert parallel group (expert parallelism over data
    x context parallel ranks). Losses, reported MoE losses and the clipped gradient norm equal one process's."""
    extra = ["--context-parallel-size", "2"] + (["--expert-model-parallel-size", "2"] if ep > 1 else [])
    losses, stdout = _run(2, extra)
    assert losses == pytest.approx(reference[0], rel=RTOL)
    for name in ("moe loss", "load_balancing_loss", "z_loss", "grad norm"):
        assert len(_field(stdout, name)) == 5, name
        assert _field(stdout, name) == pytest.approx(_field(reference[1], name), rel=1e-5), name


def test_llm_jp_v4_shaped_moe_trains_at_ep2_pp2_and_resumes_bitwise(tmp_path, e2e_data):
    """Issue 44's model: fine-grained experts (16 of a quarter of the dense width), top-8, a shared expert,
    sequence-level balancing and the auxiliary-loss-free expert bias, as LLM-jp's v4 MoE runs are configured,
    on real text (the docstring corpus) at EP 2 x PP 2 (4 processes, all-to-all dispatch): the loss falls, and a
    run stopped at step 6 and resumed from its checkpoint (the stacked experts of both EP ranks, the routers'
    biases) ends bitwise as the uninterrupted one."""
    argv = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
            "--micro-batch-size 2 --global-batch-size 8 --lr 5e-3 --lr-decay-style constant --lr-warmup-iters 0 "
            "--train-iters 12 --log-interval 1 --eval-iters 0 --eval-interval 1000 --num-workers 0 --seed 1234 "
            "--split 100,0,0 --hidden-dropout 0 --attention-dropout 0 --swiglu --disable-bias-linear "
            "--num-experts 16 --moe-router-topk 8 --moe-ffn-hidden-size 32 --moe-shared-expert-intermediate-size 64 "
            "--moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-3 "
            "--moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-3 "
            "--expert-model-parallel-size 2 --pipeline-model-parallel-size 2 --moe-token-dispatcher-type alltoall"
            ).split() + ["--data-path", e2e_data["prefix"], "--vocab-file", e2e_data["vocab"],
                         "--merge-file", e2e_data["merges"]]
    straight = [loss for _, loss in run_distributed(_train, 4, argv, timeout=600)[-1][0]]
    assert len(straight) == 12 and sum(straight[-3:]) / 3 < sum(straight[:3]) / 3 - 0.5
    ckpt = str(tmp_path / "ckpt")
    first = run_distributed(_train, 4, argv + ["--save", ckpt, "--save-interval", "100", "--exit-interval", "6"],
                            timeout=600)[-1][0]
    second = run_distributed(_train, 4, argv + ["--load", ckpt], timeout=600)[-1][0]
    assert [it for it, _ in first] == list(range(1, 7)) and [it for it, _ in second] == list(range(7, 13))
    assert [loss for _, loss in first + second] == straight


@pytest.fixture(scope="module")
def balanced_reference():
    """One process with both balancing losses (aux_loss and seq_aux_loss), the z-loss and the expert bias."""
    return _run(1, BALANCED)


BALANCED = ["--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss", "--moe-aux-loss-coeff", "0.01", "0.02",
            "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
            "--moe-router-bias-update-rate", "0.05"]
TP2_CP2_SP = ["--tensor-model-parallel-size", "2", "--context-parallel-size", "2", "--sequence-parallel"]


EP4_ALLTOALL = ["--expert-model-parallel-size", "4", "--moe-token-dispatcher-type", "alltoall"]


@pytest.mark.parametrize("extra", [["--expert-tensor-parallel-size", "1"],
                                   ["--expert-tensor-parallel-size", "1", *EP4_ALLTOALL]],
                         ids=["etp1_ep1", "etp1_ep4_alltoall"])
def test_context_parallel_with_sequence_parallel_equals_one_process(balanced_reference, extra):
    """4 processes, TP 2 x CP 2 with --sequence-parallel (Megatron-LM allows it: its router reduces over the
    tp_cp group, router.py _apply_aux_loss / _apply_seq_aux_loss): each rank routes a quarter of every sequence,
    the tensor parallel half of its CP chunks. The tokens per expert of both balancing losses are summed over the
    TP x CP ranks, the expert bias's counts over TP x DP x CP (moe_utils.get_updated_expert_bias), so the losses,
    the reported MoE losses and the clipped gradient norm equal one process's; at EP 4 the experts are split over
    all four ranks, the routes crossing tensor and context parallel ranks. The bias moves routing (a wrong count
    changes the later steps' losses)."""
    losses, stdout = _run(4, BALANCED + TP2_CP2_SP + extra)
    assert losses == pytest.approx(balanced_reference[0], rel=RTOL)
    for name in ("moe loss", "load_balancing_loss", "seq_load_balancing_loss", "z_loss", "grad norm"):
        assert len(_field(stdout, name)) == 5, name
        assert _field(stdout, name) == pytest.approx(_field(balanced_reference[1], name), rel=1e-5), name


def test_tp2_cp2_etp2_ep2_equals_one_process(reference):
    """4 processes: TP 2 x CP 2 with sequence parallelism, each expert split over the 2 tensor parallel ranks
    (ETP 2) and the experts over the 2 context parallel ranks of each tensor parallel rank (EP 2: DeepSpeed's expert
    groups along its data parallel axis, DP x CP), all-to-all dispatch."""
    losses, stdout = _run(4, TP2_CP2_SP + ["--expert-tensor-parallel-size", "2", "--expert-model-parallel-size", "2",
                                           "--moe-token-dispatcher-type", "alltoall"])
    assert losses == pytest.approx(reference[0], rel=RTOL)
    assert _field(stdout, "grad norm") == pytest.approx(_field(reference[1], "grad norm"), rel=1e-5)


HEADS4 = ["--num-attention-heads", "4"]  # so that TP 4 divides them
TP4_SP = HEADS4 + ["--tensor-model-parallel-size", "4", "--sequence-parallel"]


@pytest.fixture(scope="module")
def reference_4_heads():
    return _run(1, HEADS4)


@pytest.mark.parametrize("extra", [
    ["--expert-tensor-parallel-size", "2", "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type",
     "alltoall"],
    ["--expert-tensor-parallel-size", "2", "--use-distributed-optimizer"],
    ["--expert-tensor-parallel-size", "1", "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type",
     "allgather", "--use-distributed-optimizer"],
], ids=["etp2_ep2_alltoall", "etp2_ep1_zero1", "etp1_ep2_allgather_zero1"])
def test_tp4_expert_grid_equals_one_process(reference_4_heads, extra):
    """4 processes at TP 4 with sequence parallelism, Megatron-LM's expert grid (parallel/groups.py expert_grid:
    ETP x EP x expert data parallel ranks, ETP fastest) over them:
    - ETP 2 x EP 2: ranks {0, 1} hold halves of experts 0-1, {2, 3} halves of experts 2-3; the routes go all-to-all
      between ranks 2 apart, then are gathered over the ETP pair; one copy of each shard, so the expert gradient
      norm is summed over the 4 ranks once (DeepSpeed's helper would sum over TP, then EP again);
    - ETP 2 x EP 1 under ZeRO 1: ranks 0 and 2 hold the same halves of all experts (the expert data parallel group,
      over which DeepSpeed reduces and ZeRO partitions them), each computing the tokens of its ETP pair;
    - ETP 1 x EP 2 under ZeRO 1: whole experts, EP groups of 2 ranks inside the TP group (EP no multiple of TP);
      every rank's experts count in ZeRO's norm, not only TP rank 0's.
    Each equals one process in the losses, the reported MoE losses and the clipped gradient norm."""
    losses, stdout = _run(4, TP4_SP + extra)
    assert losses == pytest.approx(reference_4_heads[0], rel=RTOL)
    for name in ("moe loss", "load_balancing_loss", "z_loss", "grad norm"):
        assert len(_field(stdout, name)) == 5, name
        assert _field(stdout, name) == pytest.approx(_field(reference_4_heads[1], name), rel=1e-5), name


BIASED = [a for a in MOE if a != "--disable-bias-linear"]


@pytest.fixture(scope="module")
def biased_reference():
    return _run(1, HEADS4, moe=BIASED)


@pytest.mark.parametrize("extra", [
    TP4_SP + ["--expert-tensor-parallel-size", "2"],
    HEADS4 + ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "2"],
], ids=["tp4_etp2_ep2", "tp2_etp2_ep2"])
def test_split_experts_biases_equal_one_process(biased_reference, extra):
    """With biases, experts split over ETP and EP 2 (4 processes): each expert's fc2 bias is added on the first rank
    of its ETP group only, whose gradient is whole; it is not summed over TP (at TP 4 x ETP 2 the other pair holds
    other experts' biases) and counts once in the gradient norm, as in one process. TP 2 x ETP 2 x EP 2 is also the
    suite's case of ETP = TP with EP > 1 (split experts, expert parallel groups along the data parallel ranks);
    ETP = TP at TP 4 would differ from it only in the split's size (GroupedExperts' split takes any ETP)."""
    one, one_out = biased_reference
    losses, stdout = _run(4, extra + ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"],
                          moe=BIASED)
    assert losses == pytest.approx(one, rel=RTOL)
    assert _field(stdout, "grad norm") == pytest.approx(_field(one_out, "grad norm"), rel=1e-5)
