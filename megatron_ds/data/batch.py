"""From token samples to model inputs: tokens/labels, loss mask, attention mask, position ids.

Megatron's semantics. Several documents share a sample, separated by the end-of-document token;
`reset_position_ids` restarts positions after each EOD, `reset_attention_mask` stops tokens
attending across an EOD, `eod_mask_loss` gives the EOD positions no loss. Everything is
vectorised: Megatron loops over every EOD of every row in Python.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch


def get_ltor_masks_and_position_ids(tokens: torch.Tensor, eod_token: int, reset_position_ids: bool,
                                    reset_attention_mask: bool, eod_mask_loss: bool):
    """(attention_mask, loss_mask, position_ids) for left-to-right tokens [b, s].

    attention_mask: bool [b (1 unless reset_attention_mask), 1, s, s], True where attention is
    NOT allowed (Megatron's convention). loss_mask: float [b, s]. position_ids: long [b, s].
    """
    batch, seq = tokens.shape
    device = tokens.device
    positions = torch.arange(seq, dtype=torch.long, device=device)
    is_eod = tokens == eod_token

    loss_mask = torch.ones((batch, seq), dtype=torch.float, device=device)
    if eod_mask_loss:
        loss_mask[is_eod] = 0.0

    # Token j belongs to the document that starts right after the last EOD before j (the EOD
    # itself closes the previous document).
    eod_before = torch.zeros_like(is_eod)
    eod_before[:, 1:] = is_eod[:, :-1]

    if reset_position_ids:
        starts = torch.where(eod_before, positions, torch.zeros_like(positions))
        position_ids = positions - torch.cummax(starts, dim=1).values
    else:
        position_ids = positions.unsqueeze(0).expand(batch, seq)

    causal = torch.ones((seq, seq), dtype=torch.bool, device=device).tril_()
    if reset_attention_mask:
        document = torch.cumsum(eod_before, dim=1)
        allowed = causal & (document[:, :, None] == document[:, None, :])
        attention_mask = ~allowed.unsqueeze(1)
    else:
        attention_mask = ~causal.view(1, 1, seq, seq)
    return attention_mask, loss_mask, position_ids


class GPTBatch(NamedTuple):
    """Megatron's get_batch order, so `tokens, labels, loss_mask, attention_mask, position_ids = b` works."""

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor


def gpt_batch_from_samples(samples, eod_token: int, reset_position_ids: bool = False,
                           reset_attention_mask: bool = False, eod_mask_loss: bool = False,
                           device: torch.device | str | None = None) -> GPTBatch:
    """samples: int [b, s + 1] (numpy, tensor, or a collated {"text": ...}) -> GPTBatch of [b, s] tensors."""
    if isinstance(samples, dict):
        samples = samples["text"]
    if isinstance(samples, np.ndarray):
        samples = torch.from_numpy(np.ascontiguousarray(samples, dtype=np.int64))
    samples = samples.to(device=device, dtype=torch.long)
    if samples.dim() != 2 or samples.shape[1] < 2:
        raise ValueError(f"samples must be [batch, seq_length + 1] with seq_length >= 1, got {tuple(samples.shape)}")
    tokens = samples[:, :-1].contiguous()
    labels = samples[:, 1:].contiguous()
    attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
        tokens, eod_token, reset_position_ids, reset_attention_mask, eod_mask_loss)
    return GPTBatch(tokens, labels, loss_mask, attention_mask, position_ids)
