"""Tensor parallelism: layers, autograd mappings, vocab-parallel cross entropy (``chunked_cross_entropy``:
without an fp32 copy of half-precision logits), RNG tracker and RNG-restoring activation checkpointing,
and the deferred weight gradients of zero-bubble schedules (``weight_grad``). Process groups live in
``groups.py`` (imported on its own: it pulls in DeepSpeed's topology); the pipeline schedules as pure step
lists in ``schedules.py`` (what ``config`` checks and describes, what ``pipeline.executor`` runs)."""
from megatron_ds.parallel.cross_entropy import masked_token_loss, vocab_parallel_cross_entropy
from megatron_ds.parallel.layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                         init_method_normal,
                                         register_sequence_parallel_grad_hooks, scaled_init_method_normal)
from megatron_ds.parallel.mappings import (copy_to_tensor_parallel_region, gather_from_sequence_parallel_region,
                                           gather_from_tensor_parallel_region, reduce_from_tensor_parallel_region,
                                           reduce_scatter_to_sequence_parallel_region,
                                           scatter_to_sequence_parallel_region, scatter_to_tensor_parallel_region)
from megatron_ds.parallel.random import RNGStatesTracker, checkpoint, get_rng_tracker, set_parallel_seeds
from megatron_ds.parallel.utils import divide, pad_vocab_size, tp_rank, tp_world_size

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "init_method_normal", "register_sequence_parallel_grad_hooks", "scaled_init_method_normal",
    "masked_token_loss", "vocab_parallel_cross_entropy", "copy_to_tensor_parallel_region",
    "gather_from_sequence_parallel_region", "gather_from_tensor_parallel_region",
    "reduce_from_tensor_parallel_region", "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region", "scatter_to_tensor_parallel_region", "RNGStatesTracker", "checkpoint",
    "get_rng_tracker", "set_parallel_seeds", "divide", "pad_vocab_size", "tp_rank", "tp_world_size",
]
