"""Concatenate indexed datasets (`.bin/.idx` pairs) into one, Megatron's merge_datasets.

    python tools/merge_datasets.py --input shards/ --output-prefix data/all_text_document
    python tools/merge_datasets.py --input a_text_document b_text_document --output-prefix ab

A directory merges every `.bin/.idx` pair in it in sorted name order (as Megatron does); a list
of prefixes merges in the order given. Sequences, documents and tokens come out exactly as the
concatenation of the inputs; all inputs must share one token dtype.
"""
from __future__ import annotations

import argparse
import os
import sys

from megatron_ds.data.indexed_dataset import (
    IndexedDatasetError,
    MMapIndexedDataset,
    MMapIndexedDatasetBuilder,
    data_file_path,
    dataset_exists,
    index_file_path,
)


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", nargs="+", required=True, help="a directory of .bin/.idx pairs, or dataset prefixes")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    return p.parse_args(argv)


def resolve_prefixes(inputs, output_prefix) -> list[str]:
    out = os.path.abspath(output_prefix)
    if len(inputs) == 1 and os.path.isdir(inputs[0]):
        folder = inputs[0]
        stems = {os.path.splitext(f)[0] for f in os.listdir(folder) if f.endswith((".bin", ".idx"))}
        prefixes = [os.path.join(folder, s) for s in sorted(stems)]
        prefixes = [p for p in prefixes if os.path.abspath(p) != out]  # a re-run must not merge its own output
        for p in prefixes:
            if not dataset_exists(p):
                have, missing = (".bin", ".idx") if os.path.exists(data_file_path(p)) else (".idx", ".bin")
                raise IndexedDatasetError(f"{p}{have} has no matching {missing} file")
        if not prefixes:
            raise IndexedDatasetError(f"--input {folder} contains no .bin/.idx pairs")
        return prefixes
    for p in inputs:
        if not dataset_exists(p):
            raise IndexedDatasetError(f"dataset {p} not found (need {p}.bin and {p}.idx)")
    return list(inputs)


def merge(prefixes, output_prefix, log=print):
    dtype = MMapIndexedDataset(prefixes[0]).dtype
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    tag = f".tmp-{os.getpid()}"
    tmp_bin, tmp_idx = data_file_path(output_prefix) + tag, index_file_path(output_prefix) + tag
    builder = MMapIndexedDatasetBuilder(tmp_bin, dtype=dtype)
    try:
        for prefix in prefixes:
            builder.merge_file_(prefix)
            log(f"> merged {prefix}")
        builder.finalize(tmp_idx)
        # Same commit order as preprocess_data: the final .idx appears last.
        if os.path.exists(index_file_path(output_prefix)):
            os.remove(index_file_path(output_prefix))
        os.replace(tmp_bin, data_file_path(output_prefix))
        os.replace(tmp_idx, index_file_path(output_prefix))
    except BaseException:
        builder.abort()
        if os.path.exists(tmp_idx):
            os.remove(tmp_idx)
        raise
    merged = MMapIndexedDataset(output_prefix)
    log(f"> wrote {output_prefix}.bin/.idx: {len(merged)} sequences, {len(merged.doc_idx) - 1} documents, "
        f"{merged.num_tokens()} tokens ({dtype.name})")


def main(argv=None) -> int:
    args = get_args(argv)
    log = lambda msg: print(msg, file=sys.stderr)  # noqa: E731
    try:
        merge(resolve_prefixes(args.input, args.output_prefix), args.output_prefix, log=log)
    except IndexedDatasetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
