"""Masks and position ids against Megatron's per-EOD loops, for every flag combination."""
import itertools

import numpy as np
import pytest
import torch

from megatron_ds.data.batch import get_ltor_masks_and_position_ids, gpt_batch_from_samples

EOD = 7


def reference_masks(data, eod, reset_position_ids, reset_attention_mask, eod_mask_loss):
    """Megatron's get_ltor_masks_and_position_ids: loops over every EOD of every row."""
    b, s = data.shape
    att_b = b if reset_attention_mask else 1
    attention = torch.tril(torch.ones((att_b, s, s))).view(att_b, 1, s, s)
    loss_mask = torch.ones((b, s))
    if eod_mask_loss:
        loss_mask[data == eod] = 0.0
    position_ids = torch.arange(s, dtype=torch.long).unsqueeze(0).repeat(b, 1)
    for row in range(b):
        prev = 0
        for i in [j for j in range(s) if data[row, j] == eod]:
            if reset_attention_mask:
                attention[row, 0, i + 1:, :i + 1] = 0
            if reset_position_ids:
                position_ids[row, i + 1:] -= i + 1 - prev
                prev = i + 1
    return attention < 0.5, loss_mask, position_ids


@pytest.mark.parametrize("flags", list(itertools.product([False, True], repeat=3)))
def test_masks_match_loop_reference(flags):
    gen = torch.Generator().manual_seed(sum(f << i for i, f in enumerate(flags)))
    for _ in range(5):
        data = torch.randint(0, 10, (3, 23), generator=gen)  # EOD (7) about every 10 tokens
        data[0, 0] = EOD  # an EOD at the very start ...
        data[1, -1] = EOD  # ... and at the very end
        data[2, 5:8] = EOD  # and back to back
        got = get_ltor_masks_and_position_ids(data, EOD, *flags)
        expected = reference_masks(data, EOD, *flags)
        for g, e in zip(got, expected):
            assert g.dtype == e.dtype and g.shape == e.shape
            assert torch.equal(g, e)


def test_batch_from_samples_shifts_labels():
    rng = np.random.default_rng(0)
    samples = rng.integers(0, 10, (4, 17))
    batch = gpt_batch_from_samples({"text": torch.from_numpy(samples)}, EOD, reset_position_ids=True,
                                   eod_mask_loss=True)
    assert torch.equal(batch.tokens, torch.from_numpy(samples[:, :-1]))
    assert torch.equal(batch.labels, torch.from_numpy(samples[:, 1:]))
    assert batch.tokens.dtype == torch.long and batch.attention_mask.shape == (1, 1, 16, 16)
    expected = reference_masks(batch.tokens, EOD, True, False, True)
    assert torch.equal(batch.loss_mask, expected[1]) and torch.equal(batch.position_ids, expected[2])
    tokens, labels, loss_mask, attention_mask, position_ids = gpt_batch_from_samples(samples, EOD)
    assert torch.equal(tokens, batch.tokens) and torch.equal(labels, batch.labels)
    # the training path skips the [s, s] mask; loss mask and positions are the reference's still
    lean = gpt_batch_from_samples(samples, EOD, reset_position_ids=True, eod_mask_loss=True,
                                  with_attention_mask=False)
    assert lean.attention_mask is None
    assert torch.equal(lean.loss_mask, expected[1]) and torch.equal(lean.position_ids, expected[2])
    with pytest.raises(ValueError, match="seq_length \\+ 1"):
        gpt_batch_from_samples(np.zeros((2, 1), dtype=np.int64), EOD)


def _owns_its_memory(t: torch.Tensor) -> bool:
    """Dense, not a view: no dimension of size > 1 with stride 0 (which makes several elements one
    memory location: the DataLoader's pin-memory thread refuses such a tensor), contiguous, and the
    tensor's elements are exactly its storage."""
    no_broadcast = all(stride != 0 for size, stride in zip(t.shape, t.stride()) if size > 1)
    return (no_broadcast and t.is_contiguous() and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.numel() * t.element_size())


@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.parametrize("reset_position_ids", [False, True])
@pytest.mark.parametrize("num_workers", [0, 1])
def test_collated_tensors_own_their_memory(batch_size, reset_position_ids, num_workers):
    """Regression: position_ids used to be an expand()ed [b, s] view of one arange row, which
    crashed every CUDA run in the pin-memory thread at the first batch. Checked through the real
    collator and DataLoader (in-process and through a worker); the pinned path is tests/gpu."""
    from megatron_ds.config import DataConfig
    from megatron_ds.training.data import BatchCollator, MockGPTDataset

    cfg = DataConfig(reset_position_ids=reset_position_ids, eod_mask_loss=True)
    collator = BatchCollator(cfg, eod=EOD, vocab_size=16, source="test")
    loader = torch.utils.data.DataLoader(MockGPTDataset(6, 12, 16, seed=1), batch_size=batch_size,
                                         collate_fn=collator, num_workers=num_workers)
    for inputs, labels in loader:
        tensors = [*inputs, *labels]
        assert len(tensors) == 4
        for t in tensors:
            assert _owns_its_memory(t), (tuple(t.shape), t.stride())
        assert len({t.untyped_storage().data_ptr() for t in tensors}) == 4  # no two share storage
