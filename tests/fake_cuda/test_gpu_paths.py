"""The CUDA code paths, executed on a CPU: the model as pretrain_gpt.py builds it (flags ->
resolve -> select_device -> build_module -> build_optimizer) runs forward, backward and an
optimizer step on fake tensors on device ``cuda``. A CPU tensor anywhere in the computation (a
RoPE cache left on the host, a mask built on the CPU) raises FakeTensorDeviceMismatchError, and
every parameter, gradient and optimizer state is checked for device and dtype. The branches taken
are the GPU's: building on the device, fused AdamW, chunked cross entropy for half-precision
logits, the compiled fusions (which fail to compile here and must fall back, once, saying why),
the pinned loader. The real GPU runs the same through tests/gpu (marked gpu)."""
from __future__ import annotations

import pytest
import torch

from megatron_ds import fake_cuda
from megatron_ds.families.gpt.gpt_family import GPT
from megatron_ds.model import fusions
from megatron_ds.model import language_model as gpt_module
from megatron_ds.parallel.groups import ParallelState
from megatron_ds.training import data as train_data
from megatron_ds.training.device import select_device
from megatron_ds.training.engine import build_module
from megatron_ds.training.optimizer import build_optimizer
from tests.fake_cuda.conftest import build_run, check_trained, fake_world, loader_batches, stage_step
from tests.training.common import LLAMA_FLAGS, OPEN_MODEL_FLAGS

SELECTIVE = "--recompute-granularity selective".split()
FULL = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1".split()

# (flags, tensor parallel, pipeline parallel, this process's rank): one rank of each layout. With
# TP 2 x PP 2 the ranks are tp-major within a stage (DeepSpeed's topology): rank 1 is TP rank 1 of
# stage 0, rank 2 is TP rank 0 of stage 1.
CASES = {
    "gpt-bf16": (["--bf16"], 1, 1, 0),
    "gpt-fp16-full-recompute": (["--fp16", *FULL], 1, 1, 0),
    "llama-bf16-selective": (["--bf16", *LLAMA_FLAGS, *SELECTIVE], 1, 1, 0),
    "llama-fp16-no-pipeline": (["--fp16", *LLAMA_FLAGS, "--no-pipeline-parallel"], 1, 1, 0),
    "gpt-bf16-tp2-sequence-parallel": (["--bf16", "--sequence-parallel", *FULL], 2, 1, 1),
    # the overlapped column-parallel backward (parallel/async_comm.py): all-reduce, and under sequence
    # parallelism the re-gather and reduce-scatter, issued asynchronously
    "llama-bf16-tp2-pp2-first-stage-async-tp": (["--bf16", *LLAMA_FLAGS, *SELECTIVE,
                                                 "--async-tensor-model-parallel-allreduce"], 2, 2, 1),
    "gpt-bf16-tp2-sp-async-tp": (["--bf16", "--sequence-parallel", "--async-tensor-model-parallel-allreduce"], 2, 1, 1),
    "gpt-fp16-pp2-last-stage": (["--fp16"], 1, 2, 1),
    "gpt-bf16-tp2-sp-fp8": (["--bf16", "--sequence-parallel", "--fp8-hybrid"], 2, 1, 1),
    # QKV bias, q/k norms before the scaled RoPE (the unfused path), FP8 GEMMs with head dim != hidden / heads
    "open-model-bf16-tp2-sp-fp8": (["--bf16", *OPEN_MODEL_FLAGS, "--sequence-parallel", "--fp8-hybrid"], 2, 1, 1),
}


def _micro_batch(run, tokenizer):
    """A real micro-batch from the real collator (CPU tensors, as the loader yields them)."""
    collator = train_data.BatchCollator(run.data, eod=tokenizer.eod, vocab_size=run.layout.padded_vocab_size,
                                        source="mock")
    dataset = train_data.MockGPTDataset(4, run.layout.model.seq_length, run.layout.vocab_size, seed=1)
    return collator([dataset[i] for i in range(run.layout.micro_batch_size)])


