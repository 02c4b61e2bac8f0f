"""FP8 on device ``cuda`` (fake CUDA, megatron_ds/fake_cuda.py): the tensor-parallel linear layers built with
an FP8 recipe run forward and backward through ``torch._scaled_mm`` -- three GEMMs per layer (output,
input gradient, weight gradient) on float8 operands of the recipe's dtypes with fp32 scales -- not
through torchao's CPU emulation, and return bf16 activations and gradients on ``cuda``. The whole model
with FP8 runs on fake CUDA in tests/fake_cuda/test_gpu_paths.py ("gpt-bf16-tp2-sp-fp8")."""
from __future__ import annotations

import pytest
import torch

from megatron_ds import fake_cuda
from megatron_ds.parallel.fp8 import Fp8Recipe
from megatron_ds.parallel.layers import ColumnParallelLinear, RowParallelLinear

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@pytest.mark.parametrize("recipe,operands", [
    # hybrid: forward E4M3 x E4M3, input gradient E5M2 grad x E4M3 weight, weight gradient E5M2 grad x E4M3 input
    (Fp8Recipe("hybrid"), [(E4M3, E4M3), (E5M2, E4M3), (E5M2, E4M3)]),
    (Fp8Recipe("e4m3", "rowwise"), [(E4M3, E4M3)] * 3),
    # delayed scaling: the layers' stored scales (buffers on cuda), the same GEMMs
    (Fp8Recipe("hybrid", "delayed", amax_history_len=4, amax_compute_algo="max"),
     [(E4M3, E4M3), (E5M2, E4M3), (E5M2, E4M3)]),
])
def test_fp8_layers_run_scaled_mm_on_cuda(gpu, monkeypatch, recipe, operands):
    calls = []
    scaled_mm = torch._scaled_mm

    def recording(a, b, scale_a, scale_b, **kwargs):
        calls.append((a.dtype, b.dtype, a.device.type, scale_a.dtype, tuple(scale_a.shape), kwargs.get("out_dtype")))
        return scaled_mm(a, b, scale_a, scale_b, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", recording)
    with fake_cuda.activate():
        device = torch.device("cuda", 0)
        common = dict(tp_group=None, params_dtype=torch.bfloat16, device=device, fp8=recipe)
        column = ColumnParallelLinear(64, 128, gather_output=False, **common)
        row = RowParallelLinear(128, 64, input_is_parallel=True, bias=False, **common)
        x = torch.randn(16, 2, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
        out, _ = row(torch.nn.functional.gelu(column(x)[0]))
        out.float().pow(2).mean().backward()
        assert out.device.type == "cuda" and out.dtype == torch.bfloat16
        assert x.grad.dtype == torch.bfloat16 and column.weight.grad.dtype == torch.bfloat16
        assert column.weight.grad.device.type == "cuda" and row.weight.grad.shape == (64, 128)
        if recipe.granularity == "delayed":
            from megatron_ds.parallel.fp8_delayed import update_delayed_scaling

            update_delayed_scaling(torch.nn.ModuleList([column, row]), dp_group=None)
            for layer in (column, row):  # (fake tensors hold no values: their numbers are the CPU tests')
                state = layer.fp8_scaling
                assert state.scale.device.type == state.amax_history.device.type == "cuda"
                assert state.scale.shape == (3,) and state.amax_history.shape == (4, 3)
    # forward: column then row; backward: row's two GEMMs, then column's
    got = [(a, b) for a, b, *_ in calls]
    assert got == [operands[0], operands[0], *operands[1:], *operands[1:]], got
    assert all(dev == "cuda" and sd == torch.float32 and out == torch.bfloat16 for _, _, dev, sd, _, out in calls)
    # rowwise: the forward GEMMs (fast accumulation) take one scale per row; for the gradient GEMMs torchao
    # calls the tensorwise kernel with unit scales and applies the row scales to its output
    rowwise = recipe.granularity == "rowwise"
    assert [shape != () for *_, shape, _ in calls] == [rowwise, rowwise, False, False, False, False], calls
