"""The compiled fusions (bias-GeLU, bias-SwiGLU, bias-dropout-add, RoPE) on the CPU, forced on with
``fusions_on_cpu``: the fused model computes what the unfused one computes (fp32, outputs and
gradients, dropout on), at TP 2 as at TP 1, under activation recompute and KV-cache decoding, and a
compiler failure falls back to the eager functions with one line.

Few graphs and tiny shapes on purpose: inductor compiles C++ for each graph (seconds each on two
busy cores; later processes reuse its on-disk cache).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_ds.config.arguments import IGNORED_FLAGS, parse_args
from megatron_ds.config.layout import resolve_model_config
from megatron_ds.config.schema import ModelConfig
from megatron_ds.families.gpt.gpt_family import GPT
from megatron_ds.families.gpt.gpt_model import build_sequential_gpt
from megatron_ds.model import fusions
from megatron_ds.parallel.random import set_parallel_seeds
from tests.distributed import run_distributed

VOCAB, REAL_VOCAB, SEQ = 128, 120, 12
FLAGS = ("--no-bias-gelu-fusion", "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion")
_BASE = dict(num_layers=2, seq_length=SEQ, max_position_embeddings=16, hidden_dropout=0.2, attention_dropout=0.0,
             init_method_std=0.2)
CASES = {
    "gpt2": dict(hidden_size=32, num_attention_heads=4),
    "llama": dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, ffn_hidden_size=48,
                  use_rotary_position_embeddings=True, swiglu=True, normalization="rmsnorm", add_bias_linear=False,
                  untie_embeddings_and_output_weights=True),
}
# fp32. The compiled functions do the unfused path's operations in the same order, but inductor's
# vectorized exp/erf/sigmoid are not ATen's (1 ulp apart; GeLU's erf by up to 2.4e-7 measured) and
# the C++ compiler may contract a*b+c into an FMA. Measured on this CPU, two layers, loss and
# backward: loss within 5e-7, gradients within 2e-7 (GPT-2 and Llama style). 1e-5 is 20x that,
# while a wrong bias, mask or rotation gives O(0.1) errors.
TOL = dict(rtol=1e-5, atol=1e-5)


def model_config(name: str, fused: bool, **over) -> ModelConfig:
    switches = dict(bias_gelu_fusion=fused, bias_swiglu_fusion=fused, bias_dropout_fusion=fused,
                    apply_rope_fusion=fused, fusions_on_cpu=fused)
    return resolve_model_config(ModelConfig(**{**_BASE, **CASES[name], **switches, **over}))


def batch():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, REAL_VOCAB, (2, SEQ), generator=g)
    labels = torch.randint(0, REAL_VOCAB, (2, SEQ), generator=g)
    return tokens, labels, (torch.rand(2, SEQ, generator=g) > 0.2).float()


def one_step(model, tp_rank: int = 0):
    """Loss, logits and gradients of one training step, dropout drawn from fixed streams."""
    tokens, labels, loss_mask = batch()
    set_parallel_seeds(99, tp_rank)
    model.zero_grad(set_to_none=True)
    logits = model((tokens, torch.arange(SEQ).expand_as(tokens)))
    loss = model.loss_fn(logits, (labels, loss_mask))
    loss.backward()
    return loss.detach(), logits.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_fusion_flags_are_megatron_lms_and_take_effect():
    """Megatron-LM's spellings (megatron/training/arguments.py: --no-bias-gelu-fusion dest
    bias_gelu_fusion, --no-bias-swiglu-fusion, --no-bias-dropout-fusion, --no-rope-fusion dest
    apply_rope_fusion) turn the fields off; they are no longer accepted-and-ignored."""
    base = "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16".split()
    on, ignored = parse_args(base)
    off, ignored_off = parse_args(base + list(FLAGS) + ["--fusions-on-cpu", "--no-liger-kernel"])
    fields = ("bias_gelu_fusion", "bias_swiglu_fusion", "bias_dropout_fusion", "apply_rope_fusion")
    assert all(getattr(on.model, f) for f in fields) and not on.model.fusions_on_cpu
    assert on.model.liger_kernel is None  # neither flag: resolve chooses (config/memory.py choose_fused_loss)
    assert parse_args(base + ["--liger-kernel"])[0].model.liger_kernel is True
    assert not any(getattr(off.model, f) for f in fields) and off.model.fusions_on_cpu and not off.model.liger_kernel
    assert ignored == ignored_off == [] and not set(FLAGS) & set(IGNORED_FLAGS)


@pytest.mark.parametrize("name", list(CASES))
def test_fused_model_equals_unfused_with_dropout_and_recompute(name):
    """Whole model, training mode, hidden dropout 0.2: same initial weights, loss, logits and every
    gradient with the compiled fusions as without; again with full activation recompute (the
    compiled functions re-run in backward and must replay the same dropout masks)."""
    kw = dict(padded_vocab_size=VOCAB, vocab_size=REAL_VOCAB, seed=7)
    plain = build_sequential_gpt(model_config(name, False), **kw)
    fused = build_sequential_gpt(model_config(name, True), **kw)
    recompute = build_sequential_gpt(model_config(name, True), activation_checkpoint_interval=1, **kw)
    state = plain.state_dict()
    assert all(torch.equal(v, state[k]) for k, v in fused.state_dict().items())
    ref_loss, ref_logits, ref_grads = one_step(plain)
    for model, label in ((fused, "fused"), (recompute, "fused + full recompute")):
        loss, logits, grads = one_step(model)
        torch.testing.assert_close(loss, ref_loss, **TOL, msg=lambda m: f"{name} {label} loss: {m}")
        torch.testing.assert_close(logits, ref_logits, **TOL, msg=lambda m: f"{name} {label} logits: {m}")
        for n, g in grads.items():
            torch.testing.assert_close(g, ref_grads[n], **TOL, msg=lambda m: f"{name} {label} grad {n}: {m}")
    assert fusions.compile_unavailable() is None and fusions.bias_dropout_add._compiled is not None
    # dropout really was on: a different stream gives a different loss
    set_parallel_seeds(98, 0)
    tokens, labels, loss_mask = batch()
    other = fused.loss_fn(fused((tokens, torch.arange(SEQ).expand_as(tokens))), (labels, loss_mask))
    assert abs(other.item() - ref_loss.item()) > 1e-3


def test_kv_cache_decoding_with_fusions_equals_unfused():
    """Greedy decoding with the KV cache (the sequence grows by one each step: dynamic shapes, no
    recompile per length) gives the unfused model's tokens."""
    from megatron_ds.inference.generate import SamplingConfig, generate
    from megatron_ds.inference.model import ModelWeights, build_inference_model

    module = build_sequential_gpt(model_config("llama", False), padded_vocab_size=VOCAB, seed=7)
    state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    prompts = [[5, 9, 17, 4], [8, 8, 30]]
    out = {}
    for fused in (False, True):
        weights = ModelWeights(model=model_config("llama", fused), padded_vocab_size=VOCAB, vocab_size=REAL_VOCAB,
                               state_dict=state)
        out[fused] = generate(build_inference_model(weights, family=GPT), prompts, SamplingConfig(max_new_tokens=6,
                                                                                                  greedy=True),
                              eod=3).tokens
    assert out[True] == out[False] and all(len(t) > 0 for t in out[True])


