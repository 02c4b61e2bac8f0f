"""--dataloader-type cyclic and --repeated-dataloader against transcriptions of Megatron-DeepSpeed's
megatron/data/data_samplers.py (MegatronPretrainingRandomSampler with data_sharding, its default for
GPT; cyclic_iter of megatron/training.py; DeepSpeed's RepeatingLoader), commit 4efb479; and the
one-line refusal of --train-data-exact-num-epochs data that would run dry (its index arrays are
checked in tests/data/test_gpt_dataset.py)."""
from __future__ import annotations

import itertools

import pytest
import torch

from megatron_ds.config import parse_args
from megatron_ds.data.samplers import CyclicSampler, PretrainingSampler
from megatron_ds.training.data import stage_iterator


class MegatronRandomSampler:
    """MegatronPretrainingRandomSampler.__iter__ with data_sharding=True, transcribed."""

    def __init__(self, total_samples, consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size):
        self.total_samples, self.consumed_samples = total_samples, consumed_samples
        self.micro_batch_size, self.data_parallel_rank = micro_batch_size, data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.last_batch_size = total_samples % self.micro_batch_times_data_parallel_size

    def __iter__(self):
        active_total_samples = self.total_samples - self.last_batch_size
        self.epoch = self.consumed_samples // active_total_samples
        current_epoch_samples = self.consumed_samples % active_total_samples
        assert current_epoch_samples % self.micro_batch_times_data_parallel_size == 0
        bucket_size = (self.total_samples // self.micro_batch_times_data_parallel_size) * self.micro_batch_size
        bucket_offset = current_epoch_samples // self.data_parallel_size
        start_idx = self.data_parallel_rank * bucket_size
        g = torch.Generator()
        g.manual_seed(self.epoch)
        random_idx = torch.randperm(bucket_size, generator=g).tolist()
        idx_range = [start_idx + x for x in random_idx[bucket_offset:]]
        batch = []
        for idx in idx_range:
            batch.append(idx)
            if len(batch) == self.micro_batch_size:
                self.consumed_samples += self.micro_batch_times_data_parallel_size
                yield batch
                batch = []


def cyclic_iter(iterable):  # megatron/training.py
    while True:
        for x in iterable:
            yield x


@pytest.mark.parametrize("total,consumed,micro,dp", itertools.product((8, 13, 24), (0, 4, 8, 24), (1, 2), (1, 2)))
def test_cyclic_order_matches_megatron_over_epochs(total, consumed, micro, dp):
    if consumed % (micro * dp):
        return
    for rank in range(dp):
        ours = CyclicSampler(total, consumed, micro, rank, dp)
        ref = MegatronRandomSampler(total, consumed, micro, rank, dp)
        # three epochs' worth through the same object, as cyclic_iter goes round a DataLoader
        n = 3 * total // (micro * dp)
        assert list(itertools.islice(cyclic_iter(ours), n)) == list(itertools.islice(cyclic_iter(ref), n))


def test_cyclic_ranks_cover_an_epoch_once():
    total, micro, dp = 24, 2, 3
    seen = sorted(i for r in range(dp) for b in CyclicSampler(total, 0, micro, r, dp) for i in b)
    assert seen == list(range(total))


def _iterator(flags, total, consumed=0, repeat=False):
    data = parse_args(flags)[0].data
    kind = CyclicSampler if data.dataloader_type == "cyclic" else PretrainingSampler
    return stage_iterator(range(total), lambda c: torch.utils.data.DataLoader(range(total), batch_sampler=kind(
        total, c, 2, 0, 1)), consumed, reads_data=True, repeat=repeat,
                          endless=data.dataloader_type == "cyclic" or data.repeated_dataloader)


def test_repeated_dataloader_starts_again_where_it_started():
    # RepeatingLoader re-iterates the same DataLoader: the sequential sampler begins at its consumed_samples
    got = [b.tolist() for b in itertools.islice(_iterator(["--repeated-dataloader"], 6, consumed=2), 5)]
    assert got == [[2, 3], [4, 5], [2, 3], [4, 5], [2, 3]]
    assert len(list(_iterator([], 6, consumed=2))) == 2  # without it the training loader ends


def test_cyclic_iterator_goes_to_the_next_epoch():
    got = [b.tolist() for b in itertools.islice(_iterator(["--dataloader-type", "cyclic"], 6), 6)]
    ref = MegatronRandomSampler(6, 0, 2, 0, 1)
    assert got == list(itertools.islice(cyclic_iter(ref), 6))
    assert sorted(sum(got[:3], [])) == sorted(sum(got[3:], [])) == list(range(6)) and got[:3] != got[3:]


def test_exact_epochs_that_run_dry_are_refused_unless_the_loader_restarts():
    from megatron_ds.errors import DataError
    from megatron_ds.training.data import check_train_length

    data = parse_args(["--train-data-exact-num-epochs", "1"])[0].data
    with pytest.raises(DataError, match="gives 6 training samples but the run trains on 8; add --repeated-dataloader"):
        check_train_length(range(6), data, 8)
    check_train_length(range(6), parse_args(["--train-data-exact-num-epochs", "1", "--repeated-dataloader"])[0].data, 8)
    check_train_length(range(8), data, 8)
