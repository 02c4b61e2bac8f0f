"""Gradient accumulation fusion on device ``cuda`` (fake CUDA, megatron_ds/fake_cuda.py): the weight-gradient
GEMM of a bf16 tensor-parallel linear layer with an fp32 ``main_grad`` is one ``torch.mm`` with
``out_dtype=float32`` (cuBLAS's bf16 GEMM with an fp32 output; the CPU widens its operands instead), added
into ``main_grad`` on ``cuda``, and no ``.grad`` is written. The CPU numerics: tests/training/test_grad_accum_fusion.py."""
from __future__ import annotations

import torch

from megatron_ds import fake_cuda
from megatron_ds.parallel.layers import ColumnParallelLinear, RowParallelLinear


def test_weight_gradient_is_one_fp32_output_gemm_on_cuda(gpu, monkeypatch):
    calls = []
    mm = torch.mm

    def recording(a, b, *args, **kwargs):
        calls.append((a.dtype, b.dtype, kwargs.get("out_dtype"), tuple(a.shape), tuple(b.shape)))
        return mm(a, b, *args, **kwargs)

    monkeypatch.setattr(torch, "mm", recording)
    with fake_cuda.activate():
        device = torch.device("cuda", 0)
        common = dict(tp_group=None, params_dtype=torch.bfloat16, device=device)
        column = ColumnParallelLinear(64, 128, gather_output=False, **common)
        row = RowParallelLinear(128, 64, input_is_parallel=True, bias=False, **common)
        for layer in (column, row):
            layer.weight.main_grad = torch.zeros(layer.weight.shape, dtype=torch.float32, device=device)
        x = torch.randn(16, 2, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
        out, _ = row(torch.nn.functional.gelu(column(x)[0]))
        out.float().pow(2).mean().backward()
        for layer in (column, row):
            assert layer.weight.grad is None
            assert layer.weight.main_grad.device.type == "cuda" and layer.weight.main_grad.dtype == torch.float32
        assert x.grad.dtype == torch.bfloat16 and column.bias.grad.device.type == "cuda"
    # the row layer's weight gradient, then the column layer's: [out, tokens] x [tokens, in]
    fused = [c for c in calls if c[2] is not None]
    assert fused == [(torch.bfloat16, torch.bfloat16, torch.float32, (64, 32), (32, 128)),
                     (torch.bfloat16, torch.bfloat16, torch.float32, (128, 32), (32, 64))], calls
