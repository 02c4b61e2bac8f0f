"""--fp32-residual-connection: the residual stream of a half-precision model in fp32.

Megatron-DeepSpeed casts the embedding output to fp32 (megatron/model/language_model.py), adds each
branch's half-precision output onto the fp32 residual (megatron/model/transformer.py: the
bias-dropout-add promotes), and normalizes the fp32 stream with MixedFusedLayerNorm, whose kernel
writes its output in the weights' dtype. Here: the dtypes along the stream, the norms against their
formulas, the whole model against a dense mixed-precision GPT written from that recipe (and against
fp32, which it tracks better than a bf16 stream does), and training at PP 2 through the entry point.
"""
from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch

from megatron_ds.config import parse_args, resolve
from megatron_ds.errors import ConfigError
from megatron_ds.families.gpt.gpt_family import GPT
from megatron_ds.families.gpt.gpt_model import build_sequential_gpt
from megatron_ds.model import fusions
from megatron_ds.model.language_model import FinalNorm, LanguageModelEmbedding
from megatron_ds.model.norms import build_norm
from megatron_ds.model.transformer import ParallelTransformerLayer
from megatron_ds.parallel.random import set_parallel_seeds
from tests.distributed import run_distributed
from tests.families.gpt.test_reference import VOCAB, batch, dense_weights, gpt2_config, llama_config
from tests.training.common import TINY_GPT, train_losses

BF16 = torch.bfloat16


def _bf16_model(cfg):
    set_parallel_seeds(1234, 0)
    return build_sequential_gpt(cfg, padded_vocab_size=VOCAB, seed=7).to(BF16)


def _outputs_by_kind(model, tokens, position_ids) -> dict:
    """dtype of what each embedding, layer, norm and final norm hands on, by module kind."""
    seen: dict[str, list] = {}

    def hook(kind):
        def record(module, inputs, output):
            hidden = output[0] if isinstance(output, tuple) else output
            seen.setdefault(kind, []).append(hidden.dtype)
        return record

    for name, module in model.named_modules():
        kind = type(module).__name__ if isinstance(module, (LanguageModelEmbedding, ParallelTransformerLayer,
                                                            FinalNorm)) \
            else "layer norm" if name.endswith("layernorm") and "final" not in name else None
        if kind is not None:
            module.register_forward_hook(hook(kind))
    logits = model((tokens, position_ids))
    seen["logits"] = [logits.dtype]
    return seen


@pytest.mark.parametrize("cfg", [gpt2_config(fp32_residual_connection=True),
                                 llama_config(fp32_residual_connection=True)], ids=["gpt2", "llama"])
def test_residual_stream_is_fp32_and_weights_bf16(cfg):
    model = _bf16_model(cfg)
    tokens, position_ids, labels, loss_mask = batch()
    seen = _outputs_by_kind(model, tokens, position_ids)
    assert seen["LanguageModelEmbedding"] == [torch.float32]
    assert seen["ParallelTransformerLayer"] == [torch.float32] * cfg.num_layers
    # the norms hand the half-precision branches and the output layer the weights' dtype
    assert seen["layer norm"] == [BF16] * (2 * cfg.num_layers) and seen["FinalNorm"] == [BF16]
    assert seen["logits"] == [BF16]
    assert {p.dtype for p in model.parameters()} == {BF16}
    loss = model.loss_fn(model((tokens, position_ids)), (labels, loss_mask))
    loss.backward()
    assert all(p.grad.dtype == BF16 and torch.isfinite(p.grad).all() for p in model.parameters())


def _dense_norm(x, weight, bias, kind, eps, one_plus=False):
    """The norm's formula in float64 from the fp32 input and widened weights, rounded to fp32 and then
    to the weights' dtype (the model computes in fp32 and rounds once to the weights' dtype)."""
    xf, w = x.double(), weight.double() + (1 if one_plus else 0)
    if kind == "layernorm":
        y = (xf - xf.mean(-1, keepdim=True)) / torch.sqrt(xf.var(-1, unbiased=False, keepdim=True) + eps) * w
        y = y + bias.double()
    else:
        y = xf / torch.sqrt((xf * xf).mean(-1, keepdim=True) + eps) * w
    return y.float().to(weight.dtype)


