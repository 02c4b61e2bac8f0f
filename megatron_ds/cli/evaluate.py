"""Evaluate a trained GPT: sliding-window perplexity and LAMBADA-style last-word accuracy.

The model comes from a checkpoint directory (--load; saved at any tensor / pipeline parallel size)
or a Hugging Face export (--hf-model); under a launcher the processes are tensor parallel ranks.

Perplexity (--ppl-data, repeatable) on:
  * a preprocessed data set: the prefix of a .bin/.idx pair (its tokens in file order, documents
    back to back with the end-of-document tokens they were preprocessed with);
  * a raw text file (.txt, or any file not ending in .jsonl/.json): the whole file as one text;
  * a JSONL file: the --json-key field of each line, each document followed by end-of-document.
The stream is cut into windows of --window tokens (default: the model's sequence length) starting
every --stride tokens (default: half a window), and each window scores only the tokens the previous
one did not, as in Hugging Face's perplexity guide and the usual wikitext numbers. --max-tokens
evaluates the first N tokens only.

LAMBADA (--lambada FILE.jsonl, one {"text": ...} per line): the whole last word must be the greedy
prediction at each of its tokens, given the text before it (Megatron's --strict-lambada; pass
--lambada-last-token for its non-strict variant).

Megatron's zero-shot tasks (tasks/main.py --task, as tasks/zeroshot_gpt computes them):
  * --task WIKITEXT103 --valid-data wiki.test.tokens: the file detokenized by Megatron's rules (picked
    by its name: ptb, wiki, lambada; --detokenizer overrides), windows of --seq-length tokens (default:
    the model's) every --overlapping-eval tokens (Megatron's default 32), and Megatron's avg loss, ppl,
    adjusted ppl (per original whitespace word) and token ratio;
  * --task LAMBADA --valid-data lambada_test.jsonl: last-token accuracy, or last-word with
    --strict-lambada.
--micro-batch-size is accepted for --batch-size. Megatron's model flags (--num-layers, --hidden-size,
--num-attention-heads, --num-key-value-heads, --ffn-hidden-size, --max-position-embeddings,
--tensor-model-parallel-size) are checked against the checkpoint and the launch (an error names
each mismatch); --fp16 / --bf16 mean --dtype; --no-load-optim, --no-load-rng, --log-interval and
--checkpoint-activations are accepted and change nothing.

Results are printed and written as JSON (--output, default: evaluation.json).

Examples:
  python tools/evaluate.py --load checkpoints --ppl-data data/corpus_text_document --max-tokens 50000
  python tools/evaluate.py --load checkpoints --ppl-data wiki.test.txt --window 1024 --stride 512
  python tools/evaluate.py --hf-model hf_export --lambada lambada_test.jsonl --output lambada.json
  python tools/evaluate.py --load checkpoints --task WIKITEXT103 --valid-data wiki.test.tokens \
      --overlapping-eval 32 --seq-length 1024
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from megatron_ds.data.indexed_dataset import MMapIndexedDataset, dataset_exists
from megatron_ds.inference.runtime import (add_megatron_model_args, add_model_args, close_session,
                                           open_session)
from megatron_ds.inference.scoring import lambada_accuracy, lambada_samples, perplexity
from megatron_ds.inference.zeroshot import (DETOKENIZERS, MEGATRON_OVERLAPPING_EVAL, detokenizer_for, read_text,
                                            wikitext_perplexity)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    g = p.add_argument_group("perplexity")
    g.add_argument("--ppl-data", action="append", default=[],
                   help=".bin/.idx prefix, text file or JSONL file (repeatable)")
    g.add_argument("--json-key", default="text", help="JSONL field holding the text")
    g.add_argument("--window", type=int, default=None, help="tokens per window (default: the model's seq length)")
    g.add_argument("--stride", type=int, default=None, help="tokens between window starts (default: window / 2)")
    g.add_argument("--max-tokens", type=int, default=None, help="evaluate only the first N tokens")
    g.add_argument("--batch-size", "--micro-batch-size", type=int, default=4,
                   help="windows (or LAMBADA samples x2) per forward")
    g = p.add_argument_group("lambada")
    g.add_argument("--lambada", help="JSONL file with a 'text' per line")
    g.add_argument("--lambada-last-token", action="store_true", help="score the last token, not the last word")
    add_task_args(p)
    add_megatron_model_args(p)
    g = p.add_argument_group("output")
    g.add_argument("--output", default="evaluation.json", help="JSON file for the results")
    g.add_argument("--no-progress", action="store_true", help="no progress lines")
    return p


def add_task_args(p: argparse.ArgumentParser) -> None:
    """Megatron's tasks/main.py flags for tasks/zeroshot_gpt, with its defaults."""
    g = p.add_argument_group("Megatron zero-shot tasks (tasks/main.py)")
    g.add_argument("--task", choices=("WIKITEXT103", "LAMBADA"), default=None, help="Megatron's zero-shot task")
    g.add_argument("--valid-data", nargs="*", default=None, help="the task's one data file")
    g.add_argument("--overlapping-eval", type=int, default=MEGATRON_OVERLAPPING_EVAL,
                   help="tokens between WIKITEXT103 window starts (Megatron's default 32; below 1 means 1)")
    g.add_argument("--strict-lambada", action="store_true", help="LAMBADA: the whole last word must be right")
    g.add_argument("--seq-length", type=int, default=None, help="WIKITEXT103 window (default: the model's)")
    g.add_argument("--detokenizer", choices=("auto", "none", *DETOKENIZERS), default="auto",
                   help="WIKITEXT103: auto picks it from the file name, as Megatron")


