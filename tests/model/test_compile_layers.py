"""--compile-layers: each transformer layer's forward compiled with torch.compile (regional compilation).

Graph counts run dynamo with a counting backend (no code generation: fast); the parity tests run
inductor, which builds C++ on the CPU (seconds per graph on two busy cores), so the models are tiny
and every layer of a model shares one graph.
"""
from __future__ import annotations

import functools
import warnings

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from megatron_ds.config.arguments import parse_args
from megatron_ds.config.layout import resolve_model_config
from megatron_ds.config.schema import ModelConfig
from megatron_ds.errors import ConfigError
from megatron_ds.families.gpt.gpt_family import GPT
from megatron_ds.families.gpt.gpt_model import build_sequential_gpt, build_stage_gpt
from megatron_ds.model import compile_layers as cl
from megatron_ds.model import fusions
from megatron_ds.model.transformer import ParallelTransformerLayer
from megatron_ds.parallel.random import set_parallel_seeds
from tests.distributed import run_distributed

VOCAB, SEQ = 64, 16
CASES = {
    "gpt2": dict(hidden_size=32, num_attention_heads=4),
    "llama": dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, ffn_hidden_size=48,
                  use_rotary_position_embeddings=True, swiglu=True, normalization="rmsnorm", add_bias_linear=False,
                  untie_embeddings_and_output_weights=True),
}
# fp32 on the CPU. Inductor computes the norms' and softmax's reductions with its own vectorized
# loops (another summation order, its own exp), and the C++ compiler may contract a*b+c into an FMA;
# the matmuls stay ATen's. Measured here, two layers, one step: loss within 2.4e-7, gradients within
# 2.7e-7 absolute (GPT-2 and Llama style, with and without full recompute). 2e-5 is 70x that, while a
# wrong mask, bias, rotation or a missing residual gives O(0.1).
TOL = dict(rtol=2e-5, atol=2e-5)
# At TP 2 (gloo) dynamo traces the TP layers' collectives into the graph: still one graph, no break.
TP2_GRAPHS_AND_BREAKS = (1, 0)
# An MoE layer: 2 graphs around DeepSpeed's eager MoE, 1 break; twice, the first layer's input being the
# hidden state alone and the second's (hidden, moe loss).
MOE_GRAPHS_AND_BREAKS = (4, 2)


def model_config(name: str, **over) -> ModelConfig:
    base = dict(num_layers=2, seq_length=SEQ, max_position_embeddings=SEQ, hidden_dropout=0.0,
                attention_dropout=0.0, init_method_std=0.2)
    return resolve_model_config(ModelConfig(**{**base, **CASES[name], **over}))