@pytest.mark.parametrize("kind,one_plus", [("layernorm", False), ("layernorm", True), ("rmsnorm", False)])
def test_norm_reads_fp32_and_writes_the_weights_dtype(kind, one_plus):
    norm = build_norm(kind, 64, 1e-5, params_dtype=BF16, one_plus=one_plus, fp32_input=True)
    with torch.no_grad():
        for p in norm.parameters():
            p.copy_(torch.randn(p.shape) * 0.3 + (0 if one_plus or p is getattr(norm, "bias", None) else 1))
    x = (torch.randn(3, 2, 64) * 5 + 1).requires_grad_(True)
    y = norm(x)
    assert y.dtype == BF16
    ref = _dense_norm(x.detach(), norm.weight, getattr(norm, "bias", None), kind, 1e-5, one_plus)
    # the same math, one final rounding: at most one bf16 step apart where the sums round differently
    torch.testing.assert_close(y, ref, rtol=2 ** -8, atol=1e-6)
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32  # the residual's gradient stays fp32 (as the mixed kernel's)


# ----------------------------------------------------------------------------- the whole model

def dense_mixed_gpt(w, cfg, tokens, position_ids):
    """The residual stream after the last layer ``[b, s, h]`` and the logits of the recipe: bf16
    weights and branches, fp32 residual adds, each norm in fp32 from the fp32 stream with its output
    rounded to bf16 (where Megatron's mixed kernel writes gamma's dtype). Per-group q/k/v matrices cut
    from the fused projection; attention by torch's scaled_dot_product_attention, so its bf16
    internals round as the model's (tests/families/gpt/test_reference.py checks attention from the formula)."""
    b, s = tokens.shape
    nq, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.kv_channels
    norm = lambda x, wb: _dense_norm(x, wb[0], wb[1], cfg.normalization, cfg.layernorm_epsilon)  # noqa: E731
    linear = torch.nn.functional.linear
    x = w["wte"][tokens] + w["wpe"][position_ids]  # a bf16 add, then the stream starts in fp32
    x = x.float()
    kv_of_head = torch.arange(nq) // (nq // nkv)
    for L in w["layers"]:
        y = norm(x, L["ln1"])
        q = linear(y, L["wq"], L["bq"]).view(b, s, nq, d)
        k = linear(y, L["wk"], L["bk"]).view(b, s, nkv, d)[:, :, kv_of_head]
        v = linear(y, L["wv"], L["bv"]).view(b, s, nkv, d)[:, :, kv_of_head]
        ctx = torch.nn.functional.scaled_dot_product_attention(
            *(t.transpose(1, 2) for t in (q, k, v)), is_causal=True).transpose(1, 2).reshape(b, s, nq * d)
        x = x + linear(ctx, L["wo"], L["bo"]).float()  # the bf16 branch added onto the fp32 stream
        y = norm(x, L["ln2"])
        x = x + linear(torch.nn.functional.gelu(linear(y, L["w1"], L["b1"])), L["w2"], L["b2"]).float()
    return x, norm(x, w["lnf"]) @ w["wout"].t()


def _stream_and_logits(model, tokens, position_ids):
    """The residual stream after the last layer (the final norm's input, fp32, [b, s, h]) and the logits."""
    final = next(m for m in model.modules() if isinstance(m, FinalNorm))
    seen = []
    handle = final.register_forward_hook(lambda module, inputs, output: seen.append(inputs[0].float().transpose(0, 1)))
    with torch.no_grad():
        logits = model((tokens, position_ids))
    handle.remove()
    return seen[0], logits


def test_model_is_the_dense_mixed_precision_recipe_and_tracks_fp32_better():
    """The flagged bf16 model computes the dense recipe above bit for bit (hidden dropout 0, CPU:
    the unfused path). The same weights without the flag round the stream to bf16 at every residual
    add: off the recipe, and further from the same (bf16-rounded) weights run in fp32."""
    cfg = gpt2_config(fp32_residual_connection=True)
    tokens, position_ids, _, _ = batch()
    flagged = _bf16_model(cfg)
    plain = _bf16_model(dataclasses.replace(cfg, fp32_residual_connection=False))
    plain.load_state_dict(flagged.state_dict())
    got, got_logits = _stream_and_logits(flagged, tokens, position_ids)
    without, _ = _stream_and_logits(plain, tokens, position_ids)
    with torch.no_grad():
        recipe, recipe_logits = dense_mixed_gpt(dense_weights(flagged, cfg), cfg, tokens, position_ids)
    assert torch.equal(got, recipe) and torch.equal(got_logits, recipe_logits)
    assert not torch.equal(without, recipe)
    fp32, _ = _stream_and_logits(plain.float(), tokens, position_ids)

    def err(a):
        return ((a - fp32).abs().max() / fp32.abs().max()).item()

    assert err(got) < err(without), (err(got), err(without))


