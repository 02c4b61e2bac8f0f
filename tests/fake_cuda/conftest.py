"""Fixtures for the fake-CUDA tests: the package's CUDA branches run on a CPU-only torch, on fake
tensors (megatron_ds.fake_cuda; the shim is loaded by tests/conftest.py before torch)."""
from __future__ import annotations

import contextlib
import gc

import pytest
import torch

from megatron_ds import ds_compat, fake_cuda
from megatron_ds.model import fusions
from megatron_ds.model.rotary import rotary_cos_sin
from megatron_ds.training.device import select_device


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
    rotary_cos_sin.cache_clear()
    with fake_cuda.cuda_present():
        yield
    rotary_cos_sin.cache_clear()  # its tables for "cuda:0" were fake tensors
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
