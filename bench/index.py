#!/usr/bin/env python
"""GPT index building time: the C++ helpers vs the NumPy fallback.

    python bench/index.py                    # 10^9 tokens, seq length 2048
    python bench/index.py --tokens 1e8       # quicker

A synthetic corpus of --tokens tokens in documents of lognormal length (mean about 1000 tokens,
so about a million documents at 10^9) is indexed for one epoch. Reported, best of --repeats:
  * build_sample_idx alone, C++ and NumPy (the two results are checked to be identical);
  * the whole doc_idx + sample_idx + shuffle_idx build (gpt_dataset.build_index_mappings), which
    is what a training job waits for on a cache miss;
  * build_blending_indices for --blend-samples samples over 3 datasets, C++ and NumPy.
"""
from __future__ import annotations

import argparse
import math
import sys
import time

import numpy as np

from megatron_ds.data import helpers
from megatron_ds.data.gpt_dataset import build_index_mappings


def synthetic_sizes(total_tokens: int, mean: float, sigma: float, seed: int) -> np.ndarray:
    """Document lengths (>= 1) from a lognormal with the given mean, summing to about total_tokens."""
    rng = np.random.default_rng(seed)
    mu = math.log(mean) - sigma * sigma / 2  # lognormal mean = exp(mu + sigma^2 / 2)
    n = int(total_tokens / mean * 1.1) + 16
    sizes = np.maximum(rng.lognormal(mu, sigma, n), 1).astype(np.int32)
    cut = int(np.searchsorted(np.cumsum(sizes, dtype=np.int64), total_tokens)) + 1
    return sizes[:cut]


def best_time(fn, repeats: int):
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=float, default=1e9, help="corpus size in tokens (default 1e9)")
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--mean-doc-tokens", type=float, default=1000.0)
    p.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of document lengths")
    p.add_argument("--blend-samples", type=int, default=1_000_000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args(argv)

    print(f"helpers: {'C++ extension built' if helpers.have_extension() else helpers.backend_description()}")
    sizes = synthetic_sizes(int(args.tokens), args.mean_doc_tokens, args.sigma, args.seed)
    tokens = int(sizes.sum(dtype=np.int64))
    documents = np.arange(len(sizes), dtype=np.int32)
    doc_idx = documents.copy()
    np.random.RandomState(args.seed).shuffle(doc_idx)
    samples = (tokens - 1) // args.seq_length
    print(f"corpus: {tokens:,} tokens in {len(sizes):,} documents (mean {tokens / len(sizes):.0f} tokens), "
          f"seq length {args.seq_length}: {samples:,} samples")

    call = (sizes, doc_idx, args.seq_length, 1, tokens)
    backends = ["numpy"] + (["cpp"] if helpers.have_extension() else [])
    results = {}
    for backend in backends:
        seconds, results[backend] = best_time(lambda b=backend: helpers.build_sample_idx(*call, backend=b),
                                              args.repeats)
        print(f"build_sample_idx        {backend:>5}: {seconds * 1e3:9.1f} ms  ({samples / seconds / 1e6:.1f} M samples/s)")
    if len(results) == 2:
        assert np.array_equal(results["cpp"], results["numpy"]), "C++ and NumPy sample indices differ"
        print("build_sample_idx: C++ and NumPy results identical")

    seconds, _ = best_time(lambda: build_index_mappings(documents, sizes, samples, args.seq_length, args.seed,
                                                        log=lambda _m: None), args.repeats)
    print(f"build_index_mappings (doc_idx + sample_idx + shuffle_idx, default backend): {seconds * 1e3:.1f} ms")

    weights = np.array([0.5, 0.3, 0.2])
    blend = {}
    for backend in backends:
        seconds, blend[backend] = best_time(
            lambda b=backend: helpers.build_blending_indices(weights, args.blend_samples, backend=b),
            1 if backend == "numpy" else args.repeats)
        print(f"build_blending_indices  {backend:>5}: {seconds * 1e3:9.1f} ms  for {args.blend_samples:,} samples "
              f"over {len(weights)} datasets")
    if len(blend) == 2:
        assert all(np.array_equal(a, b) for a, b in zip(blend["cpp"], blend["numpy"])), "blending indices differ"
        print("build_blending_indices: C++ and NumPy results identical")
    return 0


if __name__ == "__main__":
    sys.exit(main())
