#!/usr/bin/env python
"""Kernel budget of one transformer layer: the kernels that are not matmuls or attention, and the
bytes they move, per token, forward + backward, as an H100 would run the layer. No GPU needed.

The layer (bf16, seq 2048, hidden 2048, micro batch 1, the 1.3B shapes of bench/gpu_mfu.py and
scripts/abci) runs on fake CUDA tensors (megatron_ds.fake_cuda) under a TorchDispatchMode that sees
every ATen op below autograd, forward and backward, and records each op that launches a kernel
with the bytes it reads and writes. What a CPU-only torch would do differently from a GPU is put
back first (``gpu_like()``):

- ops with a CUDA kernel and a composite fallback (``_fused_rms_norm``, ``silu_backward``) would
  decompose into several ops: placeholder CUDA kernels are registered for them (never called: the
  fake mode answers first), so autograd takes their one-op path as on a GPU;
- SDPA would take its math path: it is sent to the flash kernel, as an H100 runs it;
- ``torch.compile`` cannot compile for fake CUDA (no Triton): each compiled fusion is traced by
  AOTAutograd and split by inductor's own partitioner (min-cut rematerialisation, which chooses
  what the backward recomputes and what the forward saves); its forward graph counts as one kernel
  reading its inputs and writing its outputs (saved tensors included), its backward graph likewise,
  and a graph with random ops (dropout) one more, inductor's draw of their seeds.

Counting rules: views and metadata ops (outputs that alias an input, allocations, device and size
queries) launch nothing; matmuls (mm, addmm, bmm...) and attention kernels are left out (they are
what the step is for); every other ATen op is one kernel, except ``select_backward`` and
``slice_backward``, which have no kernel of their own and run on a GPU as a zero fill of the whole
input plus a copy into it (two kernels). Bytes read: each distinct tensor input's elements (a
broadcast, stride-0 dimension counted once; an in-place op's target read unless the op only
writes it, such as ``fill_`` or ``copy_``); bytes written: each output not an input. One ATen op
is one launch, which undercounts a few (layer norm's backward launches two on CUDA).

    python bench/kernel_budget.py            # the table: GPT, GPT dropout 0.1, Llama-style; fusions on/off
    python bench/kernel_budget.py --seq-length 4096 --micro-batch-size 2
"""
from __future__ import annotations

from megatron_ds import fake_cuda  # isort: skip

UNAVAILABLE = fake_cuda.preload()  # before torch: the shim registers CUDA hooks torch reads once

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import sys  # noqa: E402
from unittest import mock  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch._functorch.aot_autograd import aot_function  # noqa: E402
from torch._functorch.partitioners import min_cut_rematerialization_partition  # noqa: E402
from torch._inductor.decomposition import select_decomp_table  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

from megatron_ds.config import parse_args  # noqa: E402
from megatron_ds.config.layout import resolve_model_config  # noqa: E402
from megatron_ds.model import fusions  # noqa: E402
from megatron_ds.model.rotary import clear_rotary_tables  # noqa: E402
from megatron_ds.model.transformer import ParallelTransformerLayer  # noqa: E402
from megatron_ds.parallel.random import set_parallel_seeds  # noqa: E402

aten = torch.ops.aten

# H100 SXM 80 GB, NVIDIA's datasheet: HBM3 3.35 TB/s, 989 TFLOP/s dense bf16 (tensor cores, without
# sparsity). A small kernel costs at least its launch: NVIDIA's "Getting Started with CUDA Graphs"
# measured 3.8 us per short kernel launched back to back on one stream; 4 us is taken.
H100_BYTES_PER_S = 3.35e12
H100_BF16_FLOPS = 989e12
LAUNCH_S = 4e-6

MATMULS = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "_scaled_mm", "_addmm_activation"}
ATTENTION_PREFIXES = ("_scaled_dot_product_", "_flash_attention", "_efficient_attention", "_cudnn_attention")
NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "detach",
             "alias", "_unsafe_view", "set_", "resize_", "_local_scalar_dense", "is_same_size", "_fused_sdp_choice"}
WRITE_ONLY = {"fill_", "zero_", "copy_", "bernoulli_", "uniform_", "normal_", "random_", "exponential_"}
ZERO_FILL_AND_COPY = {"select_backward", "slice_backward"}
# ATen ops the layers call that have a CUDA kernel, which a CPU-only build lacks and so runs their
# CompositeImplicitAutograd decomposition instead (found with torch._C._dispatch_has_kernel_for_
# dispatch_key: a composite kernel next to a CPU one, or next to a generated autograd formula only).
CUDA_KERNELS_MISSING = ("_fused_rms_norm", "silu_backward")


