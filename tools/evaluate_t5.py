#!/usr/bin/env python
"""Evaluate a T5 checkpoint (pretrain_t5.py, saved at any TP / PP) on held-out data: span-prediction
loss and token accuracy (megatron_ds/inference/span_loss.py).

The samples are built as training builds them (Megatron-DeepSpeed's T5 span corruption: the
checkpoint's --encoder-seq-length, --decoder-seq-length, --mask-prob, --short-seq-prob and seed): by
default from the test split of the checkpoint's own --data-path / --split, which training never
reads; --data-path names other --split-sentences data (held-out documents), all of which is then
evaluated.

  python tools/evaluate_t5.py --load checkpoints --data-path heldout_text_sentence --samples 512
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", required=True, help="checkpoint directory (pretrain_t5.py's --save)")
    p.add_argument("--iteration", type=int, default=None, help="iteration to evaluate (default: the tracker's)")
    p.add_argument("--data-path", default=None, help="--split-sentences prefix of held-out data (default: the "
                                                     "checkpoint's data, its test split)")
    p.add_argument("--vocab-file", default=None, help="the WordPiece vocab.txt, if it moved since training")
    p.add_argument("--samples", type=int, default=256, help="samples to evaluate")
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=None, help="masking seed (default: the training run's)")
    p.add_argument("--output", default=None, help="also write the results as JSON here")
    return p


def _dataset(args, weights, tokenizer):
    from megatron_ds.data.bert_t5_datasets import build_train_valid_test_datasets  # noqa: PLC0415

    cfg = weights.config
    data, ml = cfg.get("data", {}), cfg.get("masked_lm", {})
    prefix = [args.data_path] if args.data_path else data.get("data_path")
    split = "0,0,1" if args.data_path else data.get("split", "969, 30, 1")
    if not prefix:
        raise ValueError("the checkpoint records no --data-path (trained on --mock-data?); pass --data-path")
    seed = args.seed if args.seed is not None else cfg.get("training", {}).get("seed", 1234)
    _, _, test = build_train_valid_test_datasets(
        prefix, split, (0, 0, args.samples), max_seq_length=weights.model.seq_length,
        masked_lm_prob=ml.get("mask_prob", 0.15), short_seq_prob=ml.get("short_seq_prob", 0.1), seed=seed,
        tokenizer=tokenizer, max_seq_length_dec=ml.get("decoder_seq_length"), dataset_type="t5",
        log=lambda *a: None)
    if test is None:
        raise ValueError(f"no held-out documents in {' '.join(prefix)} with --split {split}")
    return test


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    import dataclasses  # noqa: PLC0415

    import torch  # noqa: PLC0415

    from megatron_ds.checkpoint.consolidate import load_consolidated  # noqa: PLC0415
    from megatron_ds.config.schema import DataConfig  # noqa: PLC0415
    from megatron_ds.data.tokenizer import build_tokenizer_for  # noqa: PLC0415
    from megatron_ds.errors import ConfigError, DataError  # noqa: PLC0415
    from megatron_ds.inference.span_loss import load_t5, span_prediction_loss  # noqa: PLC0415
    from megatron_ds.training.t5 import T5Collator  # noqa: PLC0415

    try:
        weights = load_consolidated(args.load, args.iteration, log=lambda *a: None)
        saved = {k: v for k, v in weights.config.get("data", {}).items() if k in DataConfig.__dataclass_fields__}
        data = DataConfig(**saved)
        if args.vocab_file:
            data = dataclasses.replace(data, vocab_file=args.vocab_file)
        tokenizer = build_tokenizer_for(data, log=lambda *a: None,
                                        vocab_extra_ids=weights.config.get("masked_lm", {}).get("vocab_extra_ids", 0))
        dataset = _dataset(args, weights, tokenizer)
        dataset = torch.utils.data.Subset(dataset, range(min(args.samples, len(dataset))))
        collate = T5Collator(tokenizer.vocab_size, args.data_path or "the checkpoint's test split")
        loader = torch.utils.data.DataLoader(dataset, batch_size=args.micro_batch_size, collate_fn=collate)
        results = span_prediction_loss(load_t5(weights), loader, tokenizer.vocab_size)
    except (ConfigError, DataError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    results = {"checkpoint": os.path.abspath(args.load), "iteration": weights.iteration, "samples": len(dataset),
               **results}
    print(f"> span-prediction loss {results['span_loss']:.4f}, token accuracy {results['accuracy']:.4f} over "
          f"{results['target_tokens']} target tokens of {len(dataset)} samples")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
