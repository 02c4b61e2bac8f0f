#!/usr/bin/env python
"""Evaluate a BERT checkpoint (pretrain_bert.py, saved at any TP / PP) on held-out data: masked-LM
accuracy and loss, and sentence-order accuracy (megatron_ds/inference/masked_lm.py).

The samples are built as training builds them (Megatron-DeepSpeed's BERT samples: the checkpoint's
--seq-length, --mask-prob, --short-seq-prob and seed): by default from the test split of the
checkpoint's own --data-path / --split, which training never reads; --data-path names other
--split-sentences data (held-out documents), all of which is then evaluated.

  python tools/evaluate_mlm.py --load checkpoints --data-path heldout_text_sentence --samples 512
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", required=True, help="checkpoint directory (pretrain_bert.py's --save)")
    p.add_argument("--iteration", type=int, default=None, help="iteration to evaluate (default: the tracker's)")
    p.add_argument("--data-path", default=None, help="--split-sentences prefix of held-out data (default: the "
                                                     "checkpoint's data, its test split)")
    p.add_argument("--vocab-file", default=None, help="the WordPiece vocab.txt, if it moved since training")
    p.add_argument("--samples", type=int, default=256, help="samples to evaluate")
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=None, help="masking seed (default: the training run's)")
    p.add_argument("--output", default=None, help="also write the results as JSON here")
    return p


def _datasets(args, weights, tokenizer):
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
        tokenizer=tokenizer, binary_head=weights.model.bert_binary_head, dataset_type="standard_bert",
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
    from megatron_ds.inference.masked_lm import load_bert, masked_lm_accuracy  # noqa: PLC0415
    from megatron_ds.training.bert import BertCollator  # noqa: PLC0415

    try:
        weights = load_consolidated(args.load, args.iteration, log=lambda *a: None)
        saved = {k: v for k, v in weights.config.get("data", {}).items() if k in DataConfig.__dataclass_fields__}
        data = DataConfig(**saved)
        if args.vocab_file:
            data = dataclasses.replace(data, vocab_file=args.vocab_file)
        tokenizer = build_tokenizer_for(data, log=lambda *a: None,
                                        vocab_extra_ids=weights.config.get("masked_lm", {}).get("vocab_extra_ids", 0))
        # Megatron's samples mapping covers whole epochs: keep the first --samples
        dataset = _datasets(args, weights, tokenizer)
        dataset = torch.utils.data.Subset(dataset, range(min(args.samples, len(dataset))))
        collate = BertCollator(tokenizer.vocab_size, args.data_path or "the checkpoint's test split")
        loader = torch.utils.data.DataLoader(dataset, batch_size=args.micro_batch_size, collate_fn=collate)
        results = masked_lm_accuracy(load_bert(weights), loader, tokenizer.vocab_size)
    except (ConfigError, DataError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    results = {"checkpoint": os.path.abspath(args.load), "iteration": weights.iteration, **results}
    sop = "" if results["sop_accuracy"] is None else f", sentence-order accuracy {results['sop_accuracy']:.4f}"
    print(f"> masked-LM accuracy {results['accuracy']:.4f}, lm loss {results['lm_loss']:.4f} over "
          f"{results['masked_tokens']} masked tokens of {len(dataset)} samples{sop}")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