def _tp2_fused_vs_tp1(rank, world_size, name):
    import torch.distributed as dist

    from megatron_ds.parallel.layers import register_sequence_parallel_grad_hooks
    from tests.model.test_tensor_parallel import _shard

    kw = dict(padded_vocab_size=VOCAB, vocab_size=REAL_VOCAB, seed=7)
    # sequence parallel for Llama: its hidden dropout draws from the tensor parallel stream
    # (a different mask per rank, over different tokens), the other replicated (same mask)
    seq_par = name == "llama"
    group = dist.group.WORLD
    par = build_sequential_gpt(model_config(name, True), tp_group=group, sequence_parallel=seq_par, **kw)
    if seq_par:
        # TP 1 draws other masks by design; the unfused TP 2 model draws the same ones per rank
        ref = build_sequential_gpt(model_config(name, False), tp_group=group, sequence_parallel=True, **kw)
        register_sequence_parallel_grad_hooks(ref, group)
        register_sequence_parallel_grad_hooks(par, group)
    else:
        ref = build_sequential_gpt(model_config(name, False), tp_group=None, **kw)
    ref_loss, _, ref_grads = one_step(ref, rank)
    loss, _, grads = one_step(par, rank)
    params = dict(par.named_parameters())
    if seq_par:
        losses = [torch.empty_like(loss) for _ in range(world_size)]
        dist.all_gather(losses, loss)
        assert torch.equal(losses[0], losses[1])  # the ranks agree on the (replicated) loss
        torch.testing.assert_close(loss, ref_loss, **TOL)
        for n, g in grads.items():
            torch.testing.assert_close(g, ref_grads[n], **TOL, msg=lambda m: f"{name} rank {rank} grad {n}: {m}")
        return loss.item()
    torch.testing.assert_close(loss, ref_loss, **TOL)
    for n, g in grads.items():
        torch.testing.assert_close(g, _shard(ref_grads[n], params[n], rank, world_size), **TOL,
                                   msg=lambda m: f"{name} rank {rank} grad {n}: {m}")
    return loss.item()


