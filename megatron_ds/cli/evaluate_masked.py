"""What tools/evaluate_mlm.py (BERT) and tools/evaluate_t5.py (T5) share: their flags, the
checkpoint consolidated with its tokenizer, the held-out samples built as training builds them, and
one-line errors. Each tool names its sample type, its collator and its scoring."""
from __future__ import annotations

import argparse
import json
import sys


def build_parser(doc: str, script: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", required=True, help=f"checkpoint directory ({script}'s --save)")
    p.add_argument("--iteration", type=int, default=None, help="iteration to evaluate (default: the tracker's)")
    p.add_argument("--data-path", default=None, help="--split-sentences prefix of held-out data (default: the "
                                                     "checkpoint's data, its test split)")
    p.add_argument("--vocab-file", default=None, help="the WordPiece vocab.txt, if it moved since training")
    p.add_argument("--samples", type=int, default=256, help="samples to evaluate")
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=None, help="masking seed (default: the training run's)")
    p.add_argument("--output", default=None, help="also write the results as JSON here")
    return p


def held_out_samples(args, weights, tokenizer, **family):
    """The test split of --data-path (all of it), or else of the checkpoint's own data, masked with the
    training run's probabilities and seed; `family` adds the dataset type and its own lengths."""
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
        tokenizer=tokenizer, log=lambda *a: None, **family)
    if test is None:
        raise ValueError(f"no held-out documents in {' '.join(prefix)} with --split {split}")
    return test


def evaluate(args, tool: str, samples, collator, score):
    """(checkpoint weights, samples evaluated, score's results), or None after a one-line error.
    ``tool``: this tool's script, which must be the evaluation of the checkpoint's model family
    (``ModelFamily.evaluation``);
    samples(args, weights, tokenizer) builds the dataset, collator(vocab size, source name) batches it,
    score(weights, loader, vocab size) scores it."""
    import dataclasses  # noqa: PLC0415

    import torch  # noqa: PLC0415

    from megatron_ds.checkpoint.consolidate import load_consolidated  # noqa: PLC0415
    from megatron_ds.config.schema import DataConfig  # noqa: PLC0415
    from megatron_ds.data.tokenizer import build_tokenizer_for  # noqa: PLC0415
    from megatron_ds.errors import ConfigError, DataError  # noqa: PLC0415
    from megatron_ds.families import checkpoint_family  # noqa: PLC0415

    try:
        family = checkpoint_family(args.load, args.iteration)
        if family.evaluation != tool:
            raise ConfigError(f"{args.load} holds a {family.label} model, which {tool} does not evaluate"
                              + (f": use {family.evaluation}" if family.evaluation else ""))
        weights = load_consolidated(args.load, args.iteration, family=family, log=lambda *a: None)
        saved = {k: v for k, v in weights.config.get("data", {}).items() if k in DataConfig.__dataclass_fields__}
        data = DataConfig(**saved)
        if args.vocab_file:
            data = dataclasses.replace(data, vocab_file=args.vocab_file)
        tokenizer = build_tokenizer_for(data, log=lambda *a: None,
                                        vocab_extra_ids=weights.config.get("masked_lm", {}).get("vocab_extra_ids", 0))
        # Megatron's samples mapping covers whole epochs: keep the first --samples
        dataset = samples(args, weights, tokenizer)
        dataset = torch.utils.data.Subset(dataset, range(min(args.samples, len(dataset))))
        collate = collator(tokenizer.vocab_size, args.data_path or "the checkpoint's test split")
        loader = torch.utils.data.DataLoader(dataset, batch_size=args.micro_batch_size, collate_fn=collate)
        results = score(weights, loader, tokenizer.vocab_size)
    except (ConfigError, DataError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None
    return weights, len(dataset), results


def write_results(path: str | None, results: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=2)
