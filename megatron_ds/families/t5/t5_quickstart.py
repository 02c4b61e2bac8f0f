"""The T5 pipeline on one machine, CPU is enough (`make quickstart-t5`, or
`python tools/quickstart.py --model t5`):

  1. the quickstart's real-text corpus (Python standard library docstrings), held-out modules apart
  2. a WordPiece vocabulary trained on it                               tools/train_tokenizer.py
  3. sentence-split Megatron data (_text_sentence.bin/.idx)             tools/preprocess_data.py --split-sentences
  4. a small T5 trained on 2 processes (pipeline parallel 2, the encoder on stage 0 and the
     decoder on stage 1: --pipeline-model-parallel-split-rank 1)       pretrain_t5.py
  5. the run resumed from its checkpoint for the last iterations
  6. span-prediction loss and token accuracy on the held-out modules    tools/evaluate_t5.py
  7. the model exported to transformers' T5ForConditionalGeneration     tools/checkpoint/to_hf.py

The T5 here is the variant Hugging Face's T5 computes (no absolute positions, RMS norms, no
biases: megatron_ds/families/t5/t5_hf.py), so step 7 can export it; drop those three flags for
Megatron's own T5 (learned positions, LayerNorm, biases), which trains the same way but does not export.
Every step prints the command it runs; a second run reuses what the first built.
"""
from __future__ import annotations

import re

from megatron_ds.families.masked_quickstart import MaskedPreset, MaskedSteps, quickstart
from megatron_ds.families.quickstart_steps import numbered_steps

LOSS_RE = re.compile(r" iteration\s+(\d+)/\s*\d+ \|.*? lm loss: ([0-9.E+-]+) \|")
HF_VARIANT = ["--position-embedding-type", "none", "--normalization", "rmsnorm", "--disable-bias-linear"]

T5_PRESETS = {
    # a few minutes of training on 2 CPU cores (pipeline parallel 2, fp32)
    "cpu": MaskedPreset(layers=2, hidden=128, heads=4, seq=128, dec_seq=64, micro=8, global_batch=32, iters=200,
                        resume_iters=20, lr=1e-3, corpus_mb=2.0, vocab=4096, heldout_modules=40, eval_samples=256),
    "gpu": MaskedPreset(layers=12, hidden=768, heads=12, seq=512, dec_seq=128, micro=16, global_batch=128,
                        iters=1000, resume_iters=50, lr=1e-4, corpus_mb=20.0, vocab=8192, heldout_modules=40,
                        eval_samples=1024),
    "tiny": MaskedPreset(layers=2, hidden=64, heads=4, seq=64, dec_seq=32, micro=4, global_batch=8, iters=8,
                         resume_iters=2, lr=2e-3, corpus_mb=0.3, vocab=512, heldout_modules=8, eval_samples=32),
}


def model_flags(preset: MaskedPreset, pp: int) -> list[str]:
    # at PP 2 the encoder and the decoder get a stage each
    split = ["--pipeline-model-parallel-split-rank", str(pp // 2)] if pp > 1 else []
    return ["--encoder-num-layers", str(preset.layers), "--decoder-num-layers", str(preset.layers),
            "--hidden-size", str(preset.hidden), "--num-attention-heads", str(preset.heads),
            "--encoder-seq-length", str(preset.seq), "--decoder-seq-length", str(preset.dec_seq), *split,
            "--hidden-dropout", "0.0", "--attention-dropout", "0.0", *HF_VARIANT, "--vocab-extra-ids", "100"]


def summarize(losses: list, ev: dict) -> list[str]:
    lines = []
    if losses:
        (i0, lm0), (i1, lm1) = losses[0], losses[-1]
        lines.append(f"  training lm loss     {lm0:.3f} (iteration {i0}) -> {lm1:.3f} (iteration {i1})")
    lines.append(f"  held-out modules     span-prediction loss {ev['span_loss']:.3f}, token accuracy "
                 f"{ev['accuracy']:.3f} ({ev['target_tokens']} target tokens)")
    return lines


EVALUATION = "tools/evaluate_t5.py"  # ModelFamily.evaluation: what scores its checkpoints
STEPS = MaskedSteps("T5", "pretrain_t5.py", T5_PRESETS, model_flags, LOSS_RE, EVALUATION,
                    "span-prediction loss on the held-out modules", summarize)
QUICKSTART = quickstart(STEPS, "quickstart-t5", numbered_steps(__doc__))
