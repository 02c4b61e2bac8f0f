"""Fused elementwise work of the transformer layer, compiled with ``torch.compile``.

Megatron-LM fuses the same pieces the same way: ``megatron/core/jit.py`` sets ``jit_fuser =
torch.compile`` on torch >= 2.2 and decorates ``bias_gelu`` (fusions/fused_bias_gelu.py),
``bias_swiglu`` (fused_bias_swiglu.py) and ``bias_dropout_add`` (fused_bias_dropout.py), switched
off by ``--no-bias-gelu-fusion``, ``--no-bias-swiglu-fusion``, ``--no-bias-dropout-fusion`` and
``--no-rope-fusion`` (dest ``apply_rope_fusion``). A GPU profile of this model showed copies and
unfused elementwise kernels (bias adds, residual adds, RoPE's ``cat`` and products, SwiGLU's
product) at 27% / 41% of kernel time for GPT-2 / Llama style; each function below becomes one kernel
forward and one backward (``bench/kernel_budget.py`` counts what a layer launches besides them).

The math is the unfused path's, operation for operation (exact GeLU with ``erf``, not Megatron's
tanh approximation), so the eager version of each function computes the same numbers as the layer
without fusion, and the compiled one does too up to how inductor rounds in half precision.

Dropout is drawn inside ``bias_dropout_add``, from whichever generator is current, so the
streams keep their meaning (the layer calls it with the default generator for replicated
activations: the same mask on every tensor parallel rank; inside the tensor parallel stream under
sequence parallelism), and activation recompute, which replays both, redraws the same mask. How it
is drawn is inductor's choice per device: on CUDA the keep-mask is computed inside the fused kernel
from inductor's Philox stream (seeded by one draw from the current CUDA generator per call) and
saved for backward as one byte per element; on the CPU inductor keeps ATen's ``bernoulli_``, so the
compiled function draws exactly the mask eager ``F.dropout`` draws (``empty_like(x).bernoulli_(1 -
p).div_(1 - p)``) and CPU runs with and without the fusions agree.

When the compiled functions run: on CUDA, and on the CPU only with ``--fusions-on-cpu`` (inductor
compiles C++ for every function in every process: minutes of start-up for a small CPU run, no
gain); elsewhere the layers take their unfused path, bit for bit as without the flags. Shapes
are dynamic (``dynamic=True``) so KV-cache decoding and varying micro-batch shapes reuse one graph
instead of recompiling per length. When ``torch.compile`` is missing or fails, the eager function
runs instead and one line says so.
"""
from __future__ import annotations

import contextlib
import sys

import torch
import torch.nn.functional as F

from megatron_ds.accelerator import cuda_runtime
from megatron_ds.ds_compat import floats_as_compile_constants
from megatron_ds.model.rotary import apply_rotary
from megatron_ds.parallel.random import get_rng_tracker

MIN_TORCH_FOR_COMPILE = (2, 2)
"""Megatron-LM's threshold too (megatron/core/jit.py: torch.compile from 2.2; nvFuser before)."""


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def compile_unavailable(failures: dict[str, str] | None = None) -> str | None:
    """Why ``torch.compile`` cannot be used in this process, or None when it can. ``failures``: the
    compilations that failed in one group of compiled functions (default: the fusions')."""
    if not hasattr(torch, "compile"):
        return "this torch has no torch.compile"
    if _torch_version() < MIN_TORCH_FOR_COMPILE:
        return f"torch {torch.__version__} < 2.2"
    failures = _FAILED if failures is None else failures
    if failures:
        return "; ".join(f"{name}: {reason}" for name, reason in failures.items())
    return None


def compiling() -> bool:
    """Whether dynamo is tracing the caller right now (inside a compiled region, e.g. a layer compiled
    with --compile-layers): a compiled function called there is traced into the outer graph instead."""
    is_compiling = getattr(torch.compiler, "is_compiling", None)  # torch >= 2.3
    return bool(is_compiling and is_compiling())


_COMPILER_MODULES = ("torch._dynamo", "torch._inductor", "torch._functorch", "torch.fx", "triton")
_FAILED: dict[str, str] = {}  # function name -> why its compilation failed (then all eager from there on)