@dataclasses.dataclass(frozen=True)
class Kernel:
    name: str
    read: int  # bytes
    written: int
    backward: bool = False


def op_name(func) -> str:
    return func.__name__.split(".")[0]


def kind(func) -> str:
    """"matmul", "attention", "none" (views, allocations, queries) or "kernel"."""
    name = op_name(func)
    if name in MATMULS:
        return "matmul"
    if name.startswith(ATTENTION_PREFIXES):
        return "attention"
    returns = func._schema.returns
    if func.is_view or name in NO_KERNEL or func.namespace == "prim" or not returns:
        return "none"
    return "kernel"


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of the distinct elements ``t`` addresses (a stride-0, broadcast dimension once)."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        n *= size if stride != 0 else 1
    return n * t.element_size()


def _distinct(tensors) -> list[torch.Tensor]:
    seen, out = set(), []
    for t in tensors:
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def op_kernels(func, args, kwargs, out) -> list[tuple[str, int, int]]:
    """(name, bytes read, bytes written) of the kernels one ATen op launches on a GPU."""
    name = op_name(func)
    if name in ZERO_FILL_AND_COPY:  # zeros(input size), then the gradient copied into its part
        grad = tensor_bytes(args[0])
        return [(f"{name}:fill", 0, tensor_bytes(out)), (f"{name}:copy", grad, grad)]
    mutated = {id(arg) for arg, spec in zip(args, func._schema.arguments)
               if spec.alias_info is not None and spec.alias_info.is_write}
    only_written = mutated if name in WRITE_ONLY else set()
    read = sum(tensor_bytes(t) for t in _distinct(tree_leaves((args, kwargs))) if id(t) not in only_written)
    return [(name, read, sum(tensor_bytes(t) for t in _distinct(tree_leaves(out))))]


def graph_kernels(name: str, graph, inputs, outputs) -> list[tuple[str, int, int]]:
    """A compiled graph as inductor runs it: one kernel reading its inputs and writing its new
    outputs once (none when every output is an input: a gradient passed through unchanged), after
    one that draws the seeds of the graph's random ops (inductor's ``inductor_seeds``: an 8-byte
    randint per random op)."""
    inputs = _distinct(inputs)
    given = {id(t) for t in inputs}
    new = [t for t in _distinct(tree_leaves(outputs)) if id(t) not in given]
    random_ops = sum(1 for node in graph.graph.nodes
                     if torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ()))
    kernels = [(f"{name}:seeds", 0, 8 * random_ops)] if random_ops else []
    if new:
        kernels.append((name, sum(tensor_bytes(t) for t in inputs), sum(tensor_bytes(t) for t in new)))
    return kernels


def op_flops(func, args) -> float:
    """FLOPs of a matmul or flash-attention op (the share of the step the budget is measured against)."""
    name = op_name(func)
    if name in ("mm", "addmm"):
        a, b = args[-2], args[-1]
        return 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
    if name in ("bmm", "baddbmm"):
        a, b = args[-2], args[-1]
        return 2.0 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]
    if name.startswith("_scaled_dot_product_flash_attention"):
        backward = name.endswith("_backward")
        q, k = args[1:3] if backward else args[:2]
        causal = args[11] if backward else (args[4] if len(args) > 4 else False)
        # QK^T and PV: 4 b h s_q s_k d, half of it under a causal mask; backward recomputes QK^T and
        # does four more products (dV, dP, dQ, dK): 2.5x the forward
        fwd = 4.0 * q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] * q.shape[3] * (0.5 if causal else 1.0)
        return 2.5 * fwd if backward else fwd
    return 0.0


class KernelCounter(TorchDispatchMode):
    """Records, while ``counting``, the kernels of the ATen ops below autograd and the FLOPs of the
    matmuls and attention."""

    def __init__(self):
        super().__init__()
        self.counting = False
        self.kernels: list[Kernel] = []
        self.flops = 0.0
        self._suspended = 0

    @contextlib.contextmanager
    def suspended(self):
        """Inside a compiled graph: its ops are the graph's one kernel, not kernels of their own."""
        self._suspended += 1
        try:
            yield
        finally:
            self._suspended -= 1

    def record(self, kernels: list[tuple[str, int, int]]) -> None:
        if self.counting:
            backward = torch._C._current_autograd_node() is not None  # inside a backward function
            self.kernels.extend(Kernel(*k, backward=backward) for k in kernels)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.counting and not self._suspended:
            what = kind(func)
            if what == "kernel":
                self.record(op_kernels(func, args, kwargs, out))
            elif what in ("matmul", "attention"):
                self.flops += op_flops(func, args)
        return out