def read_stream(path: str, tokenizer, json_key: str, max_tokens: int | None) -> np.ndarray:
    """The token stream of a .bin/.idx prefix, a text file or a JSONL file."""
    if dataset_exists(path):
        ds = MMapIndexedDataset(path)
        n = ds.num_tokens() if max_tokens is None else min(max_tokens, ds.num_tokens())
        # The .bin file is the documents' tokens back to back, in index order.
        return np.fromfile(path + ".bin", dtype=ds.dtype, count=n).astype(np.int64)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--ppl-data {path}: neither a file nor a .bin/.idx prefix")
    if path.endswith((".jsonl", ".json")):
        ids: list[int] = []
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    try:
                        ids += tokenizer.tokenize(json.loads(line)[json_key]) + [tokenizer.eod]
                    except (json.JSONDecodeError, KeyError, TypeError):
                        raise ValueError(f"{path}:{lineno}: expected a JSON object with a {json_key!r} "
                                         f"string") from None
                if max_tokens is not None and len(ids) >= max_tokens:
                    break
    else:
        with open(path, encoding="utf-8") as f:
            ids = tokenizer.tokenize(f.read())
    return np.asarray(ids[:max_tokens] if max_tokens is not None else ids, dtype=np.int64)


def evaluate(session, args) -> dict:
    seq = session.weights.model.seq_length
    window = args.window or seq
    stride = args.stride or max(window // 2, 1)
    results: dict = {"model": session.describe, "perplexity": {}}
    for path in args.ppl_data:
        stream = read_stream(path, session.tokenizer, args.json_key, args.max_tokens)
        r = perplexity(session.model, stream, window=window, stride=stride, batch_size=args.batch_size,
                       show_progress=session.is_main and not args.no_progress)
        session.log(f"> perplexity of {path}: {r['perplexity']:.3f} (nll {r['nll']:.4f}, {r['scored_tokens']} "
                    f"tokens, window {window}, stride {stride})")
        results["perplexity"][path] = r
    if args.lambada:
        samples = lambada_samples(args.lambada, session.tokenizer, strict=not args.lambada_last_token)
        r = lambada_accuracy(session.model, samples, pad_id=0, batch_size=2 * args.batch_size,
                             show_progress=session.is_main and not args.no_progress)
        r["strict"] = not args.lambada_last_token
        session.log(f"> lambada {args.lambada}: accuracy {r['accuracy']:.4f} ({r['correct']}/{r['samples']}), "
                    f"target perplexity {r['target_perplexity']:.3f}")
        results["lambada"] = {args.lambada: r}
    if args.task:
        results["task"] = evaluate_task(session, args)
    return results


def evaluate_task(session, args) -> dict:
    """Megatron's --task, printed in tasks/zeroshot_gpt's format."""
    (path,) = args.valid_data
    show = session.is_main and not args.no_progress
    if args.task == "WIKITEXT103":
        r = wikitext_perplexity(session.model, read_text(path), session.tokenizer,
                                seq_len=args.seq_length or session.weights.model.seq_length,
                                overlapping_eval=args.overlapping_eval,
                                detokenize=detokenizer_for(path, args.detokenizer),
                                batch_size=args.batch_size, show_progress=show)
        line = (f"avg loss: {r['avg_loss']:.4E} | ppl: {r['ppl']:.4E} | adjusted ppl: {r['adjusted_ppl']:.4E} | "
                f"token ratio: {r['token_ratio']} |")
    else:
        r = lambada_accuracy(session.model, lambada_samples(path, session.tokenizer, strict=args.strict_lambada),
                             pad_id=0, batch_size=args.batch_size, show_progress=show)
        r.update(task="LAMBADA", strict=args.strict_lambada)
        line = (f"number correct: {r['correct']:.4E} | total examples: {r['samples']:.4E} | "
                f"avg accuracy: {r['accuracy']:.4E}")
    session.log(f" validation results on {args.task} | {line}")
    return {**r, "valid_data": path}


def missing_input(args) -> str | None:
    """An input file that is not there, named before the model is loaded."""
    for path in args.ppl_data:
        if not dataset_exists(path) and not os.path.isfile(path):
            return f"--ppl-data {path}: neither a file nor a .bin/.idx prefix"
    if args.lambada and not os.path.isfile(args.lambada):
        return f"--lambada {args.lambada} does not exist (a JSONL file with a 'text' per line)"
    for path in args.valid_data or ():
        if not os.path.isfile(path):
            return f"--valid-data {path} does not exist"
    return None


def task_error(args) -> str | None:
    """A --task command line Megatron would refuse (it asserts one --valid-data file)."""
    if args.task and len(args.valid_data or ()) != 1:
        return f"--task {args.task} needs exactly one --valid-data file"
    if args.valid_data and not args.task:
        return "--valid-data needs --task WIKITEXT103 or LAMBADA"
    if args.task == "WIKITEXT103":
        try:  # named before the model is loaded
            detokenizer_for(args.valid_data[0], args.detokenizer)
        except ValueError as exc:
            return str(exc)
    return None


def main(argv=None) -> int:
    """Exit status: 2 for a command line refused as such, 1 when the work fails (pretrain_gpt.py's rule)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.ppl_data and not args.lambada and not args.task:
        parser.error("nothing to evaluate: pass --ppl-data and/or --lambada, or --task with --valid-data")
    if task_error(args):
        parser.error(task_error(args))
    missing = missing_input(args)
    if missing:
        print(f"error: {missing}", file=sys.stderr)
        return 1
    from megatron_ds.families import weights_family  # noqa: PLC0415 - the training stack, after --help

    try:
        session = open_session(args, weights_family(args.load, args.iteration, args.hf_model))
    except (ValueError, OSError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    try:
        results = evaluate(session, args)
        if session.is_main:
            os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
            with open(args.output, "w") as f:
                json.dump(results, f, indent=2)
            print(f"> wrote {args.output}")
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        close_session()
    return 0
