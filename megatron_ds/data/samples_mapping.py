"""The BERT/T5 samples mapping, built once and cached like the GPT indices.

Megatron-DeepSpeed's megatron/data/dataset_utils.py `get_samples_mapping`: rank 0 runs the C++
`build_mapping` and saves `{prefix}_{name}_indexmap_..npy` while the others wait at a barrier.
Here the same array (helpers.build_mapping) goes through index_cache.load_or_build: one builder
among all processes sharing the cache directory, the others wait for its files, and the file name
is a hash of everything the array depends on.
"""
from __future__ import annotations

import os
from typing import Callable

import numpy as np

from megatron_ds.data import helpers
from megatron_ds.data.index_cache import CacheTimings, cache_dirs, load_or_build
from megatron_ds.errors import DataError

_NAMES = ("samples_mapping",)
# Upstream's "no limit" values when only one of epochs / samples is given.
_MAX_EPOCHS = np.iinfo(np.int32).max - 1
_MAX_SAMPLES = np.iinfo(np.int64).max - 1


def get_samples_mapping(indexed_dataset, data_prefix: str, doc_bounds, name: str, *, num_epochs: int | None,
                        max_num_samples: int | None, max_seq_length: int, short_seq_prob: float, seed: int,
                        min_num_sent: int, data_cache_path: str | None = None, log: Callable[[str], None] = print,
                        cache_timings: CacheTimings = CacheTimings()) -> np.ndarray:
    """[n, 3] rows (first sentence, end sentence, target length), memory-mapped from the cache.

    doc_bounds: the split's slice of the indexed dataset's doc_idx (one more entry than documents).
    num_epochs None: as many epochs as reach max_num_samples (whole epochs, so possibly more).
    """
    if not num_epochs:
        if not max_num_samples:
            raise ValueError(f"{name}: give a number of samples or of epochs for the samples mapping")
        num_epochs = _MAX_EPOCHS
    if not max_num_samples:
        max_num_samples = _MAX_SAMPLES
    doc_bounds = np.ascontiguousarray(doc_bounds, dtype=np.int64)
    sizes = indexed_dataset.sizes
    desc = "\n".join([
        "megatron_ds samples mapping (BERT/T5) v1",
        f"data prefix: {os.path.abspath(str(data_prefix))}",
        f"dataset: {len(sizes)} sentences, {len(indexed_dataset.doc_idx) - 1} documents",
        f"name: {name}",
        f"documents: {len(doc_bounds) - 1}, sentences [{int(doc_bounds[0])}, {int(doc_bounds[-1])})",
        f"epochs: {int(num_epochs)}",
        f"max samples: {int(max_num_samples)}",
        f"max sequence length: {int(max_seq_length)}",
        f"short sequence probability: {float(short_seq_prob)!r}",
        f"seed: {int(seed)}",
        f"min sentences: {int(min_num_sent)}",
    ])

    if int(seed) < 1:  # upstream's build_mapping asserts seed > 0
        raise DataError(f"--seed {seed}: BERT/T5 data needs a seed >= 1 (Megatron's samples mapping asserts it)")

    def build():
        try:
            mapping = helpers.build_mapping(doc_bounds, sizes, num_epochs, max_num_samples, max_seq_length,
                                            short_seq_prob, seed, min_num_sent)
        except (ValueError, IndexError) as exc:
            if "no document" not in str(exc):
                raise DataError(f"{data_prefix} ({name} split): {exc}") from None
            need = f"{min_num_sent} sentence(s)" if min_num_sent > 1 else "one sentence"
            raise DataError(f"{data_prefix} ({name} split): no samples can be made ({exc}); every document needs "
                            f"at least {need}, none longer than {helpers.LONG_SENTENCE_LEN} tokens; was the data "
                            f"preprocessed with --split-sentences?") from None
        return {"samples_mapping": mapping}

    helpers.announce_backend(log)
    look, build_dir = cache_dirs(str(data_prefix), data_cache_path)
    mapping = load_or_build(desc, _NAMES, build, search_dirs=look, build_dir=build_dir, log=log,
                            timings=cache_timings)["samples_mapping"]
    log(f" > {name}: samples mapping of {mapping.shape[0]} samples")
    return mapping