class FlashAttention(TorchFunctionMode):
    """SDPA without a mask goes to the flash kernel, as on an H100 (a CPU-only torch has no CUDA
    backend choice and would take the math path: softmax, casts and batched matmuls)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is F.scaled_dot_product_attention and kwargs.get("attn_mask") is None and len(args) == 3:
            # the flash kernel takes fewer key/value heads (GQA) as they are, so enable_gqa goes
            out = aten._scaled_dot_product_flash_attention.default(
                *args, kwargs.get("dropout_p", 0.0), kwargs.get("is_causal", False), False, scale=kwargs.get("scale"))
            return out[0]
        return func(*args, **kwargs)


TENSOR = object()  # AsGraphs: where a tensor argument goes


class AsGraphs:
    """What ``torch.compile(fn)`` becomes in the bench: AOTAutograd's forward and backward graphs,
    split by inductor's partitioner, each run as one counted kernel."""

    def __init__(self, fn, counter: KernelCounter):
        self.fn, self.counter, self.name = fn, counter, fn.__name__.lstrip("_")
        self._graphs = {}

    def __call__(self, *args):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        constants = tuple(TENSOR if isinstance(a, torch.Tensor) else a for a in args)
        key = (constants, *((t.shape, t.stride(), t.dtype, t.requires_grad) for t in tensors))  # as dynamo guards
        if key not in self._graphs:
            self._graphs[key] = aot_function(
                functools.partial(self._with_constants, constants), fw_compiler=self._compiler("fwd"),
                bw_compiler=self._compiler("bwd"), partition_fn=min_cut_rematerialization_partition,
                decompositions=select_decomp_table())
        with self.counter.suspended():  # tracing and the forward's ops are not the model's kernels
            out = self._graphs[key](*tensors)
        return tuple(out) if isinstance(out, list) else out  # as the function returns it

    def _with_constants(self, constants, *tensors):
        it = iter(tensors)
        return self.fn(*(next(it) if c is TENSOR else c for c in constants))

    def _compiler(self, part: str):
        def compiler(graph, example_inputs):
            def run(args):
                inputs = list(args)
                with self.counter.suspended():
                    outputs = graph(*inputs)
                self.counter.record(graph_kernels(f"{self.name} {part}", graph, inputs, outputs))
                return outputs
            run._boxed_call = True
            return run
        return compiler


@contextlib.contextmanager
def gpu_like():
    """Fake CUDA as an H100 would run the layer (see the module doc); yields the counter."""
    if UNAVAILABLE is not None:
        raise RuntimeError(UNAVAILABLE)
    counter = KernelCounter()
    lib = torch.library.Library("aten", "IMPL")
    for op in CUDA_KERNELS_MISSING:
        lib.impl(op, _placeholder, "CUDA")
    saved = [(f, f._compiled, f._proven) for f in fusions.FUSED_FUNCTIONS]
    for f in fusions.FUSED_FUNCTIONS:
        f._compiled, f._proven = None, set()
    clear_rotary_tables()
    try:
        with mock.patch.object(torch, "compile", lambda fn, **_: AsGraphs(fn, counter)), \
                fake_cuda.activate(), FlashAttention(), counter:
            yield counter
    finally:
        lib._destroy()
        for f, compiled, proven in saved:
            f._compiled, f._proven = compiled, proven
        clear_rotary_tables()  # its tables were fake tensors


def _placeholder(*args, **kwargs):
    raise RuntimeError("a placeholder CUDA kernel ran: only fake tensors may reach it")


SHAPE = "--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --bf16"
NO_DROPOUT = "--hidden-dropout 0 --attention-dropout 0"
CONFIGS = {  # name: flags (bench/gpu_mfu.py's 1.3B shapes; Llama-style with 4 key/value heads, as 7B's 32/8)
    "GPT": f"{SHAPE} {NO_DROPOUT}",
    "GPT dropout 0.1": f"{SHAPE} --hidden-dropout 0.1 --attention-dropout 0.1",
    "Llama-style": f"{SHAPE} {NO_DROPOUT} --use-rotary-position-embeddings --swiglu --normalization rmsnorm "
                   "--disable-bias-linear --ffn-hidden-size 5504 --num-key-value-heads 4",
}
FUSIONS_OFF = "--no-bias-gelu-fusion --no-bias-swiglu-fusion --no-bias-dropout-fusion --no-rope-fusion"


