"""--cp-block-kernel flash's CUDA branch (parallel/attention_blocks.py) on fake bf16 CUDA tensors: the context
parallel ring at CP 2 (rank 0 of torch's fake process group, whose exchanges return at once) runs its blocks
through torch's flash operator (full and causal blocks) or memory-efficient operator (document masks) forward
and backward, with the arguments the kernels need: square causal blocks, one head dim (multi-latent attention's
values zero-padded), the bias rows 16-element aligned, the efficient kernel's LSE padded to 32 queries and
sliced back. FakeTensorMode runs the operators' meta kernels, which give CUDA's output shapes."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_ds import ds_compat, fake_cuda
from megatron_ds.parallel import attention_blocks
from megatron_ds.parallel.context_parallel import ContextParallel

B, H, G, C = 1, 4, 2, 40  # chunks of 40 positions: the efficient kernel's 32-query LSE padding shows


class _Recorder:
    """``torch.ops.aten`` that records (operator name, its arguments) of each call."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        op = getattr(torch.ops.aten, name)

        def call(*args, **kwargs):
            self.calls.append((name, args, kwargs))
            return op(*args, **kwargs)
        return call


@pytest.mark.parametrize("docs,dv", [(False, 64), (True, 64), (False, 48)])
def test_flash_blocks_cuda_branch(gpu, monkeypatch, docs, dv):
    rec = _Recorder()
    monkeypatch.setattr(attention_blocks, "_aten", rec)
    with ds_compat.fake_process_group(2, 0), fake_cuda.activate():
        cp = ContextParallel(dist.group.WORLD, "p2p", "flash")
        q = torch.randn(B, H, 2 * C, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(B, G, 2 * C, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(B, G, 2 * C, dv, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        document_ids = torch.zeros(B, 4 * C, dtype=torch.long, device="cuda") if docs else None
        out = cp.attention(q, k, v, document_ids, scale=0.125)
        out.float().sum().backward()
    assert out.shape == (B, H, 2 * C, dv) and out.dtype == torch.bfloat16 and out.device.type == "cuda"
    for t in (q, k, v):
        assert t.grad.shape == t.shape and t.grad.dtype == torch.bfloat16 and t.grad.device.type == "cuda"
    names = [name for name, _, _ in rec.calls]
    # rank 0 holds chunks 0 and 3: its own K/V give chunk 0's causal block, chunk 3's causal block and its full
    # block over chunk 0; rank 1's (chunks 1 and 2) one full block of chunk 3 over both
    fwd, bwd = ("_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward") \
        if docs else ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward")
    assert names == [fwd] * 4 + [bwd] * 4
    for name, args, kwargs in rec.calls:
        qp, kp, vp = args[1:4] if name.endswith("backward") else args[:3]
        assert qp.shape[-1] == kp.shape[-1] == vp.shape[-1] == 64 and qp.shape[1] == H  # padded; GQA expanded
        assert kwargs == {"scale": 0.125}
        if docs:
            bias = args[4] if name.endswith("backward") else args[3]
            assert bias.shape == (B, H, C, kp.shape[2]) and bias.stride(-2) % 16 == 0 and bias.dtype == torch.bfloat16
            if name.endswith("backward"):
                assert args[6].shape == (B, H, 64) and args[6].dtype == torch.float32  # the LSE, padded to 32s
        else:
            causal = args[11] if name.endswith("backward") else args[4]
            assert not causal or qp.shape[2] == kp.shape[2] == C  # only square blocks are causal
            if name.endswith("backward"):
                assert args[5].shape == (B, H, C) and args[5].dtype == torch.float32
    causal_blocks = [a for n, a, _ in rec.calls if n == fwd and not docs and a[4]]
    assert len(causal_blocks) == (0 if docs else 2)


def test_flash_blocks_fall_back_to_math_for_fp32_on_cuda(gpu, monkeypatch):
    """fp32 on CUDA: the flash operators take fp16/bf16 only, so the blocks run the math path."""
    rec = _Recorder()
    monkeypatch.setattr(attention_blocks, "_aten", rec)
    with ds_compat.fake_process_group(2, 1), fake_cuda.activate():
        cp = ContextParallel(dist.group.WORLD, "all_gather", "flash")
        q, k, v = (torch.randn(B, H, 2 * C, 32, device="cuda", requires_grad=True) for _ in range(3))
        cp.attention(q, k, v).sum().backward()
    assert rec.calls == [] and q.grad.shape == q.shape
