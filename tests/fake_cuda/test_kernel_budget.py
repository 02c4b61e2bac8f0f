"""The counting machinery of bench/kernel_budget.py, on blocks small enough to count on paper: a
LayerNorm + bias-GeLU MLP block with its residual (unfused, then with the compiled bias-GeLU), an
RMSNorm (one kernel each way, as on a GPU, not its CPU decomposition) and flash attention (no
kernel counted, its FLOPs). The real-size table stays in the bench."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megatron_ds import fake_cuda
from megatron_ds.model import fusions

S, B, H, FFN = 8, 2, 16, 64
N, E = S * B, 4  # tokens; bytes per fp32 element


@pytest.fixture(scope="module")
def bench():
    why = fake_cuda.unavailable()
    if why is not None:
        pytest.skip(why)
    path = Path(__file__).resolve().parents[2] / "bench" / "kernel_budget.py"
    spec = importlib.util.spec_from_file_location("kernel_budget", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being defined
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


class MLPBlock(nn.Module):
    """``x + fc2(gelu(fc1(norm(x))))``, fc1's bias added by the compiled bias-GeLU when ``fused``."""

    def __init__(self, fused: bool):
        super().__init__()
        self.fused = fused
        self.norm = nn.LayerNorm(H, device="cuda")
        self.fc1 = nn.Linear(H, FFN, device="cuda")
        self.fc2 = nn.Linear(FFN, H, device="cuda")

    def forward(self, x):
        y = self.norm(x)
        y = fusions.bias_gelu(True, F.linear(y, self.fc1.weight), self.fc1.bias) if self.fused else F.gelu(self.fc1(y))
        return x + self.fc2(y)


def counted(bench, make):
    with bench.gpu_like() as counter:
        budget = bench.measure(make(), torch.randn(S, B, H, device="cuda"), counter)
    return [(k.name, k.backward, k.read, k.written) for k in budget.kernels], budget


# Counted on paper, bytes of fp32 tensors: Nh = the block's input, Nf = the MLP's inner activation.
Nh, Nf, h, f = N * H * E, N * FFN * E, H * E, FFN * E
NORM_FWD = ("native_layer_norm", False, Nh + 2 * h, Nh + 2 * N * E)  # reads x, weight, bias; writes y, mean, rstd
RESIDUAL = ("add", False, 2 * Nh, Nh)
FC2_BIAS_GRAD = ("sum", True, Nh, h)
# reads dy, x, mean, rstd, weight, bias; writes dx, dweight, dbias
NORM_BWD = ("native_layer_norm_backward", True, 2 * Nh + 2 * N * E + 2 * h, Nh + 2 * h)
RESIDUAL_GRAD = ("add", True, 2 * Nh, Nh)  # the residual's gradient and the norm's, summed at x


def test_unfused_block_counts_its_eager_kernels(bench):
    """Forward: norm, GeLU, residual add (the two addmm are matmuls); backward: fc2's bias
    gradient, GeLU's backward, fc1's bias gradient, the norm's backward, the residual sum."""
    kernels, budget = counted(bench, lambda: MLPBlock(fused=False))
    assert kernels == [NORM_FWD, ("gelu", False, Nf, Nf), RESIDUAL,
                       FC2_BIAS_GRAD, ("gelu_backward", True, 2 * Nf, Nf), ("sum", True, Nf, f),
                       NORM_BWD, RESIDUAL_GRAD]
    # two matmuls forward, four backward (input and weight gradients), each 2 N H FFN
    assert budget.flops == 6 * 2 * N * H * FFN
    assert budget.tokens == N and budget.kb_per_token() * 1e3 * N == sum(r + w for *_, r, w in kernels)


def test_compiled_bias_gelu_is_one_kernel_each_way(bench):
    """The compiled bias-GeLU: forward reads fc1's output and the bias and writes the activation
    (inductor's partitioner saves the inputs, nothing new); backward reads the gradient and the
    two inputs and writes both gradients."""
    kernels, _ = counted(bench, lambda: MLPBlock(fused=True))
    assert kernels == [NORM_FWD, ("bias_gelu fwd", False, Nf + f, Nf), RESIDUAL,
                       FC2_BIAS_GRAD, ("bias_gelu bwd", True, 2 * Nf + f, Nf + f),
                       NORM_BWD, RESIDUAL_GRAD]
    assert fusions.compile_unavailable() is None


def test_rms_norm_is_one_kernel_each_way(bench):
    """A CPU-only torch decomposes RMSNorm on "cuda" into six ops; a GPU runs one kernel forward
    (reads x and weight, writes y and the fp32 rstd) and one backward."""
    kernels, _ = counted(bench, lambda: nn.RMSNorm(H, eps=1e-5, device="cuda"))
    assert kernels == [("_fused_rms_norm", False, Nh + h, Nh + N * E),
                       ("_fused_rms_norm_backward", True, 2 * Nh + N * E + h, Nh + h)]


def test_attention_is_flash_and_not_counted(bench):
    """Causal SDPA runs as the flash kernel: no kernel of the budget, forward FLOPs 4 b heads s^2
    d / 2 and the backward 2.5 times that."""
    heads, d = 2, 16

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.k, self.v = (nn.Parameter(torch.randn(B, heads, S, d, device="cuda", dtype=torch.bfloat16))
                              for _ in range(2))

        def forward(self, q):
            return F.scaled_dot_product_attention(q, self.k, self.v, is_causal=True)

    with bench.gpu_like() as counter:
        budget = bench.measure(Attention(), torch.randn(B, heads, S, d, device="cuda", dtype=torch.bfloat16),
                               counter)
    assert budget.kernels == []
    assert budget.flops == 3.5 * 4 * B * heads * S * S * d / 2
