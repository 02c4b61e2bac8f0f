"""The BERT pipeline on one machine, CPU is enough (`make quickstart-bert`, or
`python tools/quickstart.py --model bert`):

  1. the quickstart's real-text corpus (Python standard library docstrings), held-out modules apart
  2. a WordPiece vocabulary trained on it                               tools/train_tokenizer.py
  3. sentence-split Megatron data (_text_sentence.bin/.idx)             tools/preprocess_data.py --split-sentences
  4. a small BERT trained on 2 processes (pipeline parallel 2)          pretrain_bert.py
  5. the run resumed from its checkpoint for the last iterations
  6. masked-LM and sentence-order accuracy on the held-out modules      tools/evaluate_mlm.py
  7. the model exported to transformers' MegatronBertForPreTraining     tools/checkpoint/to_hf.py

Every step prints the command it runs; a second run reuses what the first built.
"""
from __future__ import annotations

import re

from megatron_ds.families.masked_quickstart import MaskedPreset, MaskedSteps, quickstart
from megatron_ds.families.quickstart_steps import numbered_steps

LOSS_RE = re.compile(r" iteration\s+(\d+)/\s*\d+ \|.*? lm loss: ([0-9.E+-]+) \|.*? sop loss: ([0-9.E+-]+) \|")

BERT_PRESETS = {
    # about three minutes of training on 2 CPU cores (pipeline parallel 2, fp32)
    "cpu": MaskedPreset(layers=4, hidden=128, heads=4, seq=128, micro=8, global_batch=32, iters=200, resume_iters=20,
                        lr=1e-3, corpus_mb=2.0, vocab=4096, heldout_modules=40, eval_samples=256),
    "gpu": MaskedPreset(layers=12, hidden=768, heads=12, seq=512, micro=16, global_batch=128, iters=1000,
                        resume_iters=50, lr=1e-4, corpus_mb=20.0, vocab=8192, heldout_modules=40, eval_samples=1024),
    "tiny": MaskedPreset(layers=2, hidden=64, heads=4, seq=64, micro=4, global_batch=8, iters=8, resume_iters=2,
                         lr=2e-3, corpus_mb=0.3, vocab=512, heldout_modules=8, eval_samples=32),
}


def model_flags(preset: MaskedPreset, pp: int) -> list[str]:
    return ["--num-layers", str(preset.layers), "--hidden-size", str(preset.hidden),
            "--num-attention-heads", str(preset.heads), "--seq-length", str(preset.seq)]


def summarize(losses: list, ev: dict) -> list[str]:
    lines = []
    if losses:
        (i0, lm0, sop0), (i1, lm1, sop1) = losses[0], losses[-1]
        lines.append(f"  training lm loss     {lm0:.3f} (iteration {i0}) -> {lm1:.3f} (iteration {i1}); "
                     f"sop loss {sop0:.3f} -> {sop1:.3f}")
    lines.append(f"  held-out modules     masked-LM accuracy {ev['accuracy']:.3f} (lm loss {ev['lm_loss']:.3f}, "
                 f"{ev['masked_tokens']} tokens), sentence-order accuracy {ev['sop_accuracy']:.3f}")
    return lines


EVALUATION = "tools/evaluate_mlm.py"  # ModelFamily.evaluation: what scores its checkpoints
STEPS = MaskedSteps("BERT", "pretrain_bert.py", BERT_PRESETS, model_flags, LOSS_RE, EVALUATION,
                    "masked-LM and sentence-order accuracy on the held-out modules", summarize)
QUICKSTART = quickstart(STEPS, "quickstart-bert", numbered_steps(__doc__))
