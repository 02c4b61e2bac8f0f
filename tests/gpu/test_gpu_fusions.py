"""The fused fast paths on CUDA against their unfused references, outputs and gradients: each
compiled function (bias-GeLU, bias-SwiGLU, bias-dropout-add, RoPE), a whole model with and without
them, liger-kernel's fused linear + cross entropy where installed, and the real CLI's start-up line
and losses with the fusions on and off."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from megatron_ds.families.gpt.gpt_model import build_sequential_gpt
from megatron_ds.model import fusions, liger
from megatron_ds.model.rotary import apply_rotary, rotary_cos_sin
from tests.gpu.helpers import RUN_TO_RUN, SHAPE, run_cli
from tests.model.test_fusions import FLAGS, model_config

pytestmark = pytest.mark.gpu

# Tolerances. fp32: inductor's exp/erf/tanh are not ATen's and it may contract a*b+c into an FMA:
# a few ulps of O(1) values, 1e-5 is far above that and far below a wrong bias, mask or rotation
# (O(0.1)). bf16: eager rounds every intermediate to bf16 (2^-8 = 3.9e-3 relative) while the
# compiled kernel keeps intermediates in fp32 and rounds once at the store, so they differ by up to
# the ~3 roundings of the eager chain (GeLU: add, erf, products) of O(1) values: 2e-2.
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
DTYPES = [torch.float32, torch.bfloat16]


def _inputs(*shapes, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(s, device="cuda", generator=gen).to(dtype).requires_grad_(True) for s in shapes]


def _compare(fusable, reference, args, dtype):
    """Compiled ``fusable`` vs ``reference`` (the unfused torch ops) on the same inputs: outputs and
    the gradients of every tensor input, for a random upstream gradient."""
    twins = [a.detach().clone().requires_grad_(True) if isinstance(a, torch.Tensor) and a.requires_grad else a
             for a in args]
    got = fusable(True, *args)
    want = reference(*twins)
    got, want = (got if isinstance(got, tuple) else (got,)), (want if isinstance(want, tuple) else (want,))
    upstream = [torch.randn_like(w) for w in want]
    torch.autograd.backward(got, upstream)
    torch.autograd.backward(want, upstream)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL[dtype])
    for a, t in zip(args, twins):
        if isinstance(a, torch.Tensor) and a.requires_grad:
            torch.testing.assert_close(a.grad, t.grad, **TOL[dtype])
    assert fusions.compile_unavailable() is None and fusable._compiled is not None


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bias_gelu(dtype):
    x, bias = _inputs((64, 2, 256), (256,), dtype=dtype)
    _compare(fusions.bias_gelu, lambda x, b: F.gelu(x + b), (x, bias), dtype)


def _swiglu_reference(x, b):
    gate, up = (x if b is None else x + b).chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_bias", [True, False])
def test_bias_swiglu(dtype, with_bias):
    x, bias = _inputs((64, 2, 512), (512,), dtype=dtype)
    bias = bias if with_bias else None
    if dtype == torch.bfloat16 and with_bias:
        _compare_bias_swiglu_with_fp32(x, bias)
        return
    _compare(fusions.bias_swiglu, _swiglu_reference, (x, bias), dtype)


def _compare_bias_swiglu_with_fp32(x, bias):
    """bf16 with a bias: against the unfused function evaluated in fp32 on the same (bf16) inputs,
    the value both the compiled kernel and eager bf16 approximate. The bias gradient sums the 128
    rows of d(x + b); eager bf16 rounds every row's term ~3 times, the compiled kernel rounds each
    once or not at all, so their difference reached 0.19 where the sum is ~10: neither is the
    reference. Outputs and the input gradient are rounded once at the store: TOL. The bias
    gradient: each summed term carries at most two bf16 roundings (2 x 2^-8 relative) whatever
    order or precision the kernel sums in, so the error is at most 2^-7 x the sum of the terms'
    magnitudes (here ~128 O(1) terms: ~1, where the sums themselves are ~sqrt(128) ~ 11 and a
    wrong derivative moves them by that much), plus the final rounding of the sum (2^-8 relative)."""
    x32, b32 = (t.detach().float().requires_grad_(True) for t in (x, bias))
    got = fusions.bias_swiglu(True, x, bias)
    want = _swiglu_reference(x32, b32)
    upstream = torch.randn_like(got)
    got.backward(upstream)
    want.backward(upstream.float())
    torch.testing.assert_close(got.float(), want, **TOL[torch.bfloat16])
    torch.testing.assert_close(x.grad.float(), x32.grad, **TOL[torch.bfloat16])
    # the terms the bias gradient sums: d(x + b) per row, from the fp32 evaluation
    magnitudes = x32.grad.abs().reshape(-1, x32.shape[-1]).sum(0)
    bound = 2 ** -7 * magnitudes + 2 ** -8 * b32.grad.abs()
    error = (bias.grad.float() - b32.grad).abs()
    assert (error <= bound).all(), (error.max().item(), (error / bound).max().item())
    assert fusions.compile_unavailable() is None and fusions.bias_swiglu._compiled is not None


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bias_dropout_add(dtype):
    """Without dropout against residual + x + bias; the in-kernel dropout: ``test_in_kernel_dropout``."""
    x, bias, residual = _inputs((64, 2, 256), (256,), (64, 2, 256), dtype=dtype)
    _compare(fusions.bias_dropout_add, lambda x, b, r, p: r + (x + b), (x, bias, residual, 0.0), dtype)


def test_in_kernel_dropout():
    """The compiled bias-dropout-add draws its mask inside the kernel (inductor's Philox stream,
    seeded from the current CUDA generator): about p of the elements dropped, the others scaled by
    1/(1-p); the same generator state draws the same mask, another state another; under activation
    checkpointing the recompute redraws the forward's mask, so gradients equal those without."""
    from megatron_ds.parallel.random import checkpoint

    p = 0.25
    x, bias, residual = _inputs((512, 2, 256), (256,), (512, 2, 256), dtype=torch.float32)

    def run(seed, recompute):
        torch.cuda.manual_seed(seed)
        args = [t.detach().clone().requires_grad_(True) for t in (x, bias, residual)]
        out = (checkpoint(fusions.bias_dropout_add, True, *args, p) if recompute
               else fusions.bias_dropout_add(True, *args, p))
        out.backward(torch.ones_like(out))
        return out.detach(), [a.grad for a in args]

    out, grads = run(5, recompute=False)
    kept = out - residual.detach()
    dropped = (kept == 0).float().mean().item()
    assert abs(dropped - p) < 0.01, dropped  # 262144 draws: the fraction's std is ~0.001
    nonzero = kept != 0
    torch.testing.assert_close(kept[nonzero], ((x + bias).detach() / (1 - p))[nonzero], rtol=1e-5, atol=1e-5)
    same, _ = run(5, recompute=False)
    other, _ = run(6, recompute=False)
    assert torch.equal(out, same) and not torch.equal(out, other)
    replayed, replayed_grads = run(5, recompute=True)
    assert torch.equal(replayed, out)
    for g, r in zip(grads, replayed_grads):
        assert torch.equal(g, r)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rotary_dim", [64, 32])  # whole head, and --rotary-percent 0.5
