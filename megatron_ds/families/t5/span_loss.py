"""T5 evaluation on held-out data: span-prediction loss and token accuracy.

The samples are span-corrupted as in training (Megatron-DeepSpeed's T5 samples); the decoder is
teacher-forced on the target ``[sentinel span sentinel span ... EOS]`` and scored at every position
``loss_mask`` keeps: the loss is the mean cross entropy over those tokens (pretrain_t5.py's
``lm loss``, pooled over all evaluated tokens instead of averaged per micro-batch), the accuracy
the share whose greedy prediction is the target token.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_ds.families.t5.t5_model import build_sequential_t5
from megatron_ds.families.t5.t5_params import decoder_layers


def load_t5(weights, device="cpu") -> torch.nn.Module:
    """A single-process T5 from consolidated weights (``checkpoint.load_consolidated``), in eval mode."""
    model = build_sequential_t5(weights.model, decoder_num_layers=decoder_layers(weights.model),
                                padded_vocab_size=weights.padded_vocab_size, seed=0, vocab_size=weights.vocab_size)
    model.load_state_dict(weights.state_dict, strict=True)
    return model.to(device).eval()


@torch.no_grad()
def span_prediction_loss(model, batches, vocab_size: int, device="cpu") -> dict:
    """``batches``: ``((text_enc, text_dec, enc_flags, dec_flags), (labels, loss_mask))`` micro-batches
    (``families.t5.t5_family.T5Collator``). Returns the scored token count, the loss and the accuracy (None
    where nothing was scored)."""
    correct = scored = 0
    nll = 0.0
    for inputs, (labels, loss_mask) in batches:
        logits = model(tuple(t.to(device) for t in inputs))
        picked = loss_mask.to(device) > 0
        target = labels.to(device)[picked]
        scores = logits[..., :vocab_size][picked].float()
        correct += int((scores.argmax(-1) == target).sum())
        scored += int(target.numel())
        nll += float(F.cross_entropy(scores, target, reduction="sum"))
    return {"target_tokens": scored, "span_loss": nll / scored if scored else None,
            "accuracy": correct / scored if scored else None}
