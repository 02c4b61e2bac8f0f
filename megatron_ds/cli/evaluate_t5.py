"""Evaluate a T5 checkpoint (pretrain_t5.py, saved at any TP / PP) on held-out data: span-prediction
loss and token accuracy (megatron_ds/families/t5/span_loss.py).

The samples are built as training builds them (Megatron-DeepSpeed's T5 span corruption: the
checkpoint's --encoder-seq-length, --decoder-seq-length, --mask-prob, --short-seq-prob and seed): by
default from the test split of the checkpoint's own --data-path / --split, which training never
reads; --data-path names other --split-sentences data (held-out documents), all of which is then
evaluated.

  python tools/evaluate_t5.py --load checkpoints --data-path heldout_text_sentence --samples 512
"""
from __future__ import annotations

import os

from megatron_ds.cli.evaluate_masked import build_parser, evaluate, held_out_samples, write_results


def _dataset(args, weights, tokenizer):
    return held_out_samples(args, weights, tokenizer, dataset_type="t5",
                            max_seq_length_dec=weights.config.get("masked_lm", {}).get("decoder_seq_length"))


def main(argv=None) -> int:
    args = build_parser(__doc__, "pretrain_t5.py").parse_args(argv)
    from megatron_ds.families.t5.span_loss import load_t5, span_prediction_loss  # noqa: PLC0415
    from megatron_ds.families.t5.t5_family import T5Collator  # noqa: PLC0415

    done = evaluate(args, "tools/evaluate_t5.py", _dataset, T5Collator,
                    lambda weights, loader, vocab_size: span_prediction_loss(load_t5(weights), loader, vocab_size))
    if done is None:
        return 1
    weights, samples, results = done
    results = {"checkpoint": os.path.abspath(args.load), "iteration": weights.iteration, "samples": samples,
               **results}
    print(f"> span-prediction loss {results['span_loss']:.4f}, token accuracy {results['accuracy']:.4f} over "
          f"{results['target_tokens']} target tokens of {samples} samples")
    write_results(args.output, results)
    return 0