def test_rope(dtype, rotary_dim):
    """The fused split + rotation of the QKV projection ([s, b, groups, heads_per_group + 2, d]),
    against the unfused split and rotation: outputs and the one QKV gradient."""
    (qkv,) = _inputs((128, 2, 2, 6, 64), dtype=dtype)
    cos, sin = rotary_cos_sin(128, rotary_dim, 10000.0, qkv.device)

    def reference(qkv, c, s):
        q, k, v = fusions.split_qkv(qkv)
        return apply_rotary(q, c, s), apply_rotary(k, c, s), v

    _compare(fusions.rope_qkv, reference, (qkv, cos, sin), dtype)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_model_step_with_and_without_fusions(name):
    """One bf16 training step of the tiny test model on the GPU: loss and gradients with the
    compiled fusions against the model without (dropout 0: CUDA's F.dropout and our mask draw
    differently). bf16 through two layers and the loss: 2e-2 as for the functions above."""
    kw = dict(padded_vocab_size=128, vocab_size=120, seed=7, params_dtype=torch.bfloat16, device="cuda")
    results = []
    for fused in (False, True):
        cfg = dataclasses.replace(model_config(name, fused), hidden_dropout=0.0, fusions_on_cpu=False, liger_kernel=False)
        model = build_sequential_gpt(cfg, **kw)
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, 120, (2, 12), generator=gen).cuda()
        labels = torch.randint(0, 120, (2, 12), generator=gen).cuda()
        loss = model.loss_fn(model((tokens, torch.arange(12, device="cuda").expand_as(tokens))),
                             (labels, torch.ones(2, 12, device="cuda")))
        loss.backward()
        results.append((loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=2e-2, atol=2e-2)
    for n, g in results[1][1].items():
        torch.testing.assert_close(g, results[0][1][n], rtol=2e-2, atol=2e-2, msg=lambda m: f"{n}: {m}")


@pytest.mark.skipif(liger.liger_fused_linear_cross_entropy()[0] is None,
                    reason="liger-kernel not usable here (pip install megatron_ds[gpu])")
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_liger_fused_linear_cross_entropy_matches_the_vocab_parallel_loss(name):
    """bf16 model at TP 1: liger's fused projection + loss against the logits + chunked vocab-parallel
    cross entropy, loss and gradients. Both reduce in fp32 from bf16 logits/products: the loss
    agrees to ~1e-3 relative; gradients are rounded to bf16 once on each side (2 roundings of
    2^-8 relative): 2e-2. Padded rows (120..127) of the output weight get exactly zero gradient."""
    kw = dict(padded_vocab_size=128, vocab_size=120, seed=7, params_dtype=torch.bfloat16, device="cuda")
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 120, (2, 64), generator=gen).cuda()
    labels = torch.randint(0, 120, (2, 64), generator=gen).cuda()
    loss_mask = (torch.rand(2, 64, generator=gen) > 0.2).float().cuda()
    results = []
    for use_liger in (False, True):
        cfg = dataclasses.replace(model_config(name, True), hidden_dropout=0.0, fusions_on_cpu=False,
                                  seq_length=64, max_position_embeddings=64, liger_kernel=use_liger)
        model = build_sequential_gpt(cfg, **kw)
        out = model((tokens, torch.arange(64, device="cuda").expand_as(tokens)))
        assert isinstance(out, liger.HiddenForLoss) == use_liger
        loss = model.loss_fn(out, (labels, loss_mask))
        loss.backward()
        results.append((loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-3, atol=1e-3)
    for n, g in results[1][1].items():
        torch.testing.assert_close(g, results[0][1][n], rtol=2e-2, atol=2e-2, msg=lambda m: f"{n}: {m}")
        if "word_embeddings" in n or "output_layer" in n:
            assert torch.count_nonzero(g[120:]) == 0, n


def test_cli_logs_the_fusions_and_trains_alike_with_them_off():
    """The real CLI on one GPU, Llama options, bf16: the start-up line names the compiled fusions,
    and the losses with Megatron-LM's --no-*-fusion flags follow the fused run's (RUN_TO_RUN: bf16
    and GPU kernels are not bitwise reproducible between two processes, let alone two kernels)."""
    argv = SHAPE + ["--mock-data", "--vocab-size", "1024", "--bf16", "--train-iters", "8", "--swiglu",
                    "--use-rotary-position-embeddings", "--normalization", "rmsnorm"]
    fused = run_cli(argv)
    plain = run_cli(argv + list(FLAGS) + ["--no-liger-kernel"])
    assert "elementwise fusions: bias_swiglu+bias_dropout_add+rope with torch.compile on CUDA" in fused["stdout"]
    assert "elementwise fusions: off" in plain["stdout"]
    assert len(fused["losses"]) == len(plain["losses"]) == 8
    torch.testing.assert_close(torch.tensor(fused["losses"]), torch.tensor(plain["losses"]), **RUN_TO_RUN)
