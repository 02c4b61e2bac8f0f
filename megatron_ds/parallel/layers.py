"""Tensor-parallel layers: ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding.

Activations use Megatron's [seq, batch, hidden] layout; with sequence parallelism the activations
between the tensor-parallel regions are split along dim 0 (the sequence).

Weights start from a *master weight*: the full tensor is created in fp32 on the CPU with
`init_method` (so it depends only on the CPU generator, which every tensor-parallel rank seeds
identically) and each rank keeps its slice. A model therefore starts from the same numbers at any
tensor-parallel size and on any device.

The linear layers compute through ``parallel.weight_grad.linear``, whose weight gradient a
zero-bubble schedule may defer to its weight pass (the same code computes it either way), or, built
with an ``fp8`` recipe, through ``parallel.fp8.fp8_linear`` (FP8 GEMMs; ``layer_matmul`` picks).

Parameter attributes, read by DeepSpeed and by our checkpoint tools:
- `tensor_model_parallel=True`, `partition_dim`, `partition_stride` on parameters split across the
  tensor-parallel ranks. DeepSpeed 0.19 decides how to count a parameter in the gradient norm
  (`runtime/utils.py: is_model_parallel_parameter`, used by clip_grad_norm_, get_weight_norm,
  get_grad_zeros, the fp16/bf16 optimizers and ZeRO 1-3) by `p.tensor_model_parallel` *or*
  `p.model_parallel`: flagged parameters are counted on every tensor-parallel rank (each holds a
  different shard) and the squares are summed over the group; unflagged ones are counted only on
  tensor-parallel rank 0 (they are replicas). Parameters a PipelineModule ties across stages are
  skipped via `ds_pipe_replicated`, which DeepSpeed sets itself. `tensor_model_parallel` alone is
  therefore enough, and it is the name Megatron checkpoints use. (One DeepSpeed caveat: the plain
  fp32 path, `clip_grad_norm_` without ZeRO or fp16/bf16, keys "replica" on rank 0 of the
  tensor x pipeline group rather than of the tensor-parallel group, so with pipeline parallelism it
  leaves out the unflagged parameters of every stage but the first.)
- `sequence_parallel=True` on replicated parameters whose gradients are partial under sequence
  parallelism (each rank saw only its part of the sequence): layer norms, and RowParallelLinear's
  bias. `register_sequence_parallel_grad_hooks` makes them sum over the group inside backward.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_ds.parallel.async_comm import overlap_applies, overlapped_column_linear
from megatron_ds.parallel.fp8 import Fp8, Fp8Recipe, fp8_linear
from megatron_ds.parallel.fp8_delayed import DelayedScaling, drop_fp8_state
from megatron_ds.parallel.mappings import (
    all_gather_along_first_dim,
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_along_first_dim,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
)
from megatron_ds.parallel.utils import divide, tp_rank, tp_world_size, vocab_range
from megatron_ds.parallel.weight_grad import linear, linear_weight_grad

InitMethod = Callable[[torch.Tensor], object]


def init_method_normal(std: float) -> InitMethod:
    """N(0, std) initialization."""

    def init_(tensor):
        return torch.nn.init.normal_(tensor, mean=0.0, std=std)

    return init_


def scaled_init_method_normal(std: float, num_layers: int) -> InitMethod:
    """N(0, std / sqrt(2 * num_layers)): for the output projections that feed the residual stream,
    so its variance does not grow with depth (GPT-2)."""
    return init_method_normal(std / math.sqrt(2.0 * num_layers))


def set_tensor_parallel_attributes(param: torch.Tensor, partition_dim: int, stride: int = 1) -> None:
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    param.partition_stride = stride


def _master_weight_shard(full_shape, partition_dim, stride, init_method, group, params_dtype, device):
    master = torch.empty(full_shape, dtype=torch.float32)
    init_method(master)
    world = tp_world_size(group)
    # With stride s the dim is made of s interleaved blocks (e.g. fused projections); each rank
    # takes its piece of every block.
    piece = divide(full_shape[partition_dim], world * stride)
    chunks = torch.split(master, piece, dim=partition_dim)
    shard = torch.cat(chunks[tp_rank(group)::world], dim=partition_dim)
    return shard.to(dtype=params_dtype, device=device).contiguous()


def fp8_gemms(recipe: Fp8Recipe | None, tp_group, device) -> tuple[Fp8Recipe | None, DelayedScaling | None]:
    """A layer's (recipe, delayed-scaling state): the state, a submodule whose buffers (amax history,
    scales) are checkpointed with the layer, only under ``--fp8-recipe delayed``."""
    return recipe, (DelayedScaling(recipe, tp_group, device) if recipe is not None and recipe.granularity == "delayed" else None)


def layer_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 fp8: Fp8 | None) -> torch.Tensor:
    """The GEMM of a tensor-parallel linear layer on its local operands: FP8 when the layer has a
    recipe, else the (deferrable) ``linear``."""
    return linear(x, weight, bias) if fp8 is None else fp8_linear(x, weight, bias, fp8)


class _SequenceParallelLinear(torch.autograd.Function):
    """y = all_gather_seq(x) @ W^T + b. Keeps only the local sequence shard of x for backward and
    all-gathers it again there, rather than holding the gathered input for the whole step: saving
    activation memory is the reason to use sequence parallelism."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.save_for_backward(x, weight)
        ctx.group = group
        ctx.has_bias = bias is not None
        return F.linear(all_gather_along_first_dim(x, group), weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            # Every rank holds a partial grad of the full sequence: sum them and keep my shard.
            grad_x = reduce_scatter_along_first_dim(grad_out.matmul(weight), ctx.group)
        if ctx.needs_input_grad[1]:
            total = all_gather_along_first_dim(x, ctx.group)
            grad_w = linear_weight_grad(weight, total, grad_out, deferrable=False)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_out.reshape(-1, grad_out.size(-1)).sum(dim=0)
        return grad_x, grad_w, grad_b, None


class _Fp8Linear(torch.nn.Module):
    """A tensor parallel linear layer's FP8: ``fp8`` (the run's recipe, or None) and ``fp8_scaling`` (the
    delayed-scaling state its checkpoints carry, or None), set by the layer from ``fp8_gemms``."""
    fp8: Fp8Recipe | None
    fp8_scaling: DelayedScaling | None

    def _fp8(self) -> Fp8 | None:
        """What the GEMMs take: the delayed-scaling state when there is one, else the recipe (or None)."""
        return self.fp8_scaling if self.fp8_scaling is not None else self.fp8

    def _load_from_state_dict(self, state_dict, prefix, *args):
        if self.fp8_scaling is None:
            drop_fp8_state(state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, *args)


class ColumnParallelLinear(_Fp8Linear):
    """Y = X A^T + b with A split by rows over the tensor-parallel ranks ("columns" of the
    input-to-output map): each rank computes output_size / tp features.

    forward(input[, weight]) -> (output, output_bias); output_bias is the bias when
    `skip_bias_add` (for the caller to fuse into a later op), else None. `weight` overrides the
    layer's own weight, for output layers tied to the word embedding (create those with
    `skip_weight_param_allocation=True`).
    """

    def __init__(self, input_size: int, output_size: int, *, tp_group, bias: bool = True,
                 gather_output: bool = True, init_method: InitMethod = torch.nn.init.xavier_normal_,
                 skip_bias_add: bool = False, sequence_parallel: bool = False,
                 params_dtype: torch.dtype = torch.float32, device=None, stride: int = 1,
                 skip_weight_param_allocation: bool = False, async_grad_comm: bool = False,
                 fp8: Fp8Recipe | None = None):
        """``async_grad_comm``: at TP > 1 the input gradient's all-reduce (reduce-scatter under
        sequence parallelism) runs during the weight-gradient GEMM (``parallel.async_comm``);
        False (the default): after it. ``fp8``: the GEMMs in FP8
        (``parallel.fp8``)."""
        super().__init__()
        self.async_grad_comm = bool(async_grad_comm)  # None (neither flag): off
        self.fp8, self.fp8_scaling = fp8_gemms(fp8, tp_group, device)
        if gather_output and sequence_parallel:
            raise ValueError("ColumnParallelLinear: gather_output=True cannot be combined with "
                             "sequence_parallel=True (the output stays split over the tensor-parallel ranks)")
        self.input_size, self.output_size = input_size, output_size
        self.tp_group = tp_group
        self.gather_output = gather_output
        self.skip_bias_add = skip_bias_add
        self.sequence_parallel = sequence_parallel
        self.output_size_per_partition = divide(output_size, tp_world_size(tp_group))

        if skip_weight_param_allocation:
            self.register_parameter("weight", None)
        else:
            self.weight = torch.nn.Parameter(_master_weight_shard(
                (output_size, input_size), 0, stride, init_method, tp_group, params_dtype, device))
            set_tensor_parallel_attributes(self.weight, partition_dim=0, stride=stride)
        if bias:
            self.bias = torch.nn.Parameter(
                torch.zeros(self.output_size_per_partition, dtype=params_dtype, device=device))
            set_tensor_parallel_attributes(self.bias, partition_dim=0, stride=stride)
        else:
            self.register_parameter("bias", None)

    def forward(self, input_: torch.Tensor, weight: torch.Tensor | None = None, skip_bias_add: bool | None = None):
        """``skip_bias_add`` overrides the layer's setting for this call (a caller that fuses the
        bias only on some devices)."""
        skip_bias_add = self.skip_bias_add if skip_bias_add is None else skip_bias_add
        if weight is None:
            if self.weight is None:
                raise ValueError("ColumnParallelLinear was built with skip_weight_param_allocation=True: "
                                 "pass the (tied) weight to forward()")
            weight = self.weight
        elif weight.shape != (self.output_size_per_partition, self.input_size):
            raise ValueError(f"ColumnParallelLinear: weight passed to forward has shape {tuple(weight.shape)}, "
                             f"expected {(self.output_size_per_partition, self.input_size)}")

        bias = None if skip_bias_add else self.bias
        parallel = tp_world_size(self.tp_group) > 1
        if parallel and self.async_grad_comm and overlap_applies(input_, weight):
            output = overlapped_column_linear(input_, weight, bias, self.tp_group,
                                              sequence_parallel=self.sequence_parallel, fp8=self._fp8())
        elif self.sequence_parallel and parallel and self.fp8 is not None:
            # (synchronous, e.g. --no-async-tensor-model-parallel-allreduce) the gathered sequence is
            # kept for backward here, where _SequenceParallelLinear, whose GEMMs are bf16, re-gathers it
            output = layer_matmul(gather_from_sequence_parallel_region(input_, self.tp_group), weight, bias, self._fp8())
        elif self.sequence_parallel and parallel:
            output = _SequenceParallelLinear.apply(input_, weight, bias, self.tp_group)
        else:
            output = layer_matmul(copy_to_tensor_parallel_region(input_, self.tp_group), weight, bias, self._fp8())
        if self.gather_output:
            output = gather_from_tensor_parallel_region(output, self.tp_group)
        return output, (self.bias if skip_bias_add else None)


class RowParallelLinear(_Fp8Linear):
    """Y = X A^T + b with A split by columns (the input features) over the tensor-parallel ranks:
    each rank multiplies its slice of X and the partial outputs are summed (all-reduce, or a
    reduce-scatter along the sequence under sequence parallelism). The bias is replicated and
    added once, after the reduction.

    forward(input) -> (output, output_bias), as ColumnParallelLinear.
    """

    def __init__(self, input_size: int, output_size: int, *, tp_group, bias: bool = True,
                 input_is_parallel: bool = False, init_method: InitMethod = torch.nn.init.xavier_normal_,
                 skip_bias_add: bool = False, sequence_parallel: bool = False,
                 params_dtype: torch.dtype = torch.float32, device=None, stride: int = 1,
                 fp8: Fp8Recipe | None = None):
        super().__init__()
        self.fp8, self.fp8_scaling = fp8_gemms(fp8, tp_group, device)  # FP8 GEMMs (parallel/fp8.py) when set
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel=True needs input_is_parallel=True "
                             "(its input comes from a ColumnParallelLinear)")
        self.input_size, self.output_size = input_size, output_size
        self.tp_group = tp_group
        self.input_is_parallel = input_is_parallel
        self.skip_bias_add = skip_bias_add
        self.sequence_parallel = sequence_parallel
        self.input_size_per_partition = divide(input_size, tp_world_size(tp_group))

        self.weight = torch.nn.Parameter(_master_weight_shard(
            (output_size, input_size), 1, stride, init_method, tp_group, params_dtype, device))
        set_tensor_parallel_attributes(self.weight, partition_dim=1, stride=stride)
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(output_size, dtype=params_dtype, device=device))
            # Added to a sequence shard, so each rank's bias grad covers only its tokens.
            self.bias.sequence_parallel = sequence_parallel
        else:
            self.register_parameter("bias", None)

    def forward(self, input_: torch.Tensor, skip_bias_add: bool | None = None):
        """``skip_bias_add``: as ColumnParallelLinear.forward."""
        if not self.input_is_parallel:
            input_ = scatter_to_tensor_parallel_region(input_, self.tp_group)
        partial = layer_matmul(input_, self.weight, None, self._fp8())
        if self.sequence_parallel:
            output = reduce_scatter_to_sequence_parallel_region(partial, self.tp_group)
        else:
            output = reduce_from_tensor_parallel_region(partial, self.tp_group)
        if self.skip_bias_add if skip_bias_add is None else skip_bias_add:
            return output, self.bias
        return (output + self.bias if self.bias is not None else output), None


