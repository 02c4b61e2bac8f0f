"""Samplers: Megatron's order, DP slicing, and resuming from consumed samples."""
import itertools

import pytest

from megatron_ds.data.samplers import PretrainingSampler


def reference_pretraining(total, consumed, micro, rank, dp, drop_last):
    """Megatron's MegatronPretrainingSampler loop, spelled out one index at a time."""
    out, batch = [], []
    for idx in range(consumed, total):
        batch.append(idx)
        if len(batch) == micro * dp:
            out.append(batch[rank * micro:(rank + 1) * micro])
            batch = []
    if batch and not drop_last:
        out.append(batch[rank * micro:(rank + 1) * micro])
    return out


@pytest.mark.parametrize("drop_last", [True, False])
def test_pretraining_sampler_matches_reference(drop_last):
    for total, consumed, micro, dp in itertools.product((1, 7, 24, 50), (0, 3, 8), (1, 2, 3), (1, 2, 4)):
        if consumed >= total:
            continue
        for rank in range(dp):
            got = list(PretrainingSampler(total, consumed, micro, rank, dp, drop_last=drop_last))
            expected = [b for b in reference_pretraining(total, consumed, micro, rank, dp, drop_last) if b]
            assert got == expected, (total, consumed, micro, rank, dp)


def test_pretraining_ranks_partition_consecutive_samples():
    micro, dp, total = 2, 3, 60
    per_rank = [list(PretrainingSampler(total, 0, micro, r, dp)) for r in range(dp)]
    for step, batches in enumerate(zip(*per_rank)):
        assert sum(batches, []) == list(range(step * micro * dp, (step + 1) * micro * dp))


def test_pretraining_resume_continues_where_it_stopped():
    micro, dp, total = 4, 2, 200
    full = list(PretrainingSampler(total, 0, micro, 1, dp))
    steps_done = 7  # a checkpoint after 7 micro-batches per rank = 7 * micro * dp samples consumed
    resumed = list(PretrainingSampler(total, steps_done * micro * dp, micro, 1, dp))
    assert resumed == full[steps_done:]


def test_pretraining_errors():
    with pytest.raises(ValueError, match="already consumed"):
        PretrainingSampler(10, 10, 1, 0, 1)
    with pytest.raises(ValueError, match="data_parallel_rank 2"):
        PretrainingSampler(10, 0, 1, 2, 2)