@pytest.mark.parametrize("case", list(CASES))
def test_forward_backward_step_on_cuda(case, gpu, monkeypatch):
    flags, tp, pp, rank = CASES[case]
    run, tokenizer = build_run(flags, tp, pp)
    half = torch.float16 if "--fp16" in flags else torch.bfloat16
    chunked = []
    monkeypatch.setattr(gpt_module, "chunked_vocab_parallel_cross_entropy",
                        _recording(gpt_module.chunked_vocab_parallel_cross_entropy, chunked))
    batch = _micro_batch(run, tokenizer)
    with fake_world(tp * pp, rank), fake_cuda.activate():
        ps = ParallelState(tp, pp)
        device = select_device(0)  # the real decision: cuda:0, DeepSpeed's accelerator switched to CUDA
        assert device == torch.device("cuda", 0)
        model = build_module(run, ps, device, tokenizer.eod, build=GPT.build_model)
        if hasattr(model, "_precompute_checkpointable_values"):
            model._precompute_checkpointable_values()  # DeepSpeed's PipelineEngine does this at start
        m = run.layout.model
        hidden_shape = (m.seq_length // (tp if run.layout.sequence_parallel else 1), run.layout.micro_batch_size,
                        m.hidden_size)
        received = None if ps.is_first_stage else torch.randn(hidden_shape, device=device, dtype=half,
                                                              requires_grad=True)
        stage_step(model, ps, batch, device, received)
        optimizer, desc = build_optimizer(model, run.optimizer, device)
        optimizer.step()
    assert desc == "torch.optim.AdamW(fused=True)"
    check_trained(model, optimizer, device, half)
    assert chunked == ([True] if ps.is_last_stage else [])  # half-precision logits: chunked CE


def _recording(fn, calls):
    def wrapper(*args, **kwargs):
        calls.append(True)
        return fn(*args, **kwargs)
    return wrapper


def test_compile_failure_falls_back_once_saying_why(gpu, capsys):
    """The compiled fusions cannot compile for fake CUDA tensors (no CUDA torch, no Triton): the
    fallback must fire once, run the same math eagerly, and name the real cause, not only Dynamo's
    wrapper line ("BackendCompilerFailed: backend='inductor' raised:")."""
    run, tokenizer = build_run(["--bf16", *LLAMA_FLAGS], 1, 1)
    batch = _micro_batch(run, tokenizer)
    with fake_world(1, 0), fake_cuda.activate():
        ps = ParallelState(1, 1)
        model = build_module(run, ps, select_device(0), tokenizer.eod, build=GPT.build_model)
        model._precompute_checkpointable_values()
        for _ in range(2):
            stage_step(model, ps, batch, torch.device("cuda", 0))
    warnings = [line for line in capsys.readouterr().err.splitlines() if "torch.compile of the fused" in line]
    assert len(warnings) == 1, warnings
    reason = fusions.compile_unavailable()
    assert reason is not None and reason.split(": ", 1)[1] in warnings[0]
    assert not reason.rstrip().endswith("raised:") and " <- " in reason, reason
    if not fake_cuda.cuda_build():
        assert "Torch not compiled with CUDA enabled" in warnings[0]


def test_pinned_loader_batches(gpu, monkeypatch):
    """The loader of a CUDA run pins its batches (the DataLoader's pin-memory thread copies each
    tensor into page-locked memory, which refuses a stride-0 view such as an expand()ed
    position_ids: the crash of the first H100 run), through a worker process as training runs it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # what the DataLoader asks before pinning
    monkeypatch.setattr(torch.cuda, "_lazy_init", lambda: None)  # its pin thread's device query
    run, tokenizer = build_run(["--bf16", "--num-workers", "1"], 1, 1)
    collator = train_data.BatchCollator(run.data, eod=tokenizer.eod, vocab_size=run.layout.padded_vocab_size,
                                        source="mock")
    dataset = train_data.MockGPTDataset(8, run.layout.model.seq_length, run.layout.vocab_size, seed=1)
    batches = loader_batches(dataset, run, collator)
    assert len(batches) == 4
    for inputs, labels in batches:
        assert all(t.is_pinned() for t in (*inputs, *labels))
    unpinned = torch.zeros(2)
    assert not unpinned.is_pinned()  # is_pinned() tells pinned memory from plain host memory
