"""Gradient accumulation fusion (--gradient-accumulation-fusion, megatron_ds/parallel/weight_grad.py).

The weight-gradient GEMM of a tensor-parallel linear layer adds its fp32 result into the weight's
``main_grad`` (DeepSpeed's fp32 gradient of it, linked by training/engine.py) and writes no ``.grad``.
The layer tests compare ``main_grad`` against the sum over micro-batches of ``g^T x`` computed here in
float64 from the bf16 operands the layer saw (exact: a product of two bf16 numbers has 16 significant
bits), on every path a weight gradient takes: the plain GEMM, a zero-bubble weight pass, FP8, and at
TP 2 the synchronous and overlapped column-parallel backward with and without sequence parallelism,
and the row-parallel layer. The fp32 sums may differ from float64 by fp32 rounding only; the bf16
``.grad`` of the unfused path is rounded to 8 bits and lands much farther.

End to end, DeepSpeed's bf16 optimizer with fp32 accumulation (ds_configs/zero1_bf16.json) trains with
it at TP 2 with sequence parallelism and the overlapped backward on the plain engine, on the pipeline
engine at PP 2, and under our ZB-H1 executor at PP 2 (weight passes outside backward):
the first step's gradient norm (same weights, the gradients differ by bf16 roundings of the weight
gradients only) matches the unfused run's within 2^-7, which it could not if DeepSpeed's norm missed the
fused weights, and the losses differ from the unfused run's but stay about as close to an fp32 run's.
"""
from __future__ import annotations

import contextlib
import io
import re

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_distributed
from tests.training.common import TINY_GPT
from megatron_ds.families.gpt.gpt_family import GPT

TOKENS, IN, OUT = 16, 24, 8


def _fuse(weight):
    """Link an fp32 ``main_grad`` as training/engine.py does (ds_compat.link_main_grads)."""
    weight.main_grad = torch.zeros(weight.shape, dtype=torch.float32)


def _micro_batches(n=2, rows=TOKENS, cols=IN, seed=0, out_rows=None):
    """(input, gradient of the output) pairs: [rows, 1, cols] and [out_rows (rows), 1, OUT], bf16."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, 1, cols, generator=gen).bfloat16(),
             torch.randn(out_rows or rows, 1, OUT, generator=gen).bfloat16()) for _ in range(n)]


def _exact(pairs) -> torch.Tensor:
    """sum of g^T x over micro-batches in float64 (exact for bf16 operands at these sizes)."""
    return sum(g.double().reshape(-1, g.size(-1)).t() @ x.double().reshape(-1, x.size(-1)) for x, g in pairs)


def _errors(got: torch.Tensor, exact: torch.Tensor) -> float:
    """The largest deviation, relative to the largest element."""
    return ((got.double() - exact).abs().max() / exact.abs().max()).item()


def _column(fp8=None):
    from megatron_ds.parallel.layers import ColumnParallelLinear

    torch.manual_seed(0)
    return ColumnParallelLinear(IN, OUT, tp_group=None, bias=True, params_dtype=torch.bfloat16, fp8=fp8)


def _backward(layer, batches):
    """Each micro-batch's forward and backward; returns the (x, g) pairs the weight GEMM saw."""
    seen = []
    for x, g in batches:
        x = x.clone().requires_grad_()
        out, _ = layer(x)
        out.backward(g)
        seen.append((x.detach(), g))
    return seen


def test_plain_gemm_adds_fp32_into_main_grad_and_writes_no_grad():
    fused, plain = _column(), _column()
    _fuse(fused.weight)
    batches = _micro_batches()
    exact = _exact(_backward(fused, batches))
    _backward(plain, batches)
    assert fused.weight.grad is None
    assert fused.bias.grad is not None  # biases keep autograd's .grad
    fused_error, bf16_error = _errors(fused.weight.main_grad, exact), _errors(plain.weight.grad, exact)
    assert fused_error < 1e-6 < 1e-4 < bf16_error  # fp32 sums vs bf16 rounding (2^-9)


def test_zero_bubble_weight_pass_adds_into_main_grad_when_it_runs():
    from megatron_ds.parallel.weight_grad import WeightGradStore, allow_deferral

    layer, store = _column(), WeightGradStore()
    _fuse(layer.weight)
    batches = _micro_batches(1)
    allow_deferral(True)
    try:
        with store.deferring():
            seen = _backward(layer, batches)
    finally:
        allow_deferral(False)
    assert not layer.weight.main_grad.any()  # the B pass left W for later
    store.pop()  # outside backward, grad mode on: the buffer must not join a graph
    assert layer.weight.grad is None and not layer.weight.main_grad.requires_grad
    assert _errors(layer.weight.main_grad, _exact(seen)) < 1e-6


