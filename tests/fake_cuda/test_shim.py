"""The fake-CUDA shim: where it cannot be built or loaded, the tests skip saying why (never crash
the session); loaded, it reports a GPU only while activated."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from megatron_ds import fake_cuda

PROBE = "from megatron_ds import fake_cuda; {before}print(fake_cuda.preload()); import torch; print(fake_cuda.unavailable())"


def _probe(tmp_path, before: str = "", **env) -> list[str]:
    environ = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path), **env)  # a cache of its own: built afresh
    done = subprocess.run([sys.executable, "-c", PROBE.format(before=before)], env=environ, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


@pytest.mark.skipif(fake_cuda.cuda_build(), reason="a CUDA build of torch needs no shim")
def test_a_missing_compiler_is_a_reason_not_a_crash(tmp_path):
    preloaded, unavailable = _probe(tmp_path, CXX=str(tmp_path / "no-such-g++"))
    assert preloaded.startswith("fake CUDA unavailable: ") and "no-such-g++" in preloaded
    assert unavailable == preloaded


@pytest.mark.skipif(fake_cuda.cuda_build(), reason="a CUDA build of torch needs no shim")
def test_loading_after_torch_is_a_reason(tmp_path):
    preloaded, _ = _probe(tmp_path, before="import torch; ")
    assert preloaded == ("fake CUDA unavailable: torch was imported before the shim: torch reads its CUDA "
                         "hooks once")


def test_a_gpu_only_while_activated():
    why = fake_cuda.unavailable()
    if why is not None:
        pytest.skip(why)
    assert torch.accelerator.current_accelerator() is None or fake_cuda.cuda_build()
    with fake_cuda.activate():
        x = torch.ones(2, 3, device="cuda", requires_grad=True)
        (x * 2).sum().backward()  # the first autograd op on CUDA: aborts a CPU build without the guard
        assert x.grad.device.type == "cuda"
        assert torch.accelerator.current_accelerator().type == "cuda"
    if not fake_cuda.cuda_build():
        assert torch.accelerator.current_accelerator() is None  # a plain CPU build again
        with pytest.raises(RuntimeError, match="none is available"):  # as in a CPU build without the shim
            torch.zeros(2).pin_memory()
