"""fp16 through DeepSpeed on the CPU: the plain engine at ZeRO 0, 1 and 2 and at TP 2 (ZeRO 0), the
pipeline engine (PP 2, ZeRO 0) and the interleaved executor (PP 2 x 2 chunks, ZeRO 0) each

1. scale the loss in backward: the gradient reaching the logits is the loss scale times the cross
   entropy's gradient computed here from the logits and labels (softmax minus one-hot, averaged over
   the tokens of a micro-batch and the micro-batches of a step);
2. skip the step of a non-finite gradient (an inf planted in the logits' gradient of the last
   iteration): no parameter moves, the loss scale halves, the iteration line counts the skip;
3. train as fp32 does: the losses of a short run equal an fp32 run's within fp16 tolerance, and the
   iteration line reports the real loss scale and the unscaled grad norm -- the norm DeepSpeed's
   ZeRO-0 fp16 optimizer also clips with, which counts the tied embedding's two pipeline copies and
   the tensor parallel shards right only with megatron_ds's mend (ds_compat.count_fp16_grads_once).

fp16 on the CPU, in the test processes only: DeepSpeed's CPU accelerator says it has no fp16 (it asks
oneDNN for fp16 kernels) and its engine then refuses fp16; told yes, DeepSpeed's fp16 machinery
(dynamic loss scaler, FP16_UnfusedOptimizer, ZeRO's fp16 path) runs on the CPU as it runs on a GPU.
The run is resolved as for a GPU, where these users train: on a CPU device the layout refuses --fp16.

The JSON's "fp16" block: "initial_scale_power" 8, a scale of 256 under which the tiny model's scaled
gradients stay far below fp16's largest number (65504), so nothing overflows but the planted inf;
"hysteresis" 1: with DeepSpeed's default 2 the ZeRO optimizers' DynamicLossScaler lets the first
overflow only lower its hysteresis count (loss_scaler.py, update_scale), while the ZeRO-0 fp16
optimizers have no hysteresis (their _update_scale) and halve at once; with 1 every engine halves at
the first overflow.
"loss_scale_window" 1000: the scale does not grow within the run.

SGD without weight decay, not Adam: DeepSpeed's FP16_UnfusedOptimizer (ZeRO 0) takes one step on zero
gradients when it is built (initialize_optimizer_states), which shifts Adam's bias correction by a
step and applies one weight decay, moving the losses by ~4e-4 -- a property of that code path, not of
fp16 precision -- and Adam's update hardly depends on the gradient's scale. SGD with momentum is
unchanged by a zero step, and a loss scale missing from (or left in) the gradients shows in its losses.
"""
import contextlib
import io
import json

import pytest
import torch

from tests.distributed import run_distributed
from tests.gpu.helpers import parse_iteration_line

SCALE = 2.0 ** 8  # "initial_scale_power": 8 below
ITERS = 4
MICRO_BATCHES = 2  # per step: global batch 4 / (micro batch 2 x DP 1)
INF_AT = (ITERS - 1) * MICRO_BATCHES  # the first micro-batch of the last iteration
# 4 layers: the interleaved schedule needs PP 2 x 2 chunks of one layer
ARGS = ("--num-layers 4 --hidden-size 32 --num-attention-heads 2 --seq-length 16 --max-position-embeddings 16 "
        "--micro-batch-size 2 --global-batch-size 4 --optimizer sgd --lr 0.3 --weight-decay 0 "
        "--lr-decay-style constant --mock-data --vocab-size 128 --make-vocab-size-divisible-by 4 "
        "--log-interval 1 --eval-interval 1000 --eval-iters 0 --num-workers 0 --seed 1234 "
        f"--hidden-dropout 0 --attention-dropout 0 --train-iters {ITERS}").split()
FP16_JSON = {"fp16": {"initial_scale_power": 8, "hysteresis": 1, "loss_scale_window": 1000},
             # torch's SGD is outside DeepSpeed's list of optimizers tested with ZeRO
             "zero_allow_untested_optimizer": True}
