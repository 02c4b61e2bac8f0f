"""Split a plain-text corpus into documents and write them as JSONL for tools/preprocess_data.py.

Many public corpora ship as one big text file with a document separator (TinyStories uses
`<|endoftext|>`; a blank-line separated corpus uses "\\n\\n"). This streams the file in chunks,
so multi-GB inputs need little memory, and writes one `{"text": ...}` object per document:

    python dataset/text_to_jsonl.py --input stories.txt --output stories.jsonl \\
        --separator '<|endoftext|>'

Documents are stripped of surrounding whitespace; empty ones are dropped (and counted).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Iterable, Iterator, TextIO


def split_documents(chunks: Iterable[str], separator: str) -> Iterator[str]:
    """Yield the raw documents of a text given in chunks, wherever the separator falls."""
    pending = ""
    for chunk in chunks:
        pending += chunk
        parts = pending.split(separator)
        pending = parts.pop()  # may end in a partial separator: keep it for the next chunk
        yield from parts
    yield pending


def read_chunks(handle: TextIO, chunk_chars: int) -> Iterator[str]:
    while True:
        chunk = handle.read(chunk_chars)
        if not chunk:
            return
        yield chunk


def convert(src: TextIO, dst: TextIO, separator: str, key: str = "text",
            chunk_chars: int = 1 << 20, log_every: int = 100_000, log=print) -> tuple[int, int]:
    """Write one JSON line per non-empty document; returns (documents written, empty dropped)."""
    written = dropped = 0
    start = time.monotonic()
    for doc in split_documents(read_chunks(src, chunk_chars), separator):
        doc = doc.strip()
        if not doc:
            dropped += 1
            continue
        dst.write(json.dumps({key: doc}, ensure_ascii=False) + "\n")
        written += 1
        if log_every and written % log_every == 0:
            log(f"  {written:,} documents ({written / (time.monotonic() - start):,.0f}/s)")
    return written, dropped


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True, help="UTF-8 text file")
    parser.add_argument("--output", required=True, help="JSONL file to write")
    parser.add_argument("--separator", default="<|endoftext|>",
                        help="document separator; \\n and \\t are understood "
                             "(default: %(default)s)")
    parser.add_argument("--json-key", default="text",
                        help="key of each JSON object (default: text)")
    parser.add_argument("--log-interval", type=int, default=100_000,
                        help="print progress every N documents (0: never)")
    args = parser.parse_args(argv)
    # Let users type "\n\n" on a shell command line for blank-line separated corpora.
    args.separator = args.separator.replace("\\n", "\n").replace("\\t", "\t")
    if not args.separator:
        parser.error("--separator must not be empty")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    tmp = args.output + ".part"  # a crash never leaves a plausible-looking partial JSONL behind
    try:
        with open(args.input, encoding="utf-8", errors="strict") as src, \
                open(tmp, "w", encoding="utf-8") as dst:
            written, dropped = convert(src, dst, args.separator, args.json_key,
                                       log_every=args.log_interval)
    except FileNotFoundError:
        print(f"error: input file not found: {args.input}", file=sys.stderr)
        return 1
    except UnicodeDecodeError as exc:
        os.remove(tmp)
        print(f"error: {args.input} is not UTF-8 text ({exc.reason}); convert it first, e.g. with "
              "iconv", file=sys.stderr)
        return 1
    os.replace(tmp, args.output)
    print(f"wrote {written:,} documents to {args.output} ({dropped:,} empty dropped)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