class VocabParallelEmbedding(torch.nn.Module):
    """Embedding table split by rows (vocabulary ids) over the tensor-parallel ranks. Each rank
    looks up the ids it owns, writes zeros for the others, and an all-reduce assembles the rows."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp_group,
                 init_method: InitMethod = torch.nn.init.xavier_normal_,
                 params_dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        world = tp_world_size(tp_group)
        if num_embeddings % world != 0:
            raise ValueError(f"VocabParallelEmbedding: vocabulary size {num_embeddings} is not divisible by "
                             f"the tensor-parallel size {world}; pad it with pad_vocab_size() "
                             f"(--make-vocab-size-divisible-by)")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.tp_group = tp_group
        self.vocab_start_index, self.vocab_end_index = vocab_range(num_embeddings, tp_rank(tp_group), world)
        self.num_embeddings_per_partition = self.vocab_end_index - self.vocab_start_index
        self.weight = torch.nn.Parameter(_master_weight_shard(
            (num_embeddings, embedding_dim), 0, 1, init_method, tp_group, params_dtype, device))
        set_tensor_parallel_attributes(self.weight, partition_dim=0, stride=1)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if tp_world_size(self.tp_group) == 1:
            return F.embedding(input_ids, self.weight)
        not_mine = (input_ids < self.vocab_start_index) | (input_ids >= self.vocab_end_index)
        local_ids = (input_ids - self.vocab_start_index).masked_fill(not_mine, 0)
        output = F.embedding(local_ids, self.weight).masked_fill(not_mine.unsqueeze(-1), 0.0)
        return reduce_from_tensor_parallel_region(output, self.tp_group)


def register_sequence_parallel_grad_hooks(module: torch.nn.Module, tp_group) -> int:
    """Make every parameter marked ``sequence_parallel`` all-reduce its gradient over the tensor
    parallel group as it is produced, inside backward.

    The hook sees each micro-batch's gradient before it is accumulated into ``.grad``, so it works
    with any engine: gradient accumulation, DeepSpeed's bf16 optimizer buffers and ZeRO's reduction
    hooks (which run after accumulation) all see the already-summed value. Returns the number of
    parameters hooked."""
    if tp_world_size(tp_group) == 1:
        return 0

    def summed(grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=tp_group)
        return grad

    count = 0
    for param in module.parameters():
        if getattr(param, "sequence_parallel", False) and param.requires_grad:
            param.register_hook(summed)
            count += 1
    return count