def one_step(model, tp_rank: int = 0):
    """Loss and gradients of one training step on a fixed batch."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    set_parallel_seeds(99, tp_rank)
    model.zero_grad(set_to_none=True)
    loss = model.loss_fn(model((tokens, torch.arange(SEQ).expand_as(tokens))), (tokens, torch.ones(2, SEQ)))
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def graphs_and_breaks(model, steps: int = 2) -> tuple[int, int]:
    """(graphs dynamo made, graph breaks) over ``steps`` training steps of ``model``'s compiled
    layers, counted without code generation."""
    torch._dynamo.reset()
    counters.clear()
    counter = CompileCounterWithBackend("eager")
    cl.compile_layers(model, backend=counter)
    for _ in range(steps):
        one_step(model)
    return counter.frame_count, sum(counters["graph_break"].values())


def test_the_default_is_on_with_cuda_only_and_says_so(monkeypatch):
    """Neither flag: compiled where a run trains on CUDA (measured faster on an H200: bench/RESULTS.md),
    eager on the CPU, where "cuda" has no GPU behind it (fake CUDA, CPU tests of the CUDA branches)
    and under ZB-H1; either flag wins everywhere."""
    from megatron_ds import accelerator
    from megatron_ds.config.run import resolve

    monkeypatch.setattr(accelerator, "cuda_compiles", lambda: True)  # as on a GPU

    base = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
            "--micro-batch-size 1 --train-iters 1 --lr 1e-3 --mock-data").split()
    assert parse_args(base)[0].model.compile_layers is None
    assert parse_args(base + ["--no-compile-layers"])[0].model.compile_layers is False

    def resolved(argv, device_type):
        return resolve(parse_args(argv)[0], world_size=1, vocab_size=VOCAB, device_type=device_type,
                       ds_template=None, family=GPT)

    cases = [(base, "cuda", True), (base, "cpu", False), (base + ["--no-compile-layers"], "cuda", False),
             (base + ["--compile-layers"], "cpu", True)]
    for argv, device_type, compiled in cases:
        run = resolved(argv, device_type)
        assert run.layout.model.compile_layers is compiled, (argv, device_type)
        assert f"transformer layers: {'compiled' if compiled else 'eager'}" in run.describe()
        said = cl.describe_compiled_layers(run.layout.model)
        assert said == "each compiled with torch.compile (--no-compile-layers: eager)" if compiled else \
            said.startswith("eager")
    zbh1 = base + ["--pipeline-model-parallel-size", "2", "--enable-zbh1-pipeline", "--global-batch-size", "4"]
    assert resolve(parse_args(zbh1)[0], world_size=2, vocab_size=VOCAB, device_type="cuda",
                   ds_template=None, family=GPT).layout.model.compile_layers is False
    monkeypatch.undo()
    with accelerator.simulate("cuda"):  # fake CUDA: a CPU build's inductor has no CUDA backend
        assert resolved(base, "cuda").layout.model.compile_layers is False
        assert resolved(base + ["--compile-layers"], "cuda").layout.model.compile_layers is True
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU run resolved as "cuda"
    assert resolved(base, "cuda").layout.model.compile_layers is False


def test_zero_bubble_schedule_is_refused():
    from megatron_ds.config.run import resolve

    argv = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
            "--micro-batch-size 1 --global-batch-size 4 --train-iters 1 --lr 1e-3 --mock-data "
            "--pipeline-model-parallel-size 2 --enable-zbh1-pipeline --compile-layers").split()
    with pytest.raises(ConfigError, match="--compile-layers cannot be combined with --enable-zbh1-pipeline"):
        resolve(parse_args(argv)[0], world_size=2, vocab_size=VOCAB, device_type="cpu", ds_template=None, family=GPT)


@pytest.mark.parametrize("name,over,build", [
    ("gpt2", {}, {}),
    ("llama", {}, {}),
    ("llama", {}, dict(recompute_granularity="selective")),
    ("llama", {}, dict(activation_checkpoint_interval=1)),
    # the fusions forced on (as on CUDA): traced into the layer's graph, not compiled on their own
    ("gpt2", dict(fusions_on_cpu=True, hidden_dropout=0.1), {}),
    ("llama", dict(fusions_on_cpu=True, hidden_dropout=0.1), {}),
])
def test_one_graph_without_breaks_for_every_layer(name, over, build):
    """At TP 1 without attention dropout a layer is one graph with no break, under selective and full
    recompute too, and the two layers share it (the second compiles nothing). A regression that
    splits the layer fails here."""
    model = build_sequential_gpt(model_config(name, **over), padded_vocab_size=VOCAB, seed=7, **build)
    assert graphs_and_breaks(model) == (1, 0)
    # compile_layers' wrapper of each layer's forward (model/compile_layers.py)
    assert all(type(m.forward).__name__ == "_CompiledLayerForward" for m in model.modules()
               if isinstance(m, ParallelTransformerLayer))


def test_rotary_tables_enter_the_graph_as_inputs():
    """The RoPE cos/sin tables are made once, outside the compiled layers: no layer's graph computes
    them (before, dynamo traced through the tables' cache and every layer's forward and recompute
    rebuilt them from an arange), and dynamo warns about no cache wrapper."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    model = build_sequential_gpt(model_config("llama"), padded_vocab_size=VOCAB, seed=7)
    cl.compile_layers(model, backend=backend)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        one_step(model)
    ops = {str(node.target) for gm in graphs for node in gm.graph.nodes if node.op == "call_function"}
    assert len(graphs) == 1 and not [op for op in ops if "arange" in op or "cos" in op or "sin" in op], ops
    assert not [w for w in caught if "lru_cache" in str(w.message)]


def test_moe_layers_break_once_around_deepspeeds_moe():
    """DeepSpeed's MoE (its gate reads .item()) runs eagerly inside a compiled MoE layer: the break at
    the call propagates to the layer's frame, 2 graphs and 1 break per MoE layer input structure; the loss
    and gradients stay eager's (the MoE half is eager, the rest dynamo with the eager backend)."""
    cfg = model_config("gpt2", num_experts=(4,), expert_interval=1, hidden_size=16, num_attention_heads=2)
    kw = dict(padded_vocab_size=VOCAB, seed=7)
    ref_loss, ref_grads = one_step(build_sequential_gpt(cfg, **kw))
    model = build_sequential_gpt(cfg, **kw)
    assert graphs_and_breaks(model, steps=1) == MOE_GRAPHS_AND_BREAKS
    loss, grads = one_step(model)
    torch.testing.assert_close(loss, ref_loss, **TOL)
    for n, g in grads.items():
        torch.testing.assert_close(g, ref_grads[n], **TOL)


