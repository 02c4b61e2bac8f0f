"""BERT evaluation on held-out data: masked-LM accuracy and loss, sentence-order accuracy.

Megatron-DeepSpeed's BERT logs only the training-time losses; the accuracy here is the usual MLM
metric: among the positions a sample predicts (``loss_mask`` 1: the 15% Megatron's masking picks,
whether replaced by [MASK], a random token or kept), the share whose greedy prediction is the
original token. The loss is the mean cross entropy over the same positions (pretrain_bert.py's
``lm loss``, pooled over all evaluated tokens instead of averaged per micro-batch). With the binary
head, sentence-order accuracy is the share of samples whose argmax matches ``is_random``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_ds.families.bert.bert_model import build_sequential_bert


def load_bert(weights, device="cpu") -> torch.nn.Module:
    """A single-process BERT from consolidated weights (``checkpoint.load_consolidated``), in eval mode."""
    model = build_sequential_bert(weights.model, padded_vocab_size=weights.padded_vocab_size, seed=0,
                                  vocab_size=weights.vocab_size)
    model.load_state_dict(weights.state_dict, strict=True)
    return model.to(device).eval()


@torch.no_grad()
def masked_lm_accuracy(model, batches, vocab_size: int, device="cpu") -> dict:
    """``batches``: ``((text, types, padding_mask), (labels, loss_mask, is_random))`` micro-batches
    (``families.bert.bert_family.BertCollator``). Returns the counts and the three figures (None where nothing
    was scored)."""
    correct = scored = 0
    nll = 0.0
    order_correct = samples = 0
    for inputs, (labels, loss_mask, is_random) in batches:
        out = model(tuple(t.to(device) for t in inputs))
        logits, binary = out if isinstance(out, tuple) else (out, None)
        picked = loss_mask.to(device) > 0
        target = labels.to(device)[picked]
        scores = logits[..., :vocab_size][picked].float()
        correct += int((scores.argmax(-1) == target).sum())
        scored += int(target.numel())
        nll += float(F.cross_entropy(scores, target, reduction="sum"))
        if binary is not None:
            order_correct += int((binary.argmax(-1) == is_random.to(device)).sum())
            samples += int(is_random.numel())
    return {"masked_tokens": scored, "accuracy": correct / scored if scored else None,
            "lm_loss": nll / scored if scored else None, "samples": samples,
            "sop_accuracy": order_correct / samples if samples else None}