@dataclasses.dataclass(frozen=True)
class Budget:
    """The counted kernels of one layer's forward + backward, over ``tokens`` tokens."""
    kernels: list[Kernel]
    tokens: int
    flops: float  # matmuls and attention

    def count(self, backward: bool | None = None) -> int:
        return sum(1 for k in self.kernels if backward is None or k.backward == backward)

    def kb_per_token(self, backward: bool | None = None) -> float:
        moved = sum(k.read + k.written for k in self.kernels if backward is None or k.backward == backward)
        return moved / self.tokens / 1e3

    def share(self) -> float:
        """Roofline estimate of the counted kernels' share of the layer's H100 time: each moves its
        bytes at the HBM bandwidth but takes at least a launch; the matmuls and attention run at
        the dense bf16 peak (so the share is an upper bound for a real, slower matmul)."""
        rest = sum(max((k.read + k.written) / H100_BYTES_PER_S, LAUNCH_S) for k in self.kernels)
        return rest / (rest + self.flops / H100_BF16_FLOPS)


def measure(model: torch.nn.Module, inputs: torch.Tensor, counter: KernelCounter) -> Budget:
    """Forward + backward of ``model`` once to warm up (the fusions trace their graphs), then once
    counted. Gradients are dropped in between, so the counted backward writes fresh ones, as the
    first micro-batch of a step does."""
    grad = torch.randn_like(inputs)
    for counting in (False, True):
        model.zero_grad(set_to_none=True)
        x = inputs.detach().requires_grad_()
        counter.counting = counting
        model(x).backward(grad)
        counter.counting = False
    return Budget(list(counter.kernels), inputs.shape[0] * inputs.shape[1], counter.flops)


def layer_budget(flags: str, fused: bool, seq: int, micro_batch: int) -> Budget:
    """The budget of one transformer layer built from these command-line flags."""
    argv = f"{flags} --seq-length {seq} --max-position-embeddings {seq} --micro-batch-size {micro_batch}".split()
    cfg, _ = parse_args(argv + ([] if fused else FUSIONS_OFF.split()))
    m = resolve_model_config(cfg.model)
    set_parallel_seeds(1234, 0)
    with gpu_like() as counter:
        layer = ParallelTransformerLayer(m, 1, params_dtype=torch.bfloat16, device="cuda")
        x = torch.randn(seq, micro_batch, m.hidden_size, device="cuda", dtype=torch.bfloat16)
        budget = measure(layer, x, counter)
    # The fake mode, the traced graphs and the layer hold reference cycles. Freed here, not by the
    # collection at interpreter exit: that one races the autograd engine's CUDA device thread, which
    # then dies taking the GIL of a finalizing interpreter and aborts the process.
    gc.collect()
    if fused and not any(" fwd" in k.name for k in budget.kernels):
        raise RuntimeError(f"the fusions did not run as graphs: {fusions.compile_unavailable()}")
    return budget


def table_rows(budgets: dict[tuple[str, bool], Budget]) -> list[str]:
    rows = ["| layer | fusions | kernels (fwd + bwd) | KB/token (fwd + bwd) | est. non-matmul share of H100 time |",
            "|---|---|---:|---:|---:|"]
    for (name, fused), b in budgets.items():
        rows.append(f"| {name} | {'on' if fused else 'off'} | {b.count()} ({b.count(False)} + {b.count(True)}) | "
                    f"{b.kb_per_token():.0f} ({b.kb_per_token(False):.0f} + {b.kb_per_token(True):.0f}) | "
                    f"{100 * b.share():.1f}% |")
    return rows


def kernel_list(b: Budget) -> list[str]:
    return [f"  {'bwd' if k.backward else 'fwd'} {k.name:32s} read {k.read / b.tokens:7.0f} B/token, "
            f"written {k.written / b.tokens:7.0f}" for k in b.kernels]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--list", action="store_true", help="print every counted kernel")
    args = parser.parse_args(argv)
    budgets = {}
    for name in args.configs:
        for fused in (True, False):
            budgets[name, fused] = b = layer_budget(CONFIGS[name], fused, args.seq_length, args.micro_batch_size)
            if args.list:
                print("\n".join([f"{name}, fusions {'on' if fused else 'off'}:", *kernel_list(b)]))
    print(f"Per transformer layer, forward + backward, bf16, seq {args.seq_length}, micro batch "
          f"{args.micro_batch_size}, hidden 2048, 16 heads; KB = 1000 bytes. Share: H100 at "
          f"{H100_BYTES_PER_S / 1e12:.2f} TB/s, {H100_BF16_FLOPS / 1e12:.0f} TFLOP/s, "
          f"{LAUNCH_S * 1e6:.0f} us a launch.")
    print("\n".join(table_rows(budgets)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