def _tp2_cases(rank, world_size):
    return {name: _tp2_fused_vs_tp1(rank, world_size, name) for name in CASES}


def test_tp2_fused_equals_tp1_unfused_with_dropout():
    """TP 2 with the compiled fusions, hidden dropout 0.2. GPT-2 against TP 1 without: the replicated
    residual stream's masks come from the default generator, seeded alike on every rank, so the
    loss and (sharded) gradients equal TP 1's. Llama with sequence parallelism, whose masks come
    from the per-rank tensor parallel stream (other tokens per rank), against the unfused model at
    TP 2 with sequence parallelism: same masks, same loss and gradients, same loss on both ranks."""
    ranks = run_distributed(_tp2_cases, 2, timeout=300)
    assert ranks[0] == ranks[1]


def test_compile_failure_falls_back_to_eager_with_one_line(monkeypatch, capsys):
    from torch._dynamo.exc import InternalTorchDynamoError

    def broken_compile(fn, **kwargs):
        def run(*args):
            raise InternalTorchDynamoError("inductor exploded\nsecond line")
        return run

    monkeypatch.setattr(torch, "compile", broken_compile)
    monkeypatch.setattr(fusions, "_FAILED", {})
    fusable = fusions._Fusable(fusions._bias_gelu)
    x, bias = torch.randn(4, 8), torch.randn(8)
    assert torch.equal(fusable(True, x, bias), torch.nn.functional.gelu(x + bias))
    assert torch.equal(fusable(True, x, bias), torch.nn.functional.gelu(x + bias))  # no second attempt, no line
    lines = [line for line in capsys.readouterr().err.splitlines() if line]
    assert lines == ["WARNING: torch.compile of the fused bias_gelu failed (InternalTorchDynamoError: inductor "
                     "exploded); the fusions run eagerly from now on"]
    assert "eager (torch.compile unavailable: bias_gelu: InternalTorchDynamoError: inductor exploded)" in \
        fusions.describe_fusions()


def test_a_wrapped_compiler_failure_names_its_cause():
    """Dynamo wraps the backend's error: its message begins "backend='inductor' raised:" and the
    cause (say, no working Triton on a GPU node) follows on the next line. The fallback line must
    carry that cause, not the wrapper's header alone."""
    from torch._dynamo.exc import BackendCompilerFailed

    def inductor():
        pass

    cause = RuntimeError("Cannot find a working triton installation. Either the package is not installed "
                         "or it is too old.\nMore information: ...")
    wrapped = BackendCompilerFailed(inductor, cause, None)
    assert str(wrapped).splitlines()[0] == "backend='inductor' raised:"
    assert fusions.compile_failure_reason(wrapped) == (
        "BackendCompilerFailed <- RuntimeError: Cannot find a working triton installation. Either the package "
        "is not installed or it is too old.")
    chained = RuntimeError("outer")
    chained.__cause__ = ValueError("the real one\nmore")
    assert fusions.compile_failure_reason(chained) == "RuntimeError <- ValueError: the real one"
    assert fusions.compile_failure_reason(ValueError("plain\nsecond")) == "ValueError: plain"