def test_attention_dropout_breaks_the_graph_where_it_forks_the_generator():
    """Attention dropout draws from the tensor parallel stream, whose fork dynamo does not trace: the
    attention core with dropout runs eagerly, one break propagated through the four nested calls
    (layer -> attention -> _attend -> _core), six graphs per layer (shared by the layers)."""
    model = build_sequential_gpt(model_config("gpt2", attention_dropout=0.1), padded_vocab_size=VOCAB, seed=7)
    assert graphs_and_breaks(model) == (6, 4)


@pytest.mark.parametrize("name", list(CASES))
def test_compiled_layers_equal_eager(name):
    """Inductor: loss and every gradient of one step as eager, also under full recompute (the
    checkpoint reruns the compiled forward in backward)."""
    kw = dict(padded_vocab_size=VOCAB, seed=7)
    ref_loss, ref_grads = one_step(build_sequential_gpt(model_config(name), **kw))
    for build in ({}, dict(activation_checkpoint_interval=1)):
        model = build_sequential_gpt(model_config(name), **kw, **build)
        assert cl.compile_layers(model) == 2
        loss, grads = one_step(model)
        torch.testing.assert_close(loss, ref_loss, **TOL)
        for n, g in grads.items():
            torch.testing.assert_close(g, ref_grads[n], **TOL, msg=lambda m: f"{name} {build} grad {n}: {m}")
    assert cl.compile_unavailable(cl._FAILED) is None


def _tp2_compiled_vs_eager(rank, world_size):
    import torch.distributed as dist

    kw = dict(padded_vocab_size=VOCAB, seed=7, tp_group=dist.group.WORLD)
    ref_loss, ref_grads = one_step(build_sequential_gpt(model_config("gpt2"), **kw), rank)
    model = build_sequential_gpt(model_config("gpt2"), **kw)
    cl.compile_layers(model)
    loss, grads = one_step(model, rank)
    torch.testing.assert_close(loss, ref_loss, **TOL)
    for n, g in grads.items():
        torch.testing.assert_close(g, ref_grads[n], **TOL, msg=lambda m: f"rank {rank} grad {n}: {m}")
    counted = graphs_and_breaks(build_sequential_gpt(model_config("gpt2"), **kw))
    return loss.item(), counted


def test_tp2_compiled_layers_equal_eager_and_count_their_graphs():
    """TP 2 on gloo: the compiled layers' loss and gradient shards are eager's, and the count of
    graphs and breaks at TP 2 is stated (the collectives inside the TP layers' autograd Functions)."""
    ranks = run_distributed(_tp2_compiled_vs_eager, 2, timeout=600)
    assert ranks[0][0] == ranks[1][0]
    assert ranks[0][1] == ranks[1][1] == TP2_GRAPHS_AND_BREAKS



def test_a_compile_failure_runs_every_layer_eagerly_with_one_line(monkeypatch, capsys):
    from torch._dynamo.exc import InternalTorchDynamoError

    def broken_compile(fn, **kwargs):
        def run(*args, **kw):
            raise InternalTorchDynamoError("dynamo exploded\nsecond line")
        return run

    monkeypatch.setattr(torch, "compile", broken_compile)
    monkeypatch.setattr(cl, "_FAILED", {})
    kw = dict(padded_vocab_size=VOCAB, seed=7)
    ref_loss, ref_grads = one_step(build_sequential_gpt(model_config("gpt2"), **kw))
    model = build_sequential_gpt(model_config("gpt2"), **kw)
    cl.compile_layers(model)
    for _ in range(2):
        loss, grads = one_step(model)
        assert torch.equal(loss, ref_loss) and all(torch.equal(g, ref_grads[n]) for n, g in grads.items())
    lines = [line for line in capsys.readouterr().err.splitlines() if line]
    assert lines == ["WARNING: torch.compile of transformer layer 1 failed (InternalTorchDynamoError: dynamo "
                     "exploded); the transformer layers run eagerly from now on"]
    cfg = model_config("gpt2", compile_layers=True)
    assert cl.describe_compiled_layers(cfg) == ("eager (torch.compile unavailable: layer 1: InternalTorchDynamoError: "
                                                "dynamo exploded)")
    assert fusions.compile_unavailable() is None  # the fusions' group is another