class CompiledWithFallback:
    """A function with a lazily compiled twin: ``run(*args)`` calls the twin while the group's
    compiler works, else the function itself (the same math). One failed compilation turns the whole
    group eager (``failures()``; ``scope`` names it in the one line that says so): a compiler broken
    for one is broken for the others. The fusions below are one group, the transformer layers of
    --compile-layers another (``model/compile_layers.py``).

    Inductor compiles a graph's backward lazily, at the first backward, where a failure could no
    longer fall back: so the first compiled call of each kind of input (device, dtypes, which need
    gradients) first runs forward and backward once on detached copies, and only a twin that got
    through both is used."""

    scope = "the fusions"
    what = "the fused"

    def __init__(self, fn, name: str, compile_kwargs: dict | None = None, context=contextlib.nullcontext):
        self.fn = fn
        self.name = name
        self.compile_kwargs = compile_kwargs or {}
        self.context = context  # entered around every compiled call (e.g. floats_as_compile_constants)
        self._compiled = None
        self._proven: set[tuple] = set()

    def failures(self) -> dict[str, str]:
        return _FAILED

    def run(self, *args, **kwargs):
        if compiling() or compile_unavailable(self.failures()) is not None:
            return self.fn(*args, **kwargs)
        if self._compiled is None:
            self._compiled = torch.compile(self.fn, **self.compile_kwargs)
        try:
            with self.context():
                self._prove(args, kwargs)
                return self._compiled(*args, **kwargs)
        except Exception as exc:
            # Only the compiler's own failures; anything else (a real error, an out-of-memory,
            # activation recompute's early-stop signal) goes on up.
            if not type(exc).__module__.startswith(_COMPILER_MODULES):
                raise
            reason = compile_failure_reason(exc)
            self.failures()[self.name] = reason
            print(f"WARNING: torch.compile of {self.what} {self.name} failed ({reason}); "
                  f"{self.scope} run eagerly from now on", file=sys.stderr, flush=True)
        return self.fn(*args, **kwargs)

    def _prove(self, args, kwargs) -> None:
        """Forward and backward of the compiled twin on copies of ``args`` (once per kind)."""
        tensors = [t for a in args for t in _tensors_of(a)]
        backward = torch.is_grad_enabled() and any(a.requires_grad for a in tensors)
        key = (backward, *((a.device.type, a.dtype, a.requires_grad) for a in tensors))
        if key in self._proven:
            return
        if backward:  # without one the real call is the probe (its failure is caught)
            copies = [_copy_of(a) for a in args]
            leaves = [t for c in copies for t in _tensors_of(c) if t.requires_grad]
            # identity saved-tensor hooks: the innermost pair wins, so activation checkpointing's
            # hooks (which would count the probe's tensors as the layer's) never see the probe; and
            # the generators (the tracker's streams too) rewound after it, so the probe's dropout
            # draws are not the model's
            gpus = sorted({a.device for a in tensors if a.device.type == "cuda"}, key=str) if cuda_runtime() else []
            with torch.random.fork_rng(devices=gpus), get_rng_tracker().rewound(), \
                    torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                out = self._compiled(*copies, **kwargs)
                outs = [o for o in _tensors_of(out) if o.requires_grad]
                # autograd.grad, not backward: nothing is accumulated into any parameter's .grad
                torch.autograd.grad(outs, leaves, [torch.ones_like(o) for o in outs], allow_unused=True)
        self._proven.add(key)


def _tensors_of(value) -> list:
    """The tensors in an argument or result: itself, or the members of a tuple or list."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []


def _copy_of(value):
    """A detached copy of a tensor (same requires_grad), or of a tuple or list of them."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone().requires_grad_(value.requires_grad)
    if isinstance(value, (tuple, list)):
        return type(value)(_copy_of(v) for v in value)
    return value


class _Fusable(CompiledWithFallback):
    """One of the fused functions below: ``fusable(compiled, *args)`` runs the compiled twin when
    asked and available, otherwise the function itself. Inside a compiled region (a layer compiled
    with --compile-layers) the function itself is traced into that region's graph: no nested
    compilation, and inductor fuses it with the rest of the layer."""

    def __init__(self, fn):
        # dropout's p: one graph per value (floats_as_compile_constants)
        super().__init__(fn, fn.__name__.lstrip("_"), dict(dynamic=True), context=floats_as_compile_constants)

    def __call__(self, compiled: bool, *args):
        return self.run(*args) if compiled else self.fn(*args)


