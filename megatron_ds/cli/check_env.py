"""Print what training start-up would use in this environment, without starting anything:

    python tools/check_env.py              # on a compute node, with the job's modules loaded
    python tools/check_env.py --require-cuda

torch and its CUDA, the GPUs and their compute capability, NCCL, the attention kernels
scaled_dot_product_attention can pick (flash needs compute capability >= 8.0), apex's fused norms
and FusedAdam or their torch fallbacks, DeepSpeed, and the dataset index helpers (C++ or NumPy).
scripts/abci/setup_env.sh runs it last. Exit status 1 only with --require-cuda and no GPU.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys


def _cuda_lines(torch) -> list[str]:
    lines = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        lines.append(f"gpu {i}: {props.name}, {props.total_memory / 1e9:.0f} GB, compute capability "
                     f"{props.major}.{props.minor}")
    nccl = torch.cuda.nccl.version() if hasattr(torch.cuda, "nccl") else None
    lines.append(f"nccl: {'.'.join(map(str, nccl)) if isinstance(nccl, tuple) else nccl}")
    major = min(torch.cuda.get_device_capability(i)[0] for i in range(torch.cuda.device_count()))
    flash = torch.backends.cuda.is_flash_attention_available() and major >= 8
    lines.append("attention: scaled_dot_product_attention with "
                 + ("flash kernels" if flash else "memory-efficient kernels (no flash below compute capability 8.0)"))
    arch = os.environ.get("TORCH_CUDA_ARCH_LIST")
    built = torch.cuda.get_arch_list()
    lines.append(f"torch kernels built for: {' '.join(built)}" + (f"; TORCH_CUDA_ARCH_LIST={arch}" if arch else ""))
    return lines


def report() -> tuple[list[str], bool]:
    import torch

    from megatron_ds.accelerator import on_cuda
    from megatron_ds.model.kernels import describe_kernels

    cuda = on_cuda()
    lines = [f"python: {sys.version.split()[0]} ({sys.executable})",
             f"torch: {torch.__version__}, built with CUDA {torch.version.cuda or 'none (CPU build)'}"]
    nvcc = _nvcc_version()
    if nvcc:
        same = torch.version.cuda and torch.version.cuda.split(".")[0] == nvcc.split(".")[0]
        lines.append(f"nvcc (the loaded CUDA module): {nvcc}" + (
            "" if same else " -- torch was built with another CUDA major: extension builds (apex) will "
            "fail; install torch for this CUDA (setup_env.sh TORCH_PIP_ARGS) or load the matching module"))
    if cuda:
        lines += _cuda_lines(torch)
    else:
        lines += ["gpu: none visible (CPU only: training would use gloo, fp32/bf16)", "nccl: not used without a GPU",
                  "attention: scaled_dot_product_attention, math kernel on CPU"]
    for name, impl in describe_kernels().items():
        if name != "attention":
            lines.append(f"{name}: {impl}")
    apex_adam = importlib.util.find_spec("apex") is not None and cuda and _apex_adam_ok()
    lines.append("optimizer: " + ("apex.optimizers.FusedAdam" if apex_adam else
                                  "torch.optim.AdamW(fused=True)" if cuda else "torch.optim.AdamW(foreach=True)"))
    lines.append(f"deepspeed: {_version('deepspeed')}")
    from megatron_ds.data.helpers import backend_description

    lines.append(f"dataset index helpers: {backend_description()}")
    return lines, cuda


def _nvcc_version() -> str | None:
    """CUDA release of the nvcc on PATH (what extension builds compile with), or None."""
    import re
    import shutil
    import subprocess

    if shutil.which("nvcc") is None:
        return None
    try:
        out = subprocess.run(["nvcc", "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"release (\d+\.\d+)", out)
    return match.group(1) if match else None


def _apex_adam_ok() -> bool:
    try:
        from apex.optimizers import FusedAdam  # noqa: F401
        import amp_C  # noqa: F401 - FusedAdam's compiled kernels
    except Exception:  # noqa: BLE001 - a broken apex means the torch fallback
        return False
    return True


def _version(module: str) -> str:
    try:
        from importlib.metadata import version
        return version(module)
    except Exception:  # noqa: BLE001
        return "not installed"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--require-cuda", action="store_true", help="exit 1 if no GPU is visible")
    args = parser.parse_args(argv)
    lines, cuda = report()
    for line in lines:
        print(f"[check] {line}")
    if args.require_cuda and not cuda:
        print("[check] ERROR: no GPU visible: run this inside a GPU job with the CUDA module loaded, "
              "and install a CUDA build of torch", file=sys.stderr)
        return 1
    return 0
