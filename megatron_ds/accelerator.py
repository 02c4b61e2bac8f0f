"""The one device decision: does this process compute on CUDA or on the CPU?

Every branch of the package that differs between a GPU and a CPU run (the model built on the
device, the pinned loader, the fused optimizer, liger kernels, the NCCL backend, bf16 autocast in
inference) asks ``device_type()`` here, never ``torch.cuda.is_available()`` itself. The decision is
the real one (a visible GPU, unless ``DS_ACCELERATOR=cpu`` forces the CPU, DeepSpeed's own switch,
which Megatron-DeepSpeed honours too), except under ``simulate("cuda")``: the fake-CUDA tests and
``bench/kernel_budget.py`` set it so that a CPU-only torch runs the CUDA branches on fake tensors
(``megatron_ds.fake_cuda``).

What only a real CUDA runtime has (generator states, memory statistics, synchronisation) is asked
with ``cuda_runtime()``, which a simulation never claims.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping

import torch

CPU_SWITCH = "DS_ACCELERATOR"
"""``DS_ACCELERATOR=cpu`` forces the CPU (gloo) on a machine with GPUs."""

_simulated: str | None = None


def cpu_forced(environ: Mapping[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    return env.get(CPU_SWITCH, "").strip().lower() == "cpu"


def device_type(environ: Mapping[str, str] | None = None) -> str:
    """"cuda" when a GPU is visible and the CPU is not forced (or CUDA is simulated), else "cpu"."""
    if _simulated is not None:
        return _simulated
    return "cpu" if cpu_forced(environ) or not torch.cuda.is_available() else "cuda"


def on_cuda() -> bool:
    return device_type() == "cuda"


def cuda_compiles() -> bool:
    """A real CUDA device for inductor to compile for: not under ``simulate`` (fake CUDA on a CPU
    build), nor where a run resolved as "cuda" lacks a GPU (tests that take the CUDA branches on a CPU)."""
    return _simulated is None and torch.cuda.is_available()


def cuda_runtime() -> bool:
    """A real, initialised CUDA runtime: its generator states and statistics can be read. Never
    under a simulation, and never before this process touched its GPU (asking would create a
    context on GPU 0)."""
    return _simulated is None and torch.cuda.is_available() and torch.cuda.is_initialized()


@contextlib.contextmanager
def simulate(kind: str) -> Iterator[None]:
    """Take the branches of ``kind`` ("cuda" or "cpu") whatever the machine has (tests, benches)."""
    global _simulated
    if kind not in ("cuda", "cpu"):
        raise ValueError(f"simulate() takes 'cuda' or 'cpu', not {kind!r}")
    previous, _simulated = _simulated, kind
    try:
        yield
    finally:
        _simulated = previous