def test_fp8_weight_gradient_is_added_as_computed():
    from megatron_ds.parallel.fp8 import Fp8Recipe

    recipe = Fp8Recipe()
    fused, plain = _column(recipe), _column(recipe)
    _fuse(fused.weight)
    batches = _micro_batches(1)
    _backward(fused, batches)
    _backward(plain, batches)
    assert fused.weight.grad is None
    assert torch.equal(fused.weight.main_grad, plain.weight.grad.float())


def test_a_compiled_layer_keeps_the_fused_gemm_in_its_graph():
    """Regional compilation (the CUDA default) compiles layers whose weights fuse: one graph, no break
    (the backward adds into main_grad and does nothing else), and the sums eager computes."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from megatron_ds.parallel.layers import RowParallelLinear

    def mlp():
        torch.manual_seed(0)
        up, down = _column(), RowParallelLinear(OUT, IN, tp_group=None, input_is_parallel=True,
                                               params_dtype=torch.bfloat16)
        for layer in (up, down):
            _fuse(layer.weight)
        return up, down, lambda x: down(torch.nn.functional.gelu(up(x)[0]))[0]

    eager, compiled = mlp(), mlp()
    counter = CompileCounterWithBackend("aot_eager")  # AOTAutograd's graphs, no code generation
    run = torch.compile(compiled[2], backend=counter)
    for x, _ in _micro_batches():
        for fn in (eager[2], run):
            fn(x.clone().requires_grad_()).float().square().sum().backward()
    assert counter.frame_count == 1
    for a, b in zip(eager[:2], compiled[:2]):
        assert a.weight.grad is None and b.weight.grad is None
        assert torch.equal(a.weight.main_grad, b.weight.main_grad) and a.weight.main_grad.any()


def tp2_worker(rank, world_size):
    """At TP 2, main_grad of a column-parallel layer (sync / overlapped, with / without sequence
    parallelism) and of a row-parallel layer against g^T x over what that rank's GEMM saw."""
    from megatron_ds.parallel.layers import ColumnParallelLinear, RowParallelLinear

    group = dist.new_group([0, 1])
    errors = {}
    for sp in (False, True):
        for overlap in (False, True):
            torch.manual_seed(0)
            layer = ColumnParallelLinear(IN, 2 * OUT, tp_group=group, gather_output=False, sequence_parallel=sp,
                                         params_dtype=torch.bfloat16, async_grad_comm=overlap)
            _fuse(layer.weight)
            # under sequence parallelism each rank holds its half of the sequence; else the same input
            batches = _micro_batches(rows=TOKENS // 2 if sp else TOKENS, seed=rank if sp else 0, out_rows=TOKENS)
            seen = []
            for x, g in batches:
                out, _ = layer(x.clone().requires_grad_())
                out.backward(g)
                if sp:  # the GEMM saw the whole sequence: every rank's shard, in rank order
                    shards = [torch.empty_like(x) for _ in range(2)]
                    dist.all_gather(shards, x.contiguous(), group=group)
                    x = torch.cat(shards)
                seen.append((x, g))
            errors[f"column sp={sp} overlap={overlap}"] = (layer.weight.grad is None,
                                                          _errors(layer.weight.main_grad, _exact(seen)))
    torch.manual_seed(0)
    row = RowParallelLinear(2 * IN, OUT, tp_group=group, input_is_parallel=True, params_dtype=torch.bfloat16)
    _fuse(row.weight)
    seen = _backward(row, _micro_batches(seed=rank))
    errors["row"] = (row.weight.grad is None, _errors(row.weight.main_grad, _exact(seen)))
    return errors


def test_tensor_parallel_paths_add_fp32_into_main_grad():
    for errors in run_distributed(tp2_worker, 2, timeout=120):
        assert len(errors) == 5
        for path, (no_grad, error) in errors.items():
            assert no_grad and error < 1e-6, (path, error)


# --- end to end: DeepSpeed's bf16 optimizer -----------------------------------------------------------
RUN = TINY_GPT + ["--num-layers", "2", "--train-iters", "4", "--micro-batch-size", "1", "--global-batch-size", "2",
                  "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-iters", "0", "--clip-grad", "1.0"]
BF16 = ["--bf16", "--deepspeed_config", "ds_configs/zero1_bf16.json"]
# the plain engine here, DeepSpeed's pipeline engine at PP 2: each drives the bf16 optimizer's buffers its own way
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--async-tensor-model-parallel-allreduce",
          "--no-pipeline-parallel"]
