"""The gradients' accumulation and reduction dtype with --bf16: Megatron-LM's default fp32 and its
--grad-reduce-in-bf16 (megatron/training/arguments.py validate_args, core_v0.19.0: ``accumulate_allreduce_
grads_in_fp32`` is set with --bf16 unless --grad-reduce-in-bf16), as DeepSpeed's "data_types":
{"grad_accum_dtype"} and "communication_data_type"; a DeepSpeed JSON decides on a Megatron-DeepSpeed command
line, whose arguments.py has no --grad-reduce-in-bf16 (deepspeedai/Megatron-DeepSpeed, megatron/arguments.py).
Checked in the JSON built, in the engine DeepSpeed builds from it (its optimizer wrapper, its accumulation
buffer) and in the collectives a step at DP 2 calls."""
from __future__ import annotations

import math

import pytest

from megatron_ds.config import parse_args, resolve
from megatron_ds.errors import ConfigError
from megatron_ds.families.gpt.gpt_family import GPT
from tests.distributed import run_distributed

TINY = ("--num-layers 2 --hidden-size 16 --num-attention-heads 2 --seq-length 8 --max-position-embeddings 8 "
        "--micro-batch-size 1 --global-batch-size 4 --lr 1e-3 --train-iters 2 --mock-data --vocab-size 64").split()
FP32, BF16 = ("fp32", "fp32"), ("bf16", "bf16")
ZERO0_FP32_REDUCE = (None, "fp32")  # DeepSpeed keeps the weights' dtype for accumulation without ZeRO


def _resolve(argv, template=None):
    cfg, _ = parse_args(TINY + argv)
    kw = {} if template is None else {"ds_template": template}
    return resolve(cfg, world_size=2, vocab_size=64, device_type="cuda", family=GPT, **kw)  # cuda: for --fp16


def _dtypes(ds):
    return (ds.get("data_types") or {}).get("grad_accum_dtype"), ds.get("communication_data_type")


@pytest.mark.parametrize("argv,expected,summary", [
    # Megatron-LM's command line (no DeepSpeed named): fp32 where DeepSpeed can, bf16 with the flag
    (["--bf16"], ZERO0_FP32_REDUCE, "accumulated in bf16, reduced in fp32 (DeepSpeed's BF16_Optimizer"),
    (["--bf16", "--use-distributed-optimizer"], FP32, "accumulated in fp32, reduced in fp32 (DeepSpeed's BF16_Opt"),
    (["--bf16", "--zero-stage", "2"], FP32, "accumulated in fp32, reduced in fp32 (DeepSpeed's ZeRO stage 2"),
    (["--bf16", "--zero-stage", "3"], FP32, "accumulated in fp32, reduced in fp32 (DeepSpeed's ZeRO stage 3"),
    (["--bf16", "--grad-reduce-in-bf16"], BF16, "accumulated in bf16, reduced in bf16 (DeepSpeed's BF16_Optimizer"),
    (["--bf16", "--use-distributed-optimizer", "--grad-reduce-in-bf16"], BF16,
     "accumulated in bf16, reduced in bf16 (DeepSpeed's ZeRO stage 1 optimizer"),
    (["--fp16", "--grad-reduce-in-bf16"], (None, None), "accumulated in fp16, reduced in fp16"),  # upstream: bf16 only
    # Megatron-DeepSpeed's command line without a JSON: DeepSpeed's defaults (the weights' dtype), or the flag's
    (["--bf16", "--deepspeed", "--zero-stage", "1"], (None, None), "accumulated in bf16, reduced in bf16"),
    (["--bf16", "--deepspeed", "--zero-stage", "1", "--grad-reduce-in-bf16"], BF16, "accumulated in bf16, reduced in"),
])
def test_the_deepspeed_json_built_carries_the_dialects_gradient_dtypes(argv, expected, summary):
    run = _resolve(argv)
    assert _dtypes(run.layout.ds_config) == expected
    assert "gradients: " + summary in run.layout.summary()
    said = [n for n in run.notes if "--grad-reduce-in-bf16 has no effect" in n or "--bf16 without ZeRO" in n]
    assert len(said) == (argv in (["--bf16"], ["--fp16", "--grad-reduce-in-bf16"]))


