"""Small helpers shared by the tensor-parallel layers, mappings and cross entropy.

A `tp_group` is a torch ProcessGroup, or None for "tensor parallel size 1": no communication at
all, so single-process code and unit tests need no process group.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""--bf16 / --fp16 / neither (the layout's ``precision``) as the torch dtype the model computes in."""


def tp_world_size(group) -> int:
    """Number of ranks in the tensor-parallel group (1 for None)."""
    return 1 if group is None else dist.get_world_size(group=group)


def tp_rank(group) -> int:
    """This process's rank inside the tensor-parallel group (0 for None)."""
    return 0 if group is None else dist.get_rank(group=group)


def divide(numerator: int, denominator: int) -> int:
    """Exact integer division; a shape that does not split evenly is a configuration error."""
    if denominator <= 0 or numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by {denominator}: choose sizes that split evenly "
                         f"over the tensor-parallel ranks")
    return numerator // denominator


def pad_vocab_size(orig_vocab_size: int, make_divisible_by: int, tp_size: int) -> int:
    """Megatron's padded vocabulary: round up to a multiple of `make_divisible_by * tp_size`, so each
    tensor-parallel shard of the embedding is equally sized and GEMM-friendly (e.g. 50257 -> 50304
    for 128 x 1)."""
    if orig_vocab_size <= 0 or make_divisible_by <= 0 or tp_size <= 0:
        raise ValueError(f"pad_vocab_size needs positive sizes, got vocab={orig_vocab_size}, "
                         f"make_divisible_by={make_divisible_by}, tp_size={tp_size}")
    multiple = make_divisible_by * tp_size
    return -(-orig_vocab_size // multiple) * multiple


def vocab_range(global_vocab_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """[first, last) vocabulary ids held by `rank` when the vocabulary is split over `world_size`."""
    per_partition = divide(global_vocab_size, world_size)
    return rank * per_partition, (rank + 1) * per_partition