def test_compile_layers_finds_the_layers_of_every_builder():
    """One place applies it (training.engine.build_module) to whatever the builder made: a pipeline
    stage, the interleaved schedule's chunks, BERT's and T5's layers (subclasses); the state dict
    keeps its names, and a second call changes nothing."""
    from megatron_ds.families.gpt.gpt_model import build_interleaved_gpt

    cfg = model_config("gpt2", num_layers=4)
    stage = build_stage_gpt(cfg, num_stages=2, stage=1, padded_vocab_size=VOCAB, seed=7)
    keys = list(stage.state_dict())
    assert cl.compile_layers(stage) == 2 and cl.compile_layers(stage) == 2 and list(stage.state_dict()) == keys
    chunks = build_interleaved_gpt(cfg, pp=2, pp_rank=0, v=2, padded_vocab_size=VOCAB, tp_group=None, seed=7)
    assert cl.compile_layers(chunks) == 2


def _cli_compiled(rank, world_size, argvs):
    # aot_eager: dynamo and AOTAutograd as with inductor, without its C++ (minutes on two cores)
    torch.compile = functools.partial(torch.compile, backend="aot_eager")
    from tests.training.cli import cli_many

    return cli_many(rank, world_size, argvs)


@pytest.mark.slow
def test_pipeline_interleaved_full_recompute_with_compiled_layers():
    """pretrain_gpt.py, 2 ranks, PP 2 with the interleaved schedule (2 chunks per rank) and full
    recompute: --compile-layers prints eager's losses and says so on its kernels line."""
    from tests.training.cli import SMALL_GPT, iterations

    base = [a for a in SMALL_GPT] + ("--num-layers 4 --train-iters 2 --pipeline-model-parallel-size 2 "
                                     "--num-layers-per-virtual-pipeline-stage 1 --global-batch-size 8 "
                                     "--recompute-granularity full --recompute-method uniform "
                                     "--attention-dropout 0 --hidden-dropout 0").split()
    outputs = []
    for argv in (base, base + ["--compile-layers"]):  # fresh processes for each run
        ranks = run_distributed(_cli_compiled, 2, [argv], timeout=600)
        assert all(rc == 0 for rank in ranks for rc, _, _ in rank), [err[-2000:] for rank in ranks for *_, err in rank]
        # rank 0 prints the start-up lines, the last rank the iteration lines (as Megatron)
        outputs.append(ranks[0][0][1] + ranks[1][0][1])
    eager, compiled = (iterations(out) for out in outputs)
    assert [it for it, _ in compiled] == [1, 2]
    assert [float(x) for _, x in compiled] == pytest.approx([float(x) for _, x in eager], rel=1e-5)
    assert "transformer layers: each compiled with torch.compile (--no-compile-layers: eager)" in outputs[1]
    assert "transformer layers: eager" in outputs[0]


# Context parallelism: the ring attention runs eagerly inside the compiled layer (torch.compiler.disable on its
# core): the break propagates through layer -> attention -> _attend -> _core, as attention dropout's does;
# five graphs, shared by the layers.
CP2_GRAPHS_AND_BREAKS = (5, 4)


def _cp2_compiled_vs_eager(rank, world_size):
    import torch.distributed as dist

    from megatron_ds.parallel.context_parallel import ContextParallel

    kw = dict(padded_vocab_size=VOCAB, seed=7, cp=ContextParallel(dist.group.WORLD, "p2p"))
    ref_loss, ref_grads = one_step(build_sequential_gpt(model_config("llama"), **kw))
    model = build_sequential_gpt(model_config("llama"), **kw)
    counted = graphs_and_breaks(model, steps=1)  # dynamo with the eager backend: eager's numbers
    loss, grads = one_step(model)
    torch.testing.assert_close(loss, ref_loss, **TOL)
    for n, g in grads.items():
        torch.testing.assert_close(g, ref_grads[n], **TOL, msg=lambda m: f"rank {rank} grad {n}: {m}")
    return counted


def test_cp2_compiled_layers_run_the_ring_eagerly():
    """--compile-layers with --context-parallel-size 2 (gloo): each layer compiles around the ring attention,
    which runs eagerly (a fixed count of graphs and breaks, the same on both CP ranks), and a step through the
    traced layers gives eager's loss and gradients."""
    assert run_distributed(_cp2_compiled_vs_eager, 2, timeout=600) == [CP2_GRAPHS_AND_BREAKS] * 2
