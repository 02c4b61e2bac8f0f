"""Evaluate a BERT checkpoint (pretrain_bert.py, saved at any TP / PP) on held-out data: masked-LM
accuracy and loss, and sentence-order accuracy (megatron_ds/families/bert/masked_lm.py).

The samples are built as training builds them (Megatron-DeepSpeed's BERT samples: the checkpoint's
--seq-length, --mask-prob, --short-seq-prob and seed): by default from the test split of the
checkpoint's own --data-path / --split, which training never reads; --data-path names other
--split-sentences data (held-out documents), all of which is then evaluated.

  python tools/evaluate_mlm.py --load checkpoints --data-path heldout_text_sentence --samples 512
"""
from __future__ import annotations

import os

from megatron_ds.cli.evaluate_masked import build_parser, evaluate, held_out_samples, write_results


def _datasets(args, weights, tokenizer):
    return held_out_samples(args, weights, tokenizer, binary_head=weights.model.bert_binary_head,
                            dataset_type="standard_bert")


def main(argv=None) -> int:
    args = build_parser(__doc__, "pretrain_bert.py").parse_args(argv)
    from megatron_ds.families.bert.bert_family import BertCollator  # noqa: PLC0415
    from megatron_ds.families.bert.masked_lm import load_bert, masked_lm_accuracy  # noqa: PLC0415

    done = evaluate(args, "tools/evaluate_mlm.py", _datasets, BertCollator,
                    lambda weights, loader, vocab_size: masked_lm_accuracy(load_bert(weights), loader, vocab_size))
    if done is None:
        return 1
    weights, samples, results = done
    results = {"checkpoint": os.path.abspath(args.load), "iteration": weights.iteration, **results}
    sop = "" if results["sop_accuracy"] is None else f", sentence-order accuracy {results['sop_accuracy']:.4f}"
    print(f"> masked-LM accuracy {results['accuracy']:.4f}, lm loss {results['lm_loss']:.4f} over "
          f"{results['masked_tokens']} masked tokens of {samples} samples{sop}")
    write_results(args.output, results)
    return 0
