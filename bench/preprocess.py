#!/usr/bin/env python
"""Preprocessing throughput: the fast path (tools/preprocess_data.py) vs pure-Python GPT-2 BPE.

    python bench/preprocess.py                 # >= 50 MB corpus, 1 and 2 workers
    python bench/preprocess.py --corpus-mb 10  # quicker

The corpus is built from text every machine has: the docstrings and comments of the Python
standard library, one JSONL document per module, repeated with shuffled paragraphs until it
reaches --corpus-mb. Reported:
  * the whole corpus through tools/preprocess_data.py (read, JSON parse, encode, write .bin/.idx)
    with 1 and 2 workers: MB/s of document text and tokens/s;
  * a --ref-mb subset through the same pipeline with one worker, once with the pure-Python
    reference BPE (megatron_ds/data/bpe_reference.py: the algorithm Megatron's preprocess_data
    runs, one document at a time) and once with the native encoder; then both encoders alone.
The ratios are per worker (one process each). Every figure is the best of at least --repeat runs
(more for short ones, until 3 s have passed).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from megatron_ds.data.bpe_reference import ReferenceBPE
from megatron_ds.data.indexed_dataset import MMapIndexedDataset
from megatron_ds.data.sample_corpus import stdlib_documents, write_corpus
from megatron_ds.data.tokenizer import build_tokenizer

SHARED_GPT2 = ROOT / ".." / "shared" / "data" / "gpt2"


def tokenizer_files(tmp: Path, corpus: Path):
    if (SHARED_GPT2 / "gpt2-vocab.json").is_file() and (SHARED_GPT2 / "gpt2-merges.txt").is_file():
        return str(SHARED_GPT2 / "gpt2-vocab.json"), str(SHARED_GPT2 / "gpt2-merges.txt"), "GPT-2 (shared files)"
    from megatron_ds.cli import train_tokenizer

    train_tokenizer.main(["--input", str(corpus), "--vocab-size", "8192", "--output-dir", str(tmp / "tok"),
                          "--max-docs", "2000"])
    return str(tmp / "tok" / "vocab.json"), str(tmp / "tok" / "merges.txt"), "byte-level BPE 8192 trained on the corpus"


def _runs(repeat, min_seconds=3.0, max_runs=20):
    """At least `repeat` runs, and more (up to max_runs) until min_seconds have passed: a 0.2 s
    measurement on a shared machine needs more tries than a 2 s one to find a quiet moment."""
    start, n = time.perf_counter(), 0
    while n < repeat or (time.perf_counter() - start < min_seconds and n < max_runs):
        yield n
        n += 1


class ReferenceTokenizer:
    """The pure-Python BPE behind the interface preprocess_data uses: Megatron's slow path, one
    document at a time, run through our pipeline so both sides pay for the same JSON and I/O."""

    def __init__(self, vocab, merges):
        self.bpe = ReferenceBPE(vocab, merges)
        self.eod = self.bpe.encoder["<|endoftext|>"]
        self.vocab_size = len(self.bpe.encoder)

    def tokenize_batch(self, texts):
        return [self.bpe.encode(t) for t in texts]


def run_pipeline(corpus, vocab, merges, out_prefix, workers, text_bytes, repeat, make_tokenizer=None):
    """Best of `repeat` runs of tools/preprocess_data.py; make_tokenizer() (built outside the timing,
    fresh each run) replaces the tokenizer the flags name."""
    from megatron_ds.cli import preprocess_data

    args = preprocess_data.get_args(["--input", str(corpus), "--output-prefix", str(out_prefix),
                                     "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab,
                                     "--merge-file", merges, "--append-eod", "--workers", str(workers),
                                     "--log-interval", "1000000"])
    seconds = float("inf")
    for _ in _runs(repeat):
        tokenizer = make_tokenizer() if make_tokenizer else None
        start = time.perf_counter()
        preprocess_data.run(args, log=lambda msg: None, tokenizer=tokenizer)
        seconds = min(seconds, time.perf_counter() - start)
    tokens = MMapIndexedDataset(f"{out_prefix}_text_document").num_tokens()
    return {"seconds": seconds, "mb_s": text_bytes / seconds / 1e6, "tok_s": tokens / seconds}


def time_encoder(make_encoder, texts, nbytes, repeat):
    """Best of `repeat` runs, each with a fresh encoder (so the reference's word cache starts empty),
    with the cyclic GC off as in preprocess_data."""
    seconds, ids = float("inf"), None
    for _ in _runs(repeat):
        encode_all = make_encoder()
        ids = None  # free the previous run's ids outside the timed region
        gc.disable()
        start = time.perf_counter()
        ids = encode_all(texts)
        seconds = min(seconds, time.perf_counter() - start)
        gc.enable()
    tokens = sum(len(x) for x in ids)
    return {"seconds": seconds, "mb_s": nbytes / seconds / 1e6, "tok_s": tokens / seconds}, ids


def write_subset(path, docs, mb):
    """The first `mb` of the modules' documents (each seen once: fresh text for the reference's
    word cache, as on a real corpus) as JSONL; returns (texts, text bytes)."""
    picked, size = [], 0
    with open(path, "w", encoding="utf-8") as f:
        for d in docs:
            if size >= mb * 1e6:
                break
            f.write(json.dumps({"text": d}, ensure_ascii=False) + "\n")
            picked.append(d)
            size += len(d.encode("utf-8"))
    return picked, size


def report(label, r, workers=1):
    print(f"{label}: {r['seconds']:.2f}s  {r['mb_s']:.2f} MB/s  {r['tok_s'] / 1e6:.3f} M tokens/s"
          + (f"  ({r['mb_s'] / workers:.2f} MB/s per worker)" if workers > 1 else ""))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus-mb", type=float, default=50.0)
    p.add_argument("--ref-mb", type=float, default=3.0, help="size of the subset the pure-Python path processes")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeat", type=int, default=3,
                   help="report the best of this many runs (shared machines are noisy)")
    args = p.parse_args(argv)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker, everywhere

    with tempfile.TemporaryDirectory(prefix="bench_preprocess_") as tmp:
        tmp = Path(tmp)
        corpus = tmp / "corpus.jsonl"
        t0 = time.perf_counter()
        base = stdlib_documents()
        n_docs, text_bytes = write_corpus(corpus, args.corpus_mb, base=base)
        print(f"machine: {os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.2f}")
        print(f"corpus: {n_docs} documents ({len(base)} stdlib modules, repeated with shuffled paragraphs), "
              f"{corpus.stat().st_size / 1e6:.1f} MB JSONL, {text_bytes / 1e6:.1f} MB text "
              f"(built in {time.perf_counter() - t0:.0f}s)")
        vocab, merges, tok_desc = tokenizer_files(tmp, corpus)
        fast_tok = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges, log=None)
        print(f"tokenizer: {tok_desc}; native backend: {fast_tok.backend}")

        print("-- whole corpus, tools/preprocess_data.py end to end (startup included)")
        for w in args.workers:
            report(f"fast path, {w} worker(s)",
                   run_pipeline(corpus, vocab, merges, tmp / f"out{w}", w, text_bytes, args.repeat), w)
        if len(args.workers) > 1:
            outs = {(tmp / f"out{w}_text_document.bin").read_bytes() for w in args.workers}
            print(f"outputs byte-identical across worker counts: {len(outs) == 1}")

        sub = tmp / "subset.jsonl"
        texts, nbytes = write_subset(sub, base, args.ref_mb)
        print(f"-- {nbytes / 1e6:.1f} MB subset, 1 worker, tokenizers built outside the timing")
        ref_pipe = run_pipeline(sub, vocab, merges, tmp / "ref", 1, nbytes, args.repeat,
                                make_tokenizer=lambda: ReferenceTokenizer(vocab, merges))
        fast_pipe = run_pipeline(sub, vocab, merges, tmp / "fastsub", 1, nbytes, args.repeat,
                                 make_tokenizer=lambda: fast_tok)
        same = (tmp / "ref_text_document.bin").read_bytes() == (tmp / "fastsub_text_document.bin").read_bytes()
        report("pure-Python path (reference BPE in the same pipeline)", ref_pipe)
        report("fast path", fast_pipe)
        print(f"outputs byte-identical: {same}")

        ref_enc, ref_ids = time_encoder(lambda: ReferenceTokenizer(vocab, merges).tokenize_batch, texts, nbytes,
                                        args.repeat)
        fast_enc, fast_ids = time_encoder(lambda: fast_tok.tokenize_batch, texts, nbytes, args.repeat)
        report("reference encoder alone", ref_enc)
        report(f"native encoder alone ({fast_tok.backend})", fast_enc)
        print(f"ids identical: {fast_ids == ref_ids}")
        print(f"per worker, fast / pure-Python: pipeline {fast_pipe['mb_s'] / ref_pipe['mb_s']:.1f}x, "
              f"encoder {fast_enc['mb_s'] / ref_enc['mb_s']:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