PP2 = ["--pipeline-model-parallel-size", "2"]
ENGINES = {  # name: (processes, flags); ZeRO 0 is the default stage
    "zero0": (1, ["--no-pipeline-parallel", "--zero-stage", "0"]),
    "zero1": (1, ["--no-pipeline-parallel", "--zero-stage", "1"]),
    "zero2": (1, ["--no-pipeline-parallel", "--zero-stage", "2"]),
    "tp2": (2, ["--no-pipeline-parallel", "--tensor-model-parallel-size", "2"]),
    "pipeline": (2, PP2),
    "interleaved": (2, PP2 + ["--num-layers-per-virtual-pipeline-stage", "1"]),
}


class _Spy:
    """One run as seen from inside: the logits and their gradient at the first backward, an inf planted
    in that gradient at backward ``inf_at`` (last stage), and whether each step moved a parameter."""

    def __init__(self, inf_at):
        self.inf_at, self.backwards, self.moved, self.first = inf_at, 0, [], {}

    def loss_fn(self, real):
        def spied(output, labels_and_mask, **kwargs):
            if output.requires_grad:  # training: evaluation runs without autograd
                if self.backwards == 0:
                    labels, mask = labels_and_mask
                    self.first.update(logits=output.detach().float(), labels=labels.clone(), mask=mask.float())
                output.register_hook(self._hook(self.backwards))
                self.backwards += 1
            return real(output, labels_and_mask, **kwargs)
        return spied

    def _hook(self, index):
        def hook(grad):
            if index == 0:
                self.first["grad"] = grad.detach().float()
            if index == self.inf_at:
                grad = grad.clone()
                grad[(0,) * grad.dim()] = float("inf")
                return grad
            return None
        return hook

    def train_step(self, real):
        def spied(engine, *args):
            before = [p.detach().clone() for p in engine.module.parameters()]
            loss = real(engine, *args)
            self.moved.append(any(not torch.equal(b, p) for b, p in zip(before, engine.module.parameters())))
            return loss
        return spied


def _train(rank, world_size, runs):
    """Each (argv, inf_at) of ``runs`` trained in this process (one DeepSpeed import for all) with
    fp16 allowed on the CPU; per run what the spy saw, the losses and the iteration lines."""
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    import megatron_ds.model.language_model as language_model
    import megatron_ds.training.loop as loop
    import megatron_ds.training.pretrain as pretrain
    from megatron_ds.config import parse_args
    from megatron_ds.families import get_family

    CPU_Accelerator.is_fp16_supported = lambda self: True
    prepare = pretrain.prepare
    pretrain.prepare = lambda *args, **kwargs: prepare(*args, **{**kwargs, "device_type": "cuda"})
    # every model kind (plain, pipeline, interleaved chunks) binds its loss from language_model.language_model_loss
    # when it is built (language_model_loss_fn)
    real_loss, real_step = language_model.language_model_loss, loop.train_step
    results = []
    for argv, inf_at in runs:
        spy = _Spy(inf_at)
        language_model.language_model_loss, loop.train_step = spy.loss_fn(real_loss), spy.train_step(real_step)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            state = pretrain.pretrain(*parse_args(argv), get_family("gpt"))  # the GPT's entry point
        lines = [parse_iteration_line(x) for x in out.getvalue().splitlines() if x.startswith(" iteration ")]
        results.append(dict(spy.first, moved=spy.moved, losses=[x for _, x in state.history], lines=lines))
    return results


def _runs(names, json_path):
    """The fp16 runs of the engines ``names`` (all with the same number of processes), and on one
    process the fp32 reference too: name -> the last rank's results (the last pipeline stage holds
    the loss, the logits and the iteration lines), with every rank's ``moved``."""
    world = ENGINES[names[0]][0]
    runs = {n: (ARGS + ENGINES[n][1] + ["--fp16", "--deepspeed_config", str(json_path)], INF_AT) for n in names}
    if world == 1:
        runs["fp32"] = (ARGS + ENGINES["zero0"][1], None)  # nothing planted
    ranks = run_distributed(_train, world, list(runs.values()), timeout=600)
    return {name: _last_stage(ranks, i) for i, name in enumerate(runs)}


