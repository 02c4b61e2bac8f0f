"""Fixtures for the fake-CUDA tests: the package's CUDA branches run on a CPU-only torch, on fake
tensors (megatron_ds.fake_cuda; the shim is loaded by tests/conftest.py before torch)."""
from __future__ import annotations

import contextlib
import gc

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

from megatron_ds import ds_compat, fake_cuda
from megatron_ds.config import parse_args
from megatron_ds.families.gpt.gpt_family import GPT
from megatron_ds.model import fusions
from megatron_ds.model.rotary import clear_rotary_tables
from megatron_ds.training import data as train_data
from megatron_ds.training.device import select_device
from megatron_ds.training.pretrain import prepare, with_family_defaults
from tests.training.common import TINY_GPT


@pytest.fixture
def gpu(monkeypatch):
    """One fake H100 for the test: ``fake_cuda.cuda_present()`` (no fake tensors yet: tests enter
    ``fake_cuda.activate()`` where they want them). The compiled fusions' state is the test's own:
    a compile failure on fake CUDA must not turn them eager for the rest of the session."""
    why = fake_cuda.unavailable()
    if why is not None:
        pytest.skip(why)
    monkeypatch.setattr(fusions, "_FAILED", {})
    for fusable in fusions.FUSED_FUNCTIONS:
        monkeypatch.setattr(fusable, "_compiled", None)
        monkeypatch.setattr(fusable, "_proven", set())
    monkeypatch.setenv("LOCAL_RANK", "0")  # DeepSpeed's PipelineModule places itself by it
    clear_rotary_tables()
    with fake_cuda.cuda_present():
        yield
    clear_rotary_tables()  # its tables for "cuda:0" were fake tensors
    torch._dynamo.reset()  # no graphs compiled for fake CUDA tensors stay cached
    gc.collect()  # fake tensors in cycles freed now, not at exit (see fake_cuda.activate)
    select_device(0)  # DS_ACCELERATOR=cpu again: DeepSpeed's accelerator back to the CPU


@contextlib.contextmanager
def fake_world(world_size: int, rank: int):
    """torch's ``fake`` process-group backend (``ds_compat.fake_process_group``, as the dry run's
    meta build uses it): collectives return at once, so one process builds and runs any rank of a
    large layout, and DeepSpeed's communication layer finds that group."""
    import deepspeed

    with ds_compat.fake_process_group(world_size, rank):
        deepspeed.init_distributed(dist_backend="fake")  # finds the group just made
        yield


def build_run(flags: list[str], tp: int, pp: int, *, dp: int = 1, base=TINY_GPT, family=GPT):
    """(run, tokenizer) of ``family``'s CLI at TP x PP x DP for this process (``training.pretrain.main``'s
    family defaults, then ``prepare``, as pretrain_<family>.py resolves it), on device type cuda."""
    argv = [*base, "--train-iters", "2", "--tensor-model-parallel-size", str(tp),
            "--pipeline-model-parallel-size", str(pp), *flags]
    cfg, ignored = parse_args(argv)
    return prepare(with_family_defaults(cfg, family), ignored, world_size=tp * pp * dp, device_type="cuda",
                   log=lambda *a: None, family=family)


def stage_step(model, ps, batch, device, received=None):
    """What DeepSpeed's pipeline engine does with one micro-batch on this stage: forward of the
    batch's inputs moved to ``device`` as runtime/pipe/engine.py ``_exec_load_micro_batch`` moves
    them (a detached copy, a floating one requiring a gradient; the labels moved for the loss), or
    of ``received``, the activation (a tensor or tuple on ``device``) the previous stage sent; the
    loss on the last stage, else a gradient arriving from the next stage for every floating output
    (``_exec_backward_pass``); backward; then the reduction of the tied weights' gradients across
    their stages (``_exec_reduce_tied_grads``). Returns the loss (None before the last stage)."""
    inputs, labels = batch
    x = tuple(_loaded(t, device) for t in inputs) if ps.is_first_stage else received
    out = model(x)
    if ps.is_last_stage:
        loss = model.loss_fn(out, tuple(t.to(device).detach() for t in labels))
        assert loss.device.type == "cuda" and loss.dtype == torch.float32
        loss.backward()
    else:
        loss = None
        outs = [t for t in (out if isinstance(out, tuple) else (out,)) if t.is_floating_point() and t.requires_grad]
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
    if hasattr(model, "get_tied_weights_and_groups"):  # a PipelineModule
        for weight, group in model.get_tied_weights_and_groups():
            if weight.grad is not None:
                torch.distributed.all_reduce(weight.grad, group=group)
    return loss


def _loaded(t: torch.Tensor, device) -> torch.Tensor:
    mine = t.clone().detach().to(device)
    mine.requires_grad = mine.is_floating_point()
    return mine


def check_trained(model, optimizer, device, dtype) -> None:
    """After one step: every parameter a fake tensor on ``device`` in ``dtype`` with a gradient
    there, and AdamW's two states of each on ``device``."""
    params = list(model.parameters())
    assert params and all(isinstance(p, FakeTensor) for p in params)
    for name, p in model.named_parameters():
        assert p.device == device and p.dtype == dtype, (name, p.device, p.dtype)
        assert p.grad is not None and p.grad.device == device and p.grad.dtype == dtype, name
    states = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    assert len(states) == 2 * len(params)  # exp_avg and exp_avg_sq of every parameter, on the GPU
    assert all(v.device == device for v in states)


def loader_batches(dataset, run, collator) -> list:
    """Every micro-batch of the run's training loader over ``dataset`` (``training.data.build_loader``,
    pinned on a CUDA run, through its workers). The loader is shut down before returning, even when
    it fails: its persistent workers ignore SIGTERM (``training.signals.ignore_stop_signals``; the
    trainer stops them itself), so one left to the interpreter's exit would be joined forever."""
    loader = train_data.build_loader(dataset, run.data, collator, consumed_samples=0,
                                     micro_batch_size=run.layout.micro_batch_size, dp_rank=0, dp_size=1)
    try:
        assert loader.pin_memory
        return list(loader)
    finally:  # not left to the iterator's __del__: a failure's traceback keeps the iterator alive
        if loader._iterator is not None:
            loader._iterator._shutdown_workers()
