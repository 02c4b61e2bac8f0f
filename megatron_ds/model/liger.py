"""liger-kernel's fused linear + cross entropy for the output layer, where it applies.

liger-kernel (``pip install megatron_ds[gpu]``; Triton kernels, CUDA only) projects the hidden
states onto the vocabulary and takes the cross entropy a chunk of tokens at a time, computing the
gradients on the way: the ``[tokens, vocab]`` logits never exist (GPT 1.3B at micro batch 8 and
seq 2048: 0.8 GB of bf16 logits, plus their gradient and fp32 temporaries in the unfused path).

It is used when all of these hold, else the vocab-parallel path (``language_model_loss``) runs:
- liger-kernel imports and CUDA is available (detected once per process);
- it is chosen: ``--liger-kernel``, or neither it nor ``--no-liger-kernel`` and the logits would
  take more than a set share of the GPU's memory (``config.memory.choose_fused_loss``);
- tensor parallel size 1: liger's kernel needs the whole vocabulary on one rank; at TP > 1 the
  chunked vocab-parallel cross entropy keeps the logits split instead;
- the model is training (evaluation and generation need the logits themselves) and the weight is
  not a ZeRO-3 partition (those are released after the module's forward, before the loss).

Padded vocabulary rows (``--make-vocab-size-divisible-by``) never count: the weight is sliced to the
real vocabulary before liger sees it, as the unfused path sets those logits to -inf.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
from typing import NamedTuple

import torch

from megatron_ds.accelerator import on_cuda
from megatron_ds.parallel.utils import tp_world_size

IGNORE_INDEX = -100
"""Label liger skips (its default); tokens outside the loss mask get it."""


def liger_fused_linear_cross_entropy():
    """``(function, None)`` when liger's fused linear cross entropy can run here, else ``(None, why)``."""
    if importlib.util.find_spec("liger_kernel") is None:
        return None, "liger-kernel not installed"
    if not on_cuda():
        return None, "no CUDA device"
    return _import_liger()


@functools.lru_cache(maxsize=None)
def _import_liger():
    try:
        functional = importlib.import_module("liger_kernel.transformers.functional")
        return functional.liger_fused_linear_cross_entropy, None
    except Exception as exc:  # noqa: BLE001 - a broken triton/liger install means "use torch"
        return None, f"liger-kernel failed to import ({type(exc).__name__}: {exc})"


class HiddenForLoss(NamedTuple):
    """What the output layer hands to ``language_model_loss`` instead of logits on the liger path."""
    hidden: torch.Tensor  # [s, b, h], final-normed
    weight: torch.Tensor  # [padded vocab, h], the output layer's (or tied embedding's) weight
    vocab_size: int | None  # the real vocabulary; rows at and above it are padding


def use_fused_linear_loss(enabled: bool, training: bool, hidden: torch.Tensor, weight: torch.Tensor,
                          tp_group) -> bool:
    """Whether the output layer should defer its projection to liger's fused loss (see module doc)."""
    return (enabled and training and hidden.is_cuda and torch.is_grad_enabled()
            and tp_world_size(tp_group) == 1 and not hasattr(weight, "ds_id")
            and liger_fused_linear_cross_entropy()[0] is not None)


def fused_linear_loss(output: HiddenForLoss, labels: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy over the tokens where ``loss_mask`` is 1 (labels/mask ``[b, s]``), as
    ``masked_token_loss`` of the vocab-parallel path computes it for a 0/1 mask (the loaders' masks)."""
    fn, why = liger_fused_linear_cross_entropy()
    if fn is None:
        raise RuntimeError(f"liger fused linear cross entropy requested but unavailable: {why}")
    hidden, weight, vocab_size = output
    if vocab_size is not None:
        weight = weight[:vocab_size]  # padding rows never enter the softmax
    # hidden is [s, b, h]: flatten in its memory order and bring labels/mask to [s, b] to match
    target = labels.t().masked_fill(loss_mask.t() == 0, IGNORE_INDEX).reshape(-1)
    total = fn(hidden.reshape(-1, hidden.shape[-1]), weight, target, ignore_index=IGNORE_INDEX, reduction="sum")
    return total.float() / loss_mask.float().sum().clamp(min=1.0)


def describe_liger(model_cfg=None, tp: int = 1, reason: str = "", on_cuda: bool = False) -> str:
    """For the start-up line and --dry-run: what computes the output layer and the loss while training.
    ``reason``: why the resolved ``model_cfg.liger_kernel`` is what it is (``config.memory.choose_fused_loss``);
    ``on_cuda``: as a CUDA run would, whether or not this process has a GPU."""
    fn, unavailable = liger_fused_linear_cross_entropy()
    if on_cuda and unavailable == "no CUDA device":
        unavailable = None if importlib.util.find_spec("liger_kernel") is not None else "liger-kernel not installed"
    if model_cfg is None:  # no model yet (tools/check_env.py): whether it could run at all
        return (f"logits + vocab-parallel cross entropy (liger-kernel unused: {unavailable})" if unavailable else
                "liger-kernel fused linear + cross entropy available (--liger-kernel, or where the logits would "
                "crowd the GPU's memory)")
    why = reason or {True: "--liger-kernel", False: "--no-liger-kernel"}.get(model_cfg.liger_kernel, "not chosen")
    if not model_cfg.liger_kernel:
        return f"logits + vocab-parallel cross entropy ({why}; liger-kernel's fused linear + cross entropy: " \
               "--liger-kernel)"
    if tp > 1:
        unavailable = "tensor parallel size > 1"
    if unavailable is not None:
        return f"logits + vocab-parallel cross entropy (liger-kernel unused: {unavailable}; chosen for: {why})"
    return f"liger-kernel fused linear + cross entropy while training ({why}; logits + vocab-parallel cross " \
           "entropy otherwise)"
