"""Megatron-LM's MoE layer on CUDA: its experts as one torch._grouped_mm in bf16 against the loop over experts,
forward and gradients (experts without tokens included)."""
from __future__ import annotations

import pytest
import torch

from megatron_ds.model import mlm_moe

pytestmark = pytest.mark.gpu

# bf16: the grouped kernel and the per-expert GEMMs accumulate in fp32 in other orders and round once: a few
# bf16 ulps (2^-8 relative) of O(1) values
BF16 = dict(rtol=2e-2, atol=2e-2)


def test_grouped_mm_equals_the_loop_forward_and_backward():
    torch.manual_seed(0)
    layer = mlm_moe._Stacked(list(range(8)), 64, 128, bias=False, std=0.5, params_dtype=torch.bfloat16,
                             device="cuda")
    counts = [40, 0, 17, 64, 3, 0, 100, 32]
    x = torch.randn(sum(counts), 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    assert mlm_moe._grouped_mm_ok(x, layer.weight)
    grouped = mlm_moe.grouped_linear(x, counts, layer, grouped=True)
    g = torch.randn_like(grouped)
    gx, gw = torch.autograd.grad(grouped, [x, layer.weight], g)
    loop = torch.cat([part @ layer.weight[e].t() for e, part in enumerate(x.split(counts))])
    lx, lw = torch.autograd.grad(loop, [x, layer.weight], g)
    for a, b in ((grouped, loop), (gx, lx), (gw, lw)):
        torch.testing.assert_close(a.float(), b.float(), **BF16)

