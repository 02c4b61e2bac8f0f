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


def _eod_before(is_eod: torch.Tensor) -> torch.Tensor:
    """True at token j when token j - 1 is an EOD: token j starts a new document (the EOD itself
    closes the previous one)."""
    eod_before = torch.zeros_like(is_eod)
    eod_before[:, 1:] = is_eod[:, :-1]
    return eod_before


def loss_mask_and_position_ids(tokens: torch.Tensor, eod_token: int, reset_position_ids: bool,
                               eod_mask_loss: bool):
    """(loss_mask float [b, s], position_ids long [b, s]): what training needs per micro-batch.
    The model derives attention across documents itself, so no [s, s] mask is built here."""
    batch, seq = tokens.shape
    positions = torch.arange(seq, dtype=torch.long, device=tokens.device)
    is_eod = tokens == eod_token
    loss_mask = torch.ones((batch, seq), dtype=torch.float, device=tokens.device)
    if eod_mask_loss:
        loss_mask[is_eod] = 0.0
    if reset_position_ids:
        starts = torch.where(_eod_before(is_eod), positions, torch.zeros_like(positions))
        position_ids = positions - torch.cummax(starts, dim=1).values
    else:
        # repeat, not expand: a stride-0 view shares one memory location per column, and the
        # DataLoader's pin-memory thread (every CUDA run) refuses to copy such a tensor.
        position_ids = positions.unsqueeze(0).repeat(batch, 1)
    return loss_mask, position_ids


def get_ltor_masks_and_position_ids(tokens: torch.Tensor, eod_token: int, reset_position_ids: bool,
                                    reset_attention_mask: bool, eod_mask_loss: bool):
    """(attention_mask, loss_mask, position_ids) for left-to-right tokens [b, s], as Megatron's
    function of this name returns them.

    attention_mask: bool [b (1 unless reset_attention_mask), 1, s, s], True where attention is
    NOT allowed (Megatron's convention). loss_mask: float [b, s]. position_ids: long [b, s].
    """
    seq = tokens.shape[1]
    loss_mask, position_ids = loss_mask_and_position_ids(tokens, eod_token, reset_position_ids, eod_mask_loss)
    causal = torch.ones((seq, seq), dtype=torch.bool, device=tokens.device).tril_()
    if reset_attention_mask:
        document = torch.cumsum(_eod_before(tokens == eod_token), dim=1)
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
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor


def gpt_batch_from_samples(samples, eod_token: int, reset_position_ids: bool = False,
                           reset_attention_mask: bool = False, eod_mask_loss: bool = False,
                           device: torch.device | str | None = None, with_attention_mask: bool = True) -> GPTBatch:
    """samples: int [b, s + 1] (numpy, tensor, or a collated {"text": ...}) -> GPTBatch of [b, s] tensors.
    with_attention_mask=False skips the [s, s] mask (attention_mask is None): the training path."""
    if isinstance(samples, dict):
        samples = samples["text"]
    if isinstance(samples, np.ndarray):
        samples = torch.from_numpy(np.ascontiguousarray(samples, dtype=np.int64))
    samples = samples.to(device=device, dtype=torch.long)
    if samples.dim() != 2 or samples.shape[1] < 2:
        raise ValueError(f"samples must be [batch, seq_length + 1] with seq_length >= 1, got {tuple(samples.shape)}")
    # clone, not contiguous(): with batch 1 both slices are already contiguous views of `samples`;
    # each tensor of a micro-batch owns its memory (pinning and worker transfer copy it whole).
    tokens = samples[:, :-1].clone(memory_format=torch.contiguous_format)
    labels = samples[:, 1:].clone(memory_format=torch.contiguous_format)
    if with_attention_mask:
        attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
            tokens, eod_token, reset_position_ids, reset_attention_mask, eod_mask_loss)
    else:
        attention_mask = None
        loss_mask, position_ids = loss_mask_and_position_ids(tokens, eod_token, reset_position_ids, eod_mask_loss)
    return GPTBatch(tokens, labels, loss_mask, attention_mask, position_ids)
