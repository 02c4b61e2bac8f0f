"""Which device this process trains on, decided once at start-up.

Every process of a job drives the GPU numbered by its LOCAL_RANK. A LOCAL_RANK without a GPU of
its own is a launch mistake (more processes per node than GPUs, or CUDA_VISIBLE_DEVICES hiding
some): it stops with one line saying what to change, instead of stacking two ranks on one GPU.

Running on the CPU with gloo on a machine that has GPUs (a login or interactive node, a debugger
session) is asked for with ``DS_ACCELERATOR=cpu``: DeepSpeed's own switch for its accelerator,
which Megatron-DeepSpeed honours too (it places everything through DeepSpeed's
``get_accelerator()``), so the same variable moves model, engine and collectives to the CPU.
Without CUDA the CPU is used anyway. The decision itself is ``megatron_ds.accelerator``'s, the one
place every CPU/GPU branch asks (and that the fake-CUDA tests set to "cuda").
"""
from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from megatron_ds.accelerator import CPU_SWITCH, device_type
from megatron_ds.config.fp8_flags import fp8_device_error
from megatron_ds.errors import ConfigError


def no_gpu_message(local_rank: int, device_count: int, local_world_size: int | None,
                   environ: Mapping[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    visible = env.get("CUDA_VISIBLE_DEVICES")
    visible = "unset" if visible is None else repr(visible)
    processes = f" for {local_world_size} processes on this node" if local_world_size else ""
    return (f"LOCAL_RANK {local_rank} has no GPU: {device_count} CUDA device(s) visible{processes} "
            f"(CUDA_VISIBLE_DEVICES={visible}); start at most one process per GPU (mpirun -npernode, "
            f"torchrun --nproc_per_node, deepspeed --num_gpus, GPUS_PER_NODE in the job scripts), "
            f"or set {CPU_SWITCH}=cpu to train on the CPU with gloo")


def select_device(local_rank: int, local_world_size: int | None = None,
                  environ: Mapping[str, str] | None = None) -> torch.device:
    """This process's device: ``cuda:LOCAL_RANK`` (made current), or the CPU when forced or no
    GPU exists. DeepSpeed's accelerator is set to match, so its engine agrees with us."""
    if device_type(environ) == "cpu":
        _match_deepspeed_accelerator("cpu")
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if not 0 <= local_rank < count:
        raise ConfigError(no_gpu_message(local_rank, count, local_world_size, environ))
    torch.cuda.set_device(local_rank)
    # Initialise CUDA now, on this rank's GPU: the RNG set-up that follows saves and restores CUDA
    # generator states only once CUDA is in use (megatron_ds.parallel.random, model.pipeline_model).
    torch.cuda.init()
    _match_deepspeed_accelerator("cuda")
    return torch.device("cuda", local_rank)


def check_fp8_device(fp8_on: bool, device: torch.device, capability=torch.cuda.get_device_capability) -> None:
    """An FP8 run on a GPU without FP8 tensor cores stops at start-up with one line (torch._scaled_mm
    would fail at the first GEMM); on the CPU the GEMMs are torchao's emulation."""
    error = fp8_device_error(capability(device)) if fp8_on and device.type == "cuda" else None
    if error:
        raise ConfigError(error)


def memory_bytes(device: torch.device) -> float | None:
    """The GPU's memory in bytes (None on the CPU): what the run's memory-dependent choices
    (the output layer's loss kernel, ``memory.choose_fused_loss``) are made for."""
    if device.type != "cuda":
        return None
    return float(torch.cuda.get_device_properties(device).total_memory)


def _match_deepspeed_accelerator(kind: str) -> None:
    """DeepSpeed picks its accelerator once (DS_ACCELERATOR, else detection) when first imported;
    a process that imported it before the switch was set, or a test process running CPU and GPU
    runs one after the other, would otherwise get an engine on the other device."""
    try:
        from deepspeed.accelerator import get_accelerator, set_accelerator  # noqa: PLC0415
    except ImportError:  # dry runs and library use without DeepSpeed
        return
    if get_accelerator().device_name() == kind:
        return
    if kind == "cpu":
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator as Accelerator  # noqa: PLC0415
    else:
        from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator as Accelerator  # noqa: PLC0415
    set_accelerator(Accelerator())


def pin_memory() -> bool:
    """Page-locked loader buffers only when batches go to a GPU: pinning on a CPU run would create
    a CUDA context on GPU 0 in every process."""
    return device_type() == "cuda"
