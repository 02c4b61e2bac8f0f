"""Mixture of experts on the CUDA code paths, on a CPU (tests/fake_cuda/test_gpu_paths.py's
machinery): a GPT with ``--num-experts 2`` at expert parallel size 1 on one fake rank (and at EP 2, and TP 2), built as
pretrain_gpt.py builds it (DeepSpeed's expert groups on the ``fake`` process-group backend first,
as ``training.engine.build_engine`` creates them), runs forward, backward and a fused AdamW step on
fake tensors on ``cuda`` with top-1 and top-2 gating; every parameter (the gate's, the experts') its
gradient and optimizer state on the device, the drop fraction of every MoE layer measured there.

DeepSpeed's gating (deepspeed/moe/sharded_moe.py) runs on fake tensors as long as the expert
capacity is a constant: ``_capacity`` computes it from ``torch.tensor(capacity_factor)`` and the
token count, which fake tensors propagate as constants, so ``MOELayer.forward``'s ``int(C)`` and the
``torch.topk(k=capacity)`` of random token selection get a number. Without token dropping the
capacity is the largest expert's token count, a value of the routing itself: fake tensors have none,
and the gate stops there (``test_moe_without_token_dropping_stops_in_deepspeed_gating``)."""
from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException

from megatron_ds import fake_cuda
from megatron_ds.families.gpt.gpt_family import GPT
from megatron_ds.model.language_model import reported_names
from megatron_ds.model.loss_report import LossReport
from megatron_ds.parallel.groups import ParallelState
from megatron_ds.training.device import select_device
from megatron_ds.training.engine import build_module
from megatron_ds.training.optimizer import build_optimizer
from tests.fake_cuda.conftest import build_run, check_trained, fake_world, stage_step

MOE = "--num-experts 2 --expert-interval 1 --create-moe-param-group".split()

# (flags, tensor parallel, pipeline parallel, data parallel, this process's rank)
CASES = {
    "top1-bf16": (["--bf16", "--topk", "1"], 1, 1, 1, 0),
    # second expert drawn with Gumbel noise (DeepSpeed's gumbel_rsample on the logits' device)
    "top2-fp16": (["--fp16", "--topk", "2"], 1, 1, 1, 0),
    "top2-bf16-residual": (["--bf16", "--topk", "2", "--mlp-type", "residual",
                            "--disable-moe-top2-2nd-expert-sampling"], 1, 1, 1, 0),
    # one expert per rank: MOELayer's two all-to-alls over the expert parallel group
    "top2-bf16-ep2": (["--bf16", "--topk", "2", "--moe-expert-parallel-size", "2"], 1, 1, 2, 1),
    # experts whole on each TP rank: MOELayer drops the duplicate tokens and gathers them back over TP
    "top1-bf16-tp2": (["--bf16", "--topk", "1"], 2, 1, 1, 1),
    # the first stage sends its layers' summed auxiliary loss on with the hidden state
    "top1-fp16-pp2-first-stage": (["--fp16", "--topk", "1"], 1, 2, 1, 0),
    # FP8 GEMMs in the experts (our MLP) as in attention: torch._scaled_mm, counted below
    "top2-bf16-ep2-fp8": (["--bf16", "--topk", "2", "--moe-expert-parallel-size", "2", "--fp8-hybrid"], 1, 1, 2, 1),
}


def _micro_batch(run, tokenizer):
    """The GPT's collator over its --mock-data samples (CPU tensors, as the loader yields them)."""
    train, _, _ = GPT.build_datasets(run, tokenizer, (8, 0, 0), lambda *a: None)
    return GPT.make_collator(run, tokenizer)([train[i] for i in range(run.layout.micro_batch_size)])


def _build(run, tokenizer, tp: int = 1, pp: int = 1):
    """This rank's MoE GPT on the device, as ``training.engine.build_engine`` makes it: DeepSpeed's
    expert groups first (on the fake backend), then the model; then what ``deepspeed.initialize``
    does with each MoE layer (runtime/engine.py ``_configure_distributed_model``: its expert group)."""
    ps = ParallelState(tp, pp)
    device = select_device(0)
    ps.expert_groups(run.layout.ep, run.layout.model.enable_expert_tensor_parallelism)
    model = build_module(run, ps, device, tokenizer.eod, LossReport(reported_names(True)), build=GPT.build_model)
    for module in model.modules():
        if hasattr(module, "set_deepspeed_parallelism"):
            module.set_deepspeed_parallelism()
    model._precompute_checkpointable_values()  # DeepSpeed's PipelineEngine does this at start
    return model, ps, device