def compile_failure_reason(exc: BaseException) -> str:
    """The cause of a compiler failure in one line. Dynamo wraps the backend's error
    (``BackendCompilerFailed: backend='inductor' raised:`` and then the real one on later lines,
    e.g. no working Triton for a CUDA graph): name the wrapper, then the innermost cause's type and
    its first line, which says what to fix."""
    inner = exc
    while (nxt := getattr(inner, "inner_exception", None) or inner.__cause__) is not None and nxt is not inner:
        inner = nxt
    lines = [line.strip() for line in str(inner).splitlines() if line.strip()]
    if inner is exc:  # no chained cause: the first line that is not just the wrapper's header
        lines = [line for line in lines if not line.endswith("raised:")] or lines
    cause = f"{type(inner).__name__}: {lines[0] if lines else ''}"
    return cause if inner is exc else f"{type(exc).__name__} <- {cause}"[:300]


def _bias_gelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return F.gelu(x + bias)


def _bias_swiglu(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if bias is not None:
        x = x + bias
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def _bias_dropout_add(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, p: float) -> torch.Tensor:
    """``residual + dropout(x + bias, p)``, the keep-mask drawn here as eager ``F.dropout`` draws
    it on the CPU (see the module doc for what inductor makes of it)."""
    if bias is not None:
        x = x + bias
    if p > 0.0:
        x = x * torch.empty_like(x).bernoulli_(1.0 - p).div_(1.0 - p)
    return residual + x


def split_qkv(qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[s, b, groups, heads_per_group + 2, d]`` (the QKV projection's layout, see
    ``ParallelAttention``) -> q ``[s, b, heads, d]``, k and v ``[s, b, groups, d]``.

    One split into views rather than three indexings: the split's backward writes the QKV
    gradient once (a cat of the three parts), where each indexing's backward would zero-fill a
    QKV-sized gradient for its part and autograd would sum the three. q is a view with one head
    per group and a copy under grouped-query attention (its heads are not evenly strided)."""
    s, b, groups, per_group, d = qkv.shape
    q, k, v = qkv.split([per_group - 2, 1, 1], dim=3)
    return q.reshape(s, b, groups * (per_group - 2), d), k.squeeze(3), v.squeeze(3)


def _rope_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """``split_qkv`` with q and k rotated. In one graph the split costs nothing: the kernel reads
    the QKV projection once and writes q, k (and v, so that the backward, fed all three gradients,
    writes the QKV gradient in the same kernel instead of a rotation kernel and a cat)."""
    q, k, v = split_qkv(qkv)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v.clone()


bias_gelu = _Fusable(_bias_gelu)
bias_swiglu = _Fusable(_bias_swiglu)
bias_dropout_add = _Fusable(_bias_dropout_add)
rope_qkv = _Fusable(_rope_qkv)
FUSED_FUNCTIONS = (bias_gelu, bias_swiglu, bias_dropout_add, rope_qkv)


def use_compiled(x: torch.Tensor, on_cpu: bool) -> bool:
    """Whether the compiled functions should run for a tensor on ``x``'s device."""
    return x.device.type == "cuda" or on_cpu


def describe_fusions(model_cfg=None) -> str:
    """For the start-up line: which fusions this model uses and how they run in this process."""
    names = ["bias_gelu", "bias_swiglu", "bias_dropout_add", "rope"]
    if model_cfg is not None:
        m = model_cfg
        wanted = {"bias_gelu": m.bias_gelu_fusion and not m.swiglu and m.add_bias_linear,
                  "bias_swiglu": m.bias_swiglu_fusion and m.swiglu, "bias_dropout_add": m.bias_dropout_fusion,
                  "rope": m.apply_rope_fusion and m.position_embedding_type == "rope" and not m.qk_layernorm}
        names = [name for name in names if wanted[name]]
        if not names:
            return "off"
    why = compile_unavailable()
    if why is not None:
        return f"{'+'.join(names)} eager (torch.compile unavailable: {why})"
    where = "CUDA and CPU (--fusions-on-cpu)" if model_cfg is not None and model_cfg.fusions_on_cpu else \
        "CUDA (unfused on CPU unless --fusions-on-cpu)"
    return f"{'+'.join(names)} with torch.compile on {where}"
