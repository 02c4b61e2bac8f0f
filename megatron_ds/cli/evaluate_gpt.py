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

Results are printed and written as JSON (--output, default: evaluation.json).

Examples:
  python tools/evaluate.py --load checkpoints --ppl-data data/corpus_text_document --max-tokens 50000
  python tools/evaluate.py --load checkpoints --ppl-data wiki.test.txt --window 1024 --stride 512
  python tools/evaluate.py --hf-model hf_export --lambada lambada_test.jsonl --output lambada.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from megatron_ds.data.indexed_dataset import MMapIndexedDataset, dataset_exists
from megatron_ds.inference.evaluate import lambada_accuracy, lambada_samples, perplexity
from megatron_ds.inference.runtime import add_model_args, close_session, open_session


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
    g.add_argument("--batch-size", type=int, default=4, help="windows (or LAMBADA samples x2) per forward")
    g = p.add_argument_group("lambada")
    g.add_argument("--lambada", help="JSONL file with a 'text' per line")
    g.add_argument("--lambada-last-token", action="store_true", help="score the last token, not the last word")
    g = p.add_argument_group("output")
    g.add_argument("--output", default="evaluation.json", help="JSON file for the results")
    g.add_argument("--no-progress", action="store_true", help="no progress lines")
    return p


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
    return results


def missing_input(args) -> str | None:
    """An input file that is not there, named before the model is loaded."""
    for path in args.ppl_data:
        if not dataset_exists(path) and not os.path.isfile(path):
            return f"--ppl-data {path}: neither a file nor a .bin/.idx prefix"
    if args.lambada and not os.path.isfile(args.lambada):
        return f"--lambada {args.lambada} does not exist (a JSONL file with a 'text' per line)"
    return None


def main(argv=None) -> int:
    """Exit status: 2 for a command line refused as such, 1 when the work fails (pretrain_gpt.py's rule)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.ppl_data and not args.lambada:
        parser.error("nothing to evaluate: pass --ppl-data and/or --lambada")
    missing = missing_input(args)
    if missing:
        print(f"error: {missing}", file=sys.stderr)
        return 1
    try:
        session = open_session(args)
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