def test_a_compile_failure_in_backward_falls_back_before_the_real_call(monkeypatch, capsys):
    """Inductor compiles a backward at its first use, too late to fall back: the first call of a
    kind proves forward and backward on copies, so the failure is met while eager can take over."""
    class FakeInductorError(RuntimeError):
        pass
    FakeInductorError.__module__ = "torch._inductor.exc"  # how the fallback recognises the compiler's errors

    class BrokenBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            raise FakeInductorError("backward codegen failed")

    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: (lambda *args: BrokenBackward.apply(fn(*args))))
    monkeypatch.setattr(fusions, "_FAILED", {})
    fusable = fusions._Fusable(fusions._bias_gelu)
    x, bias = torch.randn(4, 8, requires_grad=True), torch.randn(8, requires_grad=True)
    fusable(True, x, bias).square().sum().backward()  # would raise if the broken twin had been used
    x_ref, bias_ref = x.detach().clone().requires_grad_(), bias.detach().clone().requires_grad_()
    torch.nn.functional.gelu(x_ref + bias_ref).square().sum().backward()
    assert torch.equal(x.grad, x_ref.grad) and torch.equal(bias.grad, bias_ref.grad)
    lines = [line for line in capsys.readouterr().err.splitlines() if line]
    assert lines == ["WARNING: torch.compile of the fused bias_gelu failed (FakeInductorError: backward codegen "
                     "failed); the fusions run eagerly from now on"]


def test_the_backward_probe_is_invisible_to_activation_checkpointing():
    """The first compiled call inside a checkpointed function: the probe's own autograd graph must
    not be packed by the checkpoint's saved-tensor hooks (its recompute would disagree), and the
    gradients are those of the function without checkpointing."""
    from megatron_ds.parallel.random import checkpoint
    fusable = fusions._Fusable(fusions._bias_gelu)
    x, bias = torch.randn(4, 8, requires_grad=True), torch.randn(8, requires_grad=True)
    checkpoint(lambda a, b: fusable(True, a, b) * 2, x, bias).square().sum().backward()
    x_ref, bias_ref = x.detach().clone().requires_grad_(), bias.detach().clone().requires_grad_()
    (fusions._bias_gelu(x_ref, bias_ref) * 2).square().sum().backward()
    assert fusions.compile_unavailable() is None and fusable._proven
    # inductor's C++ GeLU (erf) on the CPU in fp32 differs from ATen's by a few ulp
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(bias.grad, bias_ref.grad, rtol=1e-5, atol=1e-6)


def test_errors_that_are_not_the_compilers_go_on_up(monkeypatch):
    """A real error inside the function (or recompute's early-stop signal) is not a compile failure."""
    def compile_that_works(fn, **kwargs):
        def run(*args):
            raise ValueError("shapes disagree")
        return run

    monkeypatch.setattr(torch, "compile", compile_that_works)
    monkeypatch.setattr(fusions, "_FAILED", {})
    with pytest.raises(ValueError, match="shapes disagree"):
        fusions._Fusable(fusions._bias_gelu)(True, torch.randn(2), torch.randn(2))
    assert fusions.compile_unavailable() is None


def test_no_torch_compile_means_eager(monkeypatch):
    monkeypatch.delattr(torch, "compile")
    assert fusions.compile_unavailable() == "this torch has no torch.compile"
    x, bias, residual = torch.randn(4, 8), torch.randn(8), torch.randn(4, 8)
    assert torch.equal(fusions.bias_dropout_add(True, x, bias, residual, 0.0), residual + (x + bias))
    assert fusions.describe_fusions().endswith(" eager (torch.compile unavailable: this torch has no torch.compile)")


def test_cpu_runs_eager_unless_forced():
    x = torch.zeros(1)
    assert not fusions.use_compiled(x, on_cpu=False) and fusions.use_compiled(x, on_cpu=True)
    assert fusions.use_compiled(torch.empty(1, device="meta"), on_cpu=True)