@pytest.mark.parametrize("case", list(CASES))
def test_moe_forward_backward_step_on_cuda(case, gpu, monkeypatch):
    """Also the failing case of two fixes: the experts' seeds were read back from a torch tensor
    (model/transformer.py), and DeepSpeed's copies of the expert belonged to copies of the fake
    mode (megatron_ds/fake_cuda.py)."""
    flags, tp, pp, dp, rank = CASES[case]
    run, tokenizer = build_run([*MOE, *flags], tp, pp, dp=dp)
    half = torch.float16 if "--fp16" in flags else torch.bfloat16
    batch = _micro_batch(run, tokenizer)
    scaled_mm, real_scaled_mm = [], torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: scaled_mm.append(1) or real_scaled_mm(*a, **k))
    with fake_world(tp * pp * dp, rank), fake_cuda.activate():
        model, ps, device = _build(run, tokenizer, tp, pp)
        loss = stage_step(model, ps, batch, device)
        optimizer, desc = build_optimizer(model, run.optimizer, device)
        optimizer.step()
    assert desc == "torch.optim.AdamW(fused=True)"
    check_trained(model, optimizer, device, half)
    assert loss.device == device if ps.is_last_stage else loss is None
    names = [n for n, _ in model.named_parameters()]
    assert any(".deepspeed_moe.gate.wg." in n for n in names)
    local = 2 // run.layout.ep
    # FP8: 3 GEMMs (output, input and weight gradients) per linear layer: attention's 2 and each local expert's 2
    layers = run.layout.model.num_layers // pp
    assert len(scaled_mm) == (3 * 2 * (1 + local) * layers if "--fp8-hybrid" in flags else 0)
    assert sum(f".deepspeed_experts.{local - 1}." in n for n in names) > 0
    assert not any(f".deepspeed_experts.{local}." in n for n in names)  # this rank's 2 / EP experts
    drops = [m.drops.last for m in model.modules() if hasattr(m, "drops")]
    assert len(drops) == run.layout.model.num_layers // pp  # --expert-interval 1: every layer of the stage
    assert all(d.device == device and d.dtype == torch.float32 for d in drops)


def test_moe_without_token_dropping_stops_in_deepspeed_gating(gpu):
    """--disable-moe-token-dropping: DeepSpeed's ``top1gating`` sets the capacity to the largest
    expert's token count (``torch.max(exp_counts)``) and compares it with the token count in Python
    (``min(new_capacity, ...)``): a value of the routing, which a fake tensor does not have
    (DataDependentOutputException from ``aten._local_scalar_dense``). A limitation of running
    DeepSpeed's gate on fake tensors, not of the GPU path; the model is built, and runs up to there."""
    run, tokenizer = build_run([*MOE, "--bf16", "--topk", "1", "--disable-moe-token-dropping"], 1, 1)
    batch = _micro_batch(run, tokenizer)
    with fake_world(1, 0), fake_cuda.activate():
        model, ps, device = _build(run, tokenizer)
        with pytest.raises(DataDependentOutputException) as stopped:
            stage_step(model, ps, batch, device)
    frames = [(Path(f.filename).parent.name, Path(f.filename).name, f.name)
              for f in traceback.extract_tb(stopped.value.__traceback__)]
    deepspeed_frames = [f for f in frames if f[0] == "moe"]
    assert deepspeed_frames[-1] == ("moe", "sharded_moe.py", "top1gating"), frames


def test_megatron_lm_moe_grouped_gemm_branch_on_cuda_bf16(monkeypatch):
    """--moe-grouped-gemm's CUDA branch of Megatron-LM's experts (model/mlm_moe.py ``grouped_linear``): on bf16
    CUDA tensors ``_grouped_mm_ok`` holds and one torch._grouped_mm runs forward and backward (an expert without
    tokens included), its output and gradients on the device. (The whole dropless layer cannot run on fake
    tensors: its permutation reads the routing's counts.)"""
    from megatron_ds.model import mlm_moe

    calls, real = [], torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    with fake_cuda.activate():
        layer = mlm_moe._Stacked(list(range(4)), 64, 128, bias=False, std=0.02, params_dtype=torch.bfloat16,
                                 device="cuda")
        x = torch.randn(40, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        assert mlm_moe._grouped_mm_ok(x, layer.weight)
        y = mlm_moe.grouped_linear(x, [10, 0, 20, 10], layer, grouped=True)
        y.float().sum().backward()
    assert y.shape == (40, 128) and y.device.type == "cuda"
    assert x.grad.shape == x.shape and layer.weight.grad.device.type == "cuda"
    assert calls == [1]
