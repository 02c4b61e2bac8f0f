"""Regional compilation: each transformer layer's forward compiled with ``torch.compile``; the default
with CUDA (measured faster on an H200, bench/RESULTS.md), ``--no-compile-layers`` turns it off,
``--compile-layers`` turns it on elsewhere (``config.layout.compiles_layers``).

torchtitan compiles its models this way (``apply_compile``: ``torch.compile`` per TransformerBlock)
rather than the whole model: every layer of one structure shares one compiled graph (dynamo guards
on the module's structure, its parameters are graph inputs), so a 48-layer model compiles about as
fast as a 1-layer one, and the embedding, the loss, the pipeline engine and DeepSpeed's hooks stay
eager around the layers. Applied once, after the model is built (``training.engine.build_module``),
to every ``ParallelTransformerLayer`` in it, whatever builds it (the pipeline engine's stages, the
interleaved schedule's chunks, BERT's and T5's layers, which are subclasses); parameter names and
state dicts do not change (the forward is replaced, not the module wrapped).

Inside a compiled layer the elementwise fusions (``fusions.py``) are traced into the layer's graph
instead of being compiled on their own (no nested compilation); inductor then fuses them with the
rest of the layer anyway.

What breaks a layer's graph (the graphs and breaks per layer are counted by
``tests/model/test_compile_layers.py``):
- nothing, at tensor parallel size 1 without attention dropout: one graph, forward and backward;
- nothing either at tensor parallel size 2 on gloo: dynamo traces the c10d collectives inside the TP
  layers' autograd Functions into the graph (one graph, no break);
- attention dropout > 0: its masks are drawn from the tensor parallel RNG stream (``parallel.random``),
  whose fork sets the generators' states, which dynamo does not trace: attention with dropout runs
  eagerly (``kernels.sdpa_with_dropout``), one break seen through the four nested calls to it,
  6 graphs and 4 breaks per layer; hidden dropout under sequence parallelism forks the same way;
- selective recompute: dynamo traces the checkpointed attention core (one graph, no break);
- DeepSpeed's MoE (its gate reads ``.item()`` and sizes its buffers by it): it runs eagerly between
  the compiled attention half and the residual add (``ParallelTransformerLayer._moe``): 2 graphs, 1
  break per MoE layer.
Full recompute checkpoints the compiled layers from outside (non-reentrant ``torch.utils.checkpoint``
reruns the compiled forward in backward). ZB-H1's deferred weight gradients decide in backward, which
a compiled graph fixes at compile time: eager by default there, refused with --compile-layers (``config.layout``).

Dropout inside a compiled layer draws inductor's random numbers (on CUDA, from its Philox stream
seeded by the current generator), not eager ATen's: the same distribution, not the same masks.

On a compile failure (at the first forward or, through the probe of ``fusions.CompiledWithFallback``,
the first backward) every layer runs eagerly from then on and one line says why.
"""
from __future__ import annotations

from torch import nn

from megatron_ds.model.fusions import CompiledWithFallback, compile_unavailable
from megatron_ds.model.mla import MLASelfAttention
from megatron_ds.model.transformer import ParallelAttention, ParallelTransformerLayer

_FAILED: dict[str, str] = {}  # "layer N" -> why its compilation failed (then every layer eager)


class _CompiledLayerForward(CompiledWithFallback):
    """A layer's bound forward, compiled, with the fusions' fallback to eager."""

    scope = "the transformer layers"
    what = "transformer"

    def failures(self) -> dict[str, str]:
        return _FAILED

    def __call__(self, *args, **kwargs):
        return self.run(*args, **kwargs)


def compile_layers(model: nn.Module, **compile_kwargs) -> int:
    """Compile the forward of every transformer layer of ``model`` in place (the module docstring);
    ``compile_kwargs`` go to ``torch.compile`` (tests: a counting backend). Returns how many."""
    layers = [m for m in model.modules() if isinstance(m, ParallelTransformerLayer)]
    for attention in (m for m in model.modules() if isinstance(m, (ParallelAttention, MLASelfAttention))):
        attention.fill_rotary_tables()
    for layer in layers:
        if not isinstance(layer.forward, _CompiledLayerForward):  # once, whoever calls it again
            layer.forward = _CompiledLayerForward(layer.forward, f"layer {layer.layer_number}", compile_kwargs)
    return len(layers)


def describe_compiled_layers(model_cfg=None) -> str:
    """For the start-up ``kernels:`` line and --dry-run: how the transformer layers run."""
    if model_cfg is None or not model_cfg.compile_layers:
        return "eager (--compile-layers to compile each with torch.compile)"
    why = compile_unavailable(_FAILED)
    if why is not None:
        return f"eager (torch.compile unavailable: {why})"
    return "each compiled with torch.compile (--no-compile-layers: eager)"