def _last_stage(ranks: list, i: int) -> dict:
    """Run ``i`` as the last pipeline stage saw it, its logits and their gradient gathered over the
    tensor parallel ranks (vocabulary shards in rank order), with every rank's ``moved``."""
    shards = [r[i] for r in ranks if "logits" in r[i]]
    gathered = {key: torch.cat([shard[key] for shard in shards], dim=-1) for key in ("logits", "grad")}
    return dict(ranks[-1][i], **gathered, moved_per_rank=[r[i]["moved"] for r in ranks])


@pytest.fixture(scope="module")
def ds_json(tmp_path_factory):
    path = tmp_path_factory.mktemp("fp16") / "ds_fp16.json"
    path.write_text(json.dumps(FP16_JSON))
    return path


@pytest.fixture(scope="module")
def single_process(ds_json):
    """fp32 and the plain engine at ZeRO 0/1/2, one process."""
    return _runs(["zero0", "zero1", "zero2"], ds_json)


@pytest.fixture(scope="module")
def two_processes(ds_json):
    """TP 2, the pipeline engine and the interleaved executor."""
    return _runs(["tp2", "pipeline", "interleaved"], ds_json)


@pytest.fixture(params=list(ENGINES))
def fp16_run(request):
    group = "single_process" if ENGINES[request.param][0] == 1 else "two_processes"
    return request.getfixturevalue(group)[request.param]


def _cross_entropy_grad(logits, labels, mask, micro_batches):
    """d(loss)/d(logits) of the mean token cross entropy over ``mask`` of one of ``micro_batches``
    micro-batches (DeepSpeed divides each micro-batch's loss by their number): (softmax - one-hot)."""
    probs = torch.softmax(logits.double(), dim=-1)
    one_hot = torch.nn.functional.one_hot(labels.long(), logits.shape[-1]).double()
    return (probs - one_hot) * (mask.double() / mask.sum() / micro_batches)[..., None]


def test_loss_is_scaled_in_backward(fp16_run):
    expected = SCALE * _cross_entropy_grad(fp16_run["logits"], fp16_run["labels"], fp16_run["mask"], MICRO_BATCHES)
    # The gradient arrives in fp16: each element is the fp32 arithmetic's value rounded once, to within
    # 2^-11 = 4.9e-4 relative (measured 4.87e-4; the power-of-two scale is exact), so 1e-3 allows two
    # such roundings. Unscaled, it would be off by a factor of 256.
    torch.testing.assert_close(fp16_run["grad"].double(), expected, rtol=1e-3, atol=0.0)


def test_overflow_skips_the_step_and_halves_the_scale(fp16_run):
    for moved in fp16_run["moved_per_rank"]:  # every pipeline stage
        assert moved == [True] * (ITERS - 1) + [False]
    lines = fp16_run["lines"]
    assert [x["loss scale"] for x in lines] == [SCALE] * (ITERS - 1) + [SCALE / 2]
    assert [x["number of skipped iterations"] for x in lines] == [0] * (ITERS - 1) + [1]


def test_losses_and_grad_norms_match_fp32(single_process, fp16_run):
    fp32 = single_process["fp32"]
    # fp16 rounds weights and activations to within 2^-11 relative; 1e-3 allows two such roundings
    # of a loss, where the mean over a step's 64 token losses leaves far less (measured 4e-6 after
    # three SGD steps). Steps 256 times too small (gradients left unscaled, then unscaled by the
    # optimizer) move the losses by 4e-3 at the second iteration and 9e-3 at the fourth (measured).
    assert fp16_run["losses"] == pytest.approx(fp32["losses"], rel=1e-3)
    # The log's grad norm is the unscaled one, which the ZeRO-0 optimizer also clips by: fp32's up to
    # two units of the 3 decimals printed (the skipped last step has none). Counting the tied
    # embedding's second copy or missing a shard moves it by 0.1 or more (measured).
    norms = [x["grad norm"] for x in fp16_run["lines"][:-1]]
    assert norms == pytest.approx([x["grad norm"] for x in fp32["lines"][:-1]], abs=2e-3)
