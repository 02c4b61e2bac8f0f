"""Blending several datasets by weight (`--data-path 0.3 A 0.7 B`), with Megatron's semantics."""
from __future__ import annotations

import math
import time
from typing import Callable, Sequence

import numpy as np
import torch

from megatron_ds.data import helpers
from megatron_ds.data.index_cache import CacheTimings, load_or_build, mmap_restore, mmap_state

# Megatron asks each dataset for 0.5% more samples than its share: the greedy interleaving can
# run a sample or so ahead of a dataset's exact share, and it must never run out.
BLEND_MARGIN = 1.005


def parse_data_path(data_path) -> tuple[list[str], list[float] | None]:
    """`PATH` or `W1 PATH1 W2 PATH2 ...` (a string or a list of words) -> (prefixes, weights or None).

    Weights are normalised to sum to 1.
    """
    words = data_path.split() if isinstance(data_path, str) else [str(w) for w in data_path]
    if not words:
        raise ValueError("empty data path: give PATH or W1 PATH1 W2 PATH2 ...")
    if len(words) == 1:
        return [words[0]], None
    if len(words) % 2:
        raise ValueError(f"data path {' '.join(words)!r} has {len(words)} words; a blend is pairs of "
                         "WEIGHT PATH, e.g. '0.3 A 0.7 B'")
    weights, prefixes = [], []
    for weight, prefix in zip(words[0::2], words[1::2]):
        try:
            value = float(weight)
        except ValueError:
            raise ValueError(f"data path {' '.join(words)!r}: {weight!r} is not a weight; a blend is pairs of "
                             "WEIGHT PATH, e.g. '0.3 A 0.7 B'") from None
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"data path weight {weight!r} for {prefix} must be a finite number >= 0")
        weights.append(value)
        prefixes.append(prefix.strip())
    total = sum(weights)
    if total <= 0:
        raise ValueError(f"data path {' '.join(words)!r}: the weights sum to 0")
    return prefixes, [w / total for w in weights]


def blended_num_samples(weights: Sequence[float], num_samples: Sequence[int]) -> list[list[int]]:
    """Samples to request from each dataset: [dataset][split] = ceil(n * weight * 1.005)."""
    return [[int(math.ceil(n * w * BLEND_MARGIN)) for n in num_samples] for w in weights]


class BlendableDataset(torch.utils.data.Dataset):
    """Sample i is sample dataset_sample_index[i] of datasets[dataset_index[i]].

    The interleaving is greedy (helpers.build_blending_indices), so any prefix of the blend
    holds each dataset in proportion to its weight, within about one sample.
    """

    def __init__(self, datasets: Sequence, weights: Sequence[float], size: int, *, cache_dir: str | None = None,
                 log: Callable[[str], None] = print, cache_timings: CacheTimings = CacheTimings()):
        if len(datasets) != len(weights) or not datasets:
            raise ValueError(f"blending needs one weight per dataset, got {len(datasets)} datasets and {len(weights)} weights")
        weights = np.asarray(weights, dtype=np.float64)
        if weights.sum() <= 0 or (weights < 0).any():
            raise ValueError(f"blending weights must be >= 0 with a positive sum, got {weights.tolist()}")
        self.datasets = list(datasets)
        self.weights = weights / weights.sum()
        self.size = int(size)
        self.desc = "\n".join(
            ["megatron_ds BlendableDataset v1", f"weights: {self.weights.tolist()}", f"size: {self.size}", "datasets:"]
            + [getattr(d, "desc", f"{type(d).__name__} of {len(d)} samples") for d in self.datasets]
        )

        def build():
            helpers.announce_backend(log)
            start = time.time()
            index, sample_index = helpers.build_blending_indices(self.weights, self.size)
            log(f" > blending {len(self.datasets)} datasets into {self.size} samples took {time.time() - start:.2f} s")
            return {"dataset_index": index, "dataset_sample_index": sample_index}

        if cache_dir is None:
            arrays = build()
        else:
            arrays = load_or_build(self.desc, ("dataset_index", "dataset_sample_index"), build,
                                   search_dirs=[cache_dir], build_dir=cache_dir, log=log, timings=cache_timings)
        self.dataset_index, self.dataset_sample_index = arrays["dataset_index"], arrays["dataset_sample_index"]
        self._check_bounds()

    def _check_bounds(self):
        # Each dataset's samples are taken in order 0, 1, 2, ..., so its count is its highest index + 1.
        counts = np.bincount(self.dataset_index, minlength=len(self.datasets))
        for i, (count, dataset) in enumerate(zip(counts, self.datasets)):
            if count > len(dataset):
                name = getattr(dataset, "data_prefix", f"dataset {i}")
                raise ValueError(f"the blend of {self.size} samples takes {count} samples from {name}, "
                                 f"which has only {len(dataset)}; request more samples from it")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx):
        if not -self.size <= idx < self.size:
            raise IndexError(f"sample {idx} out of range for a blend of {self.size} samples")
        return self.datasets[int(self.dataset_index[idx])][int(self.dataset_sample_index[idx])]

    def __getstate__(self):
        return mmap_state(self.__dict__)

    def __setstate__(self, state):
        self.__dict__.update(mmap_restore(state))