def test_compiled_bias_dropout_add_keeps_the_stream_fp32():
    """The compiled bias-dropout-add (forced on the CPU) with a bf16 branch and the fp32 residual:
    fp32 out, fp32 gradient back into the stream, bf16 into the branch, and the numbers of the
    unfused layer (same dropout draw; inductor may keep the bf16 ``x + bias`` in fp32 inside its
    kernel where eager rounds it, so within a bf16 step)."""
    cfg = gpt2_config(fp32_residual_connection=True, hidden_dropout=0.2, bias_gelu_fusion=False)
    outputs = []
    for fused in (False, True):
        set_parallel_seeds(1234, 0)
        layer = ParallelTransformerLayer(dataclasses.replace(cfg, bias_dropout_fusion=fused, fusions_on_cpu=fused),
                                         1, params_dtype=BF16)
        x = torch.randn(12, 2, cfg.hidden_size, generator=torch.Generator().manual_seed(0)).requires_grad_(True)
        torch.manual_seed(5)
        out = layer(x)
        out.sum().backward()
        outputs.append((out.detach(), x.grad))
        assert out.dtype == x.grad.dtype == torch.float32
    assert fusions.bias_dropout_add._compiled is not None and fusions.compile_unavailable() is None
    (plain, plain_grad), (fused, fused_grad) = outputs
    torch.testing.assert_close(fused, plain, rtol=0, atol=2 ** -7 * plain.abs().max().item())
    torch.testing.assert_close(fused_grad, plain_grad, rtol=0, atol=2 ** -6 * plain_grad.abs().max().item())


def test_pp2_training_with_fp32_residual_stream():
    """Through the entry point at PP 2 in bf16: DeepSpeed's pipeline engine sends the fp32 stream
    as it is (its tensor meta carries the dtype), and the interleaved executor receives fp32 into
    buffers of that dtype (pipeline/executor.py). Both run the same bf16 operations
    (ZeRO-1, fp32 gradient accumulation: tests/pipeline/test_interleaved.py), so the first loss,
    before any update, is the same bit for bit; later ones within that file's RTOL, as the global
    grad norm sums its terms in another order (measured: equal up to iteration 4, 2e-6 apart at 8,
    as without the flag). And the model trains."""
    argv = TINY_GPT + ["--train-iters", "8", "--global-batch-size", "8", "--hidden-dropout", "0",
                       "--attention-dropout", "0", "--pipeline-model-parallel-size", "2", "--bf16",
                       "--fp32-residual-connection", "--zero-stage", "1",
                       "--deepspeed_config", os.path.join("ds_configs", "zero1_bf16.json")]
    pipeline = run_distributed(train_losses, 2, argv, timeout=600)
    interleaved = run_distributed(train_losses, 2, argv + ["--num-layers-per-virtual-pipeline-stage", "1"],
                                  timeout=600)
    assert pipeline[0] == pipeline[1] and interleaved[0] == interleaved[1]  # the loss reaches every rank
    losses, other = [x for _, x in pipeline[0]], [x for _, x in interleaved[0]]
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
    assert other[0] == losses[0] and other == pytest.approx(losses, rel=2e-5)


def test_fp32_runs_refuse_the_flag_as_megatron_does():
    """megatron/arguments.py asserts fp16 or bf16 with --fp32-residual-connection; one line here."""
    base = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
            "--micro-batch-size 1 --train-iters 1 --lr 1e-3 --mock-data --fp32-residual-connection").split()
    cfg, _ = parse_args(base)
    assert cfg.model.fp32_residual_connection
    with pytest.raises(ConfigError, match="--fp32-residual-connection .* pass --bf16 or --fp16") as err:
        resolve(cfg, world_size=1, vocab_size=128, device_type="cpu", family=GPT)
    assert "\n" not in str(err.value)
    assert resolve(parse_args(base + ["--bf16"])[0], world_size=1, vocab_size=128, device_type="cpu",
                   family=GPT).layout.model \
        .fp32_residual_connection