def test_fused_dropout_is_what_eager_dropout_draws():
    """The fused function draws its mask as eager F.dropout does on the CPU, from the same
    generator: with dropout 0.3 the eager function equals ``residual + F.dropout(x + bias)`` bit
    for bit, in fp32 and bf16 (the compiled one: the whole-model tests above)."""
    for dtype in (torch.float32, torch.bfloat16):
        x, bias, residual = (torch.randn(6, 2, 8).to(dtype), torch.randn(8).to(dtype), torch.randn(6, 2, 8).to(dtype))
        torch.manual_seed(3)
        want = residual + torch.nn.functional.dropout(x + bias, 0.3, True)
        torch.manual_seed(3)
        assert torch.equal(fusions.bias_dropout_add(False, x, bias, residual, 0.3), want), dtype


def test_compiled_dropout_follows_each_probability():
    """Two dropout probabilities through the same compiled function, on inputs that need gradients:
    each draws F.dropout's mask for its own p. torch 2.13 turned a float argument into a symbolic
    input whose first value stuck (in the process and in inductor's on-disk cache), so the fusions
    compile floats as constants (ds_compat.floats_as_compile_constants)."""
    for p in (0.1, 0.3):
        x, bias = torch.randn(6, 2, 8, requires_grad=True), torch.randn(8, requires_grad=True)
        residual = torch.randn(6, 2, 8)
        torch.manual_seed(3)
        want = residual + torch.nn.functional.dropout(x + bias, p, True)
        torch.manual_seed(3)
        torch.testing.assert_close(fusions.bias_dropout_add(True, x, bias, residual, p), want, **TOL)


def test_uncompiled_fusions_are_the_unfused_path_bit_for_bit():
    """On the CPU without --fusions-on-cpu the flags change nothing: the unfused path runs (biases
    inside the linear layers, F.dropout), so CPU runs keep their numbers exactly."""
    kw = dict(padded_vocab_size=VOCAB, vocab_size=REAL_VOCAB, seed=7)
    for name in CASES:
        cfg = dataclasses.replace(model_config(name, True), fusions_on_cpu=False)
        loss, _, grads = one_step(build_sequential_gpt(cfg, **kw))
        ref_loss, _, ref_grads = one_step(build_sequential_gpt(model_config(name, False), **kw))
        assert torch.equal(loss, ref_loss) and all(torch.equal(g, ref_grads[n]) for n, g in grads.items()), name

def _cli_runs(rank, world_size, argvs):
    from tests.training.cli import cli_many

    return cli_many(rank, world_size, argvs)


@pytest.mark.slow
def test_pretrain_cli_with_fusions_forced_on_equals_unfused():
    """pretrain_gpt.py on 2 ranks (TP 2), SwiGLU with biases, RoPE, hidden dropout 0.1: the run with
    the fusions compiled (--fusions-on-cpu) prints the losses of the run with all four turned off
    (Megatron-LM's --no-* flags), and its start-up line says how the fusions run."""
    from tests.training.cli import SMALL_GPT, iterations

    base = SMALL_GPT + ("--train-iters 3 --tensor-model-parallel-size 2 --swiglu --use-rotary-position-embeddings "
                        "--hidden-dropout 0.1 --attention-dropout 0").split()
    outputs = []
    for argv in (base + ["--fusions-on-cpu"], base + list(FLAGS)):  # fresh processes for each run
        ranks = run_distributed(_cli_runs, 2, [argv], timeout=900)
        assert all(rc == 0 for rank in ranks for rc, _, _ in rank), [err[-2000:] for rank in ranks for *_, err in rank]
        # rank 0 prints the start-up lines, the last rank the iteration lines (as Megatron)
        outputs.append(ranks[0][0][1] + ranks[1][0][1])
    out_fused, out_plain = outputs
    fused, plain = iterations(out_fused), iterations(out_plain)
    assert [it for it, _ in fused] == [1, 2, 3] and [it for it, _ in plain] == [1, 2, 3]
    # the printed losses (4 significant digits past the point, see the iteration line) agree; the
    # fused run's Llama-style functions differ from eager by at most an ulp (see TOL)
    for (_, a), (_, b) in zip(fused, plain):
        assert float(a) == pytest.approx(float(b), rel=1e-5)
    assert "elementwise fusions: bias_swiglu+bias_dropout_add+rope with torch.compile on CUDA and CPU" in out_fused
    assert "elementwise fusions: off" in out_plain
    assert "WARNING: ignoring flags" not in out_plain  # the --no-*-fusion flags are no longer ignored