def test_a_json_decides_and_the_flag_must_agree_with_it():
    ds = {"zero_optimization": {"stage": 1}, "data_types": {"grad_accum_dtype": "fp32"}}
    assert _dtypes(_resolve(["--bf16", "--deepspeed"], ds).layout.ds_config) == ("fp32", None)
    assert _dtypes(_resolve(["--bf16", "--deepspeed", "--grad-reduce-in-bf16"], {"zero_optimization": {"stage": 1}})
                   .layout.ds_config) == BF16
    with pytest.raises(ConfigError, match=r"--grad-reduce-in-bf16 asks for bf16 gradients, but the DeepSpeed JSON's "
                                          r"\"data_types.grad_accum_dtype\" is 'fp32'; drop one of them"):
        _resolve(["--bf16", "--deepspeed", "--grad-reduce-in-bf16"], ds)
    with pytest.raises(ConfigError, match=r"JSON's \"communication_data_type\" is 'fp32'"):
        _resolve(["--bf16", "--grad-reduce-in-bf16"], {"communication_data_type": "fp32"})


def _engine_dtypes(rank, world_size, cases):
    """For each argv: DeepSpeed's optimizer wrapper, its data types, the dtype of BF16_Optimizer's gradient
    accumulation buffer, and the dtypes of the floating-point tensors all-reduced during one step."""
    import deepspeed.comm as dist

    from megatron_ds.training.loop import train_step
    from tests.training.engine_worker import engine_for, micro_batch

    reduced = []
    original = dist.all_reduce

    def recording(tensor, *args, **kwargs):
        reduced.append(str(tensor.dtype).replace("torch.", ""))
        return original(tensor, *args, **kwargs)

    dist.all_reduce = recording
    out = []
    for argv in cases:
        run, ps, rt = engine_for(["--bf16", "--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "1e-3",
                                  "--train-iters", "2", *argv])
        engine = rt.engine
        reduced.clear()
        loss = train_step(engine, iter([micro_batch(1, 1, 8, 0.8), micro_batch(2, 1, 8, 0.8)]), run.layout,
                          rt.loss_fn, ps.dp_group)
        buffers = {str(b.dtype).replace("torch.", "") for b in getattr(engine.optimizer, "fp32_groups_gradients_flat", [])}
        out.append((type(engine.optimizer).__name__, [str(t).replace("torch.", "") for t in engine.get_data_types()],
                    str(engine.communication_data_type).replace("torch.", ""), sorted(buffers),
                    sorted({d for d in reduced if d in ("bfloat16", "float32")}), loss))
    return out


@pytest.mark.slow
def test_the_engine_accumulates_and_reduces_in_those_dtypes():
    """DP 2, two micro-batches a step. Without the flag no bf16 tensor is all-reduced at all (the float32 ones
    include the loss and the gradient norm); with it the gradients' all-reduce is bf16."""
    cases = [[], ["--grad-reduce-in-bf16"], ["--use-distributed-optimizer"],
             ["--use-distributed-optimizer", "--grad-reduce-in-bf16"], ["--zero-stage", "2", "--no-pipeline-parallel"]]
    got = run_distributed(_engine_dtypes, 2, cases, timeout=600)[0]
    assert [g[:5] for g in got] == [
        # ZeRO 0, pipeline engine: DeepSpeed's BF16_Optimizer with bf16 accumulation (it refuses fp32 without ZeRO)
        ("BF16_Optimizer", ["bfloat16", "bfloat16"], "float32", ["bfloat16"], ["float32"]),
        ("BF16_Optimizer", ["bfloat16", "bfloat16"], "bfloat16", ["bfloat16"], ["bfloat16", "float32"]),
        # ZeRO 1 (Megatron-LM's distributed optimizer): fp32 gradients as Megatron-LM's main_grad, reduced in fp32
        ("BF16_Optimizer", ["bfloat16", "float32"], "float32", ["float32"], ["float32"]),
        ("DeepSpeedZeroOptimizer", ["bfloat16", "bfloat16"], "bfloat16", [], ["bfloat16", "float32"]),
        # ZeRO 2: the ZeRO optimizer's fp32 accumulation, its reduction fp32
        ("DeepSpeedZeroOptimizer", ["bfloat16", "float32"], "float32", [], ["float32"]),
    ]
    assert all(math.isfinite(g[5]) for g in got)


@pytest.mark.slow
def test_a_bf16_run_with_grad_reduce_in_bf16_trains():
    """The real CLI, Megatron-LM's command line as NVIDIA's Llama 3 FP8 example passes the flag."""
    from tests.training.cli import SMALL_GPT, printed_losses

    losses = printed_losses(2, SMALL_GPT + ["--bf16", "--grad-reduce-in-bf16", "--use-distributed-optimizer",
                                            "--train-iters", "3", "--global-batch-size", "8"])
    assert [it for it, _ in losses] == [1, 2, 3] and all(math.isfinite(float(x)) for _, x in losses)
