"""Batch samplers that hand each data-parallel rank its micro-batches and resume mid-run.

Resuming needs only the number of samples consumed so far (saved in checkpoints): the samplers
are pure functions of (consumed_samples, micro batch size, DP rank/size), so a restarted job,
even with a different number of data-loader workers, continues with exactly the next samples.
"""
from __future__ import annotations

import torch


def _check(total_samples, consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size):
    if total_samples <= 0:
        raise ValueError(f"no samples to draw from (total_samples={total_samples})")
    if micro_batch_size <= 0 or data_parallel_size <= 0:
        raise ValueError(f"micro_batch_size ({micro_batch_size}) and data_parallel_size ({data_parallel_size}) "
                         "must be positive")
    if not 0 <= data_parallel_rank < data_parallel_size:
        raise ValueError(f"data_parallel_rank {data_parallel_rank} must lie in [0, {data_parallel_size})")
    if consumed_samples < 0:
        raise ValueError(f"consumed_samples must be >= 0, got {consumed_samples}")


class PretrainingSampler:
    """Sequential order (the dataset is already shuffled by its shuffle_idx).

    Samples are consumed in global micro-batches of micro_batch_size * data_parallel_size
    consecutive indices; rank r takes the r-th slice of micro_batch_size. Megatron's
    MegatronPretrainingSampler semantics.
    """

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int, data_parallel_rank: int,
                 data_parallel_size: int, drop_last: bool = True):
        _check(total_samples, consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size)
        if consumed_samples >= total_samples:
            raise ValueError(f"all {total_samples} samples are already consumed (consumed_samples={consumed_samples}); "
                             "the dataset needs more samples for this many iterations")
        self.total_samples, self.consumed_samples = int(total_samples), int(consumed_samples)
        self.micro_batch_size, self.drop_last = int(micro_batch_size), drop_last
        self.data_parallel_rank, self.data_parallel_size = int(data_parallel_rank), int(data_parallel_size)
        self.global_micro_batch = self.micro_batch_size * self.data_parallel_size

    def __len__(self) -> int:
        return self.total_samples

    def __iter__(self):
        offset = self.data_parallel_rank * self.micro_batch_size
        start = self.consumed_samples
        while start + self.global_micro_batch <= self.total_samples:
            yield list(range(start + offset, start + offset + self.micro_batch_size))
            start += self.global_micro_batch
        # A partial last global batch: this rank's slice of it, possibly short; never an empty batch
        # (Megatron yields one, which the data loader cannot collate).
        if start < self.total_samples and not self.drop_last:
            first = start + offset
            rest = list(range(first, min(first + self.micro_batch_size, self.total_samples)))
            if rest:
                yield rest


class CyclicSampler:
    """``--dataloader-type cyclic``: Megatron's MegatronPretrainingRandomSampler with its default data
    sharding (megatron/data/data_samplers.py). Each data parallel rank owns a contiguous bucket of
    ``total // (micro * DP) * micro`` samples and walks a permutation of it seeded by the epoch; an
    epoch is the samples left after dropping the last partial global micro-batch. It counts what it
    yields, so iterating it again continues where the last pass stopped (the next epoch at the end)."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int, data_parallel_rank: int,
                 data_parallel_size: int):
        _check(total_samples, consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size)
        self.total_samples, self.consumed_samples = int(total_samples), int(consumed_samples)
        self.micro_batch_size = int(micro_batch_size)
        self.data_parallel_rank, self.data_parallel_size = int(data_parallel_rank), int(data_parallel_size)
        self.global_micro_batch = self.micro_batch_size * self.data_parallel_size
        if self.total_samples < self.global_micro_batch:
            raise ValueError(f"{total_samples} samples do not fill one micro-batch on each of "
                             f"{data_parallel_size} data parallel ranks")

    def __len__(self) -> int:
        return self.total_samples

    def __iter__(self):
        per_epoch = self.total_samples - self.total_samples % self.global_micro_batch
        epoch, into_epoch = divmod(self.consumed_samples, per_epoch)
        if into_epoch % self.global_micro_batch:
            raise ValueError(f"consumed_samples {self.consumed_samples} is not a whole number of global "
                             f"micro-batches ({self.global_micro_batch})")
        bucket = self.total_samples // self.global_micro_batch * self.micro_batch_size
        first = self.data_parallel_rank * bucket
        order = torch.randperm(bucket, generator=torch.Generator().manual_seed(epoch)).tolist()
        mine = order[into_epoch // self.data_parallel_size:]
        for i in range(0, len(mine) - self.micro_batch_size + 1, self.micro_batch_size):
            self.consumed_samples += self.global_micro_batch
            yield [first + j for j in mine[i:i + self.micro_batch_size]]