PP2 = ["--pipeline-model-parallel-size", "2"]
FUSE = ["--gradient-accumulation-fusion"]


def logged_run(rank, world_size, argv):
    """pretrain_gpt.py's body: (losses, grad norms, fused weights) from its log lines."""
    from megatron_ds.config import parse_args
    from megatron_ds.families import pretrain

    out = io.StringIO()
    cfg, ignored = parse_args(argv)
    with contextlib.redirect_stdout(out):
        state = pretrain(cfg, ignored)
    log = out.getvalue()
    norms = [float(n) for n in re.findall(r"grad norm: ([0-9.]+)", log)]
    fused = re.findall(r"gradient accumulation fusion: (\d+) weights", log)
    return [loss for _, loss in state.history], norms, int(fused[0]) if fused else 0


@pytest.fixture(scope="module")
def runs():
    got = {}
    for name, argv in (("fp32", TP2_SP), ("bf16", BF16 + TP2_SP), ("fused", BF16 + TP2_SP + FUSE),
                       ("fp32-pp2", PP2), ("bf16-pp2", BF16 + PP2), ("fused-pp2", BF16 + PP2 + FUSE),
                       ("fused-zbh1", BF16 + PP2 + FUSE + ["--enable-zbh1-pipeline"])):
        got[name] = run_distributed(logged_run, 2, RUN + argv, timeout=600)
    return got


def _merged(ranks):
    """The last stage's losses, the logged norms and count (whichever rank logged them)."""
    return ranks[-1][0], next(r[1] for r in ranks if r[1]), ranks[0][2]


def test_fused_training_follows_the_unfused_one(runs):
    for fused, plain, fp32 in (("fused", "bf16", "fp32"), ("fused-pp2", "bf16-pp2", "fp32-pp2"),
                               ("fused-zbh1", "bf16-pp2", "fp32-pp2")):
        bf16_distance = max(abs(a - b) for a, b in zip(runs[plain][-1][0], runs[fp32][-1][0]))
        assert 0 < bf16_distance < 0.01
        (f_losses, f_norms, f_count), (p_losses, p_norms, p_count) = (_merged(runs[fused]), _merged(runs[plain]))
        # rank 0 logs its count: 4 linear layers a transformer layer, 2 layers (TP 2) or the first (PP 2)
        assert (f_count, p_count) == ((8, 0) if fused == "fused" else (4, 0))  # ZB-H1: our executor, same split
        assert len(f_losses) == len(p_losses) == 4
        assert f_norms[0] == pytest.approx(p_norms[0], rel=2 ** -7)
        # still a bf16 run: its roundings land elsewhere, as far from fp32 (0.8-1.03x measured), not farther
        fused_distance = max(abs(a - b) for a, b in zip(f_losses, runs[fp32][-1][0]))
        assert 0 < fused_distance <= 2 * bf16_distance, (fused, fused_distance, bf16_distance)
        assert f_losses != p_losses


@pytest.mark.parametrize("template,applied", [
    ({"zero_optimization": {"stage": 1}, "data_types": {"grad_accum_dtype": "fp32"}}, True),
    ({"zero_optimization": {"stage": 1}}, False),  # bf16 accumulation: bf16 buffers
    ({"zero_optimization": {"stage": 2}, "data_types": {"grad_accum_dtype": "fp32"}}, False),
])
def test_layout_summary_says_where_deepspeed_keeps_fp32_gradients(template, applied):
    from megatron_ds.config import parse_args, resolve

    def summary(*flags):
        cfg, _ = parse_args(TINY_GPT + ["--bf16", "--no-pipeline-parallel", "--train-iters", "2", *flags])
        return resolve(cfg, world_size=1, vocab_size=512, ds_template=template, device_type="cpu",
                       family=GPT).layout.summary()

    line = [x for x in summary(*FUSE).splitlines() if x.startswith("gradient accumulation fusion")]
    assert line and ("not applied" not in line[0]) == applied, line
    assert "gradient accumulation fusion" not in summary("--no-gradient-accumulation-fusion")
