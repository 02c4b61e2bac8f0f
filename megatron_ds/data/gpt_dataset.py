"""GPT pretraining samples over a Megatron indexed dataset, with Megatron's index semantics.

Three index arrays turn a set of documents into fixed-length samples (same arrays, hence the
same samples, as Megatron-LM's GPTDataset for the same data, split, sample count, length, seed):
- doc_idx: the documents repeated once per epoch, shuffled. When the last epoch is needed for
  less than 80% of its samples it is shuffled separately, so those samples are drawn from the
  whole epoch rather than piling up on the documents that happen to land early in a global
  shuffle;
- sample_idx: where each sample starts in the token stream of doc_idx (helpers.build_sample_idx).
  A sample is seq_length + 1 tokens (inputs plus the shifted labels) and consecutive samples
  share one token, so no token is lost as a label;
- shuffle_idx: a permutation of the samples (the separate last epoch's samples again kept apart).
"""
from __future__ import annotations

import hashlib
import os
import time
from typing import Callable

import numpy as np
import torch

from megatron_ds.data import helpers
from megatron_ds.data.index_cache import CacheTimings, cache_dirs, load_or_build, mmap_restore, mmap_state

# Megatron's threshold: a last epoch used for less than this fraction is shuffled on its own.
SEPARATE_LAST_EPOCH_FRACTION = 0.80
_INDEX_NAMES = ("doc_idx", "sample_idx", "shuffle_idx")


def num_epochs_needed(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Fewest epochs whose tokens give num_samples samples: smallest e with (e*T - 1) // s >= n."""
    needed = num_samples * seq_length + 1  # (e*T - 1) // s >= n  <=>  e*T >= n*s + 1
    return max(1, -(-needed // tokens_per_epoch))


def separate_last_epoch(num_epochs: int, tokens_per_epoch: int, seq_length: int, num_samples: int) -> bool:
    if num_epochs == 1:
        return False
    from_full_epochs = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
    last_epoch_samples = num_samples - from_full_epochs
    samples_per_epoch = (tokens_per_epoch - 1) // seq_length
    return last_epoch_samples < int(SEPARATE_LAST_EPOCH_FRACTION * samples_per_epoch)


def _shuffled_epochs(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState) -> np.ndarray:
    doc_idx = np.tile(documents, num_epochs)
    rng.shuffle(doc_idx)
    return doc_idx


def _shuffled_range(start: int, stop: int, dtype, rng: np.random.RandomState) -> np.ndarray:
    idx = np.arange(start, stop, dtype=dtype)
    rng.shuffle(idx)
    return idx


def _check_exact_epochs(num_epochs: int, tokens_per_epoch: int, seq_length: int, num_samples: int) -> None:
    """Megatron's _build_index_mappings asserts, with --train-data-exact-num-epochs N > 1, that the
    samples asked for end inside epoch N: more than N - 1 epochs hold and at most N epochs (+1)."""
    before_last = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
    per_epoch = (tokens_per_epoch - 1) // seq_length
    if not 0 <= num_samples - before_last <= per_epoch + 1:
        raise ValueError(f"--train-data-exact-num-epochs {num_epochs}: the run asks for {num_samples} training "
                         f"samples, which do not end in epoch {num_epochs} ({per_epoch} samples per epoch); "
                         f"use --train-data-exact-num-epochs 1 with --repeated-dataloader, or change it")


def build_index_mappings(documents, sizes, num_samples: int, seq_length: int, seed: int,
                         log: Callable[[str], None] = print, *, num_epochs: int | None = None) -> dict[str, np.ndarray]:
    """doc_idx, sample_idx and shuffle_idx for `num_samples` samples of the given documents
    (``num_epochs``: exactly that many epochs, --train-data-exact-num-epochs, instead of the fewest
    that hold them; the data set may then have fewer or more samples than asked).

    One RandomState(seed) draws, in order: the doc_idx shuffle(s), then the shuffle_idx
    shuffle(s); Megatron's order, which the arrays depend on.
    """
    documents = np.asarray(documents)
    tokens_per_epoch = int(np.sum(sizes[documents], dtype=np.int64))
    if num_epochs is None:
        num_epochs = num_epochs_needed(tokens_per_epoch, seq_length, num_samples)
    elif num_epochs > 1:
        _check_exact_epochs(num_epochs, tokens_per_epoch, seq_length, num_samples)
    separate = separate_last_epoch(num_epochs, tokens_per_epoch, seq_length, num_samples)
    rng = np.random.RandomState(seed=seed)
    # int32 as Megatron stores them, unless the dataset has too many documents for that.
    documents = documents.astype(np.int32 if len(sizes) <= np.iinfo(np.int32).max else np.int64)

    start = time.time()
    if separate:
        doc_idx = np.concatenate([_shuffled_epochs(documents, num_epochs - 1, rng),
                                  _shuffled_epochs(documents, 1, rng)])
    else:
        doc_idx = _shuffled_epochs(documents, num_epochs, rng)
    log(f" > doc_idx: {len(doc_idx)} entries over {num_epochs} epoch(s) "
        f"(last epoch shuffled separately: {separate}) in {time.time() - start:.2f} s")

    start = time.time()
    sample_idx = helpers.build_sample_idx(np.asarray(sizes, dtype=np.int32), doc_idx, seq_length, num_epochs,
                                          tokens_per_epoch)
    log(f" > sample_idx: {len(sample_idx) - 1} samples in {time.time() - start:.2f} s")

    start = time.time()
    total = sample_idx.shape[0] - 1
    first = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length if separate else total
    dtype = np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64
    shuffle_idx = _shuffled_range(0, first, dtype, rng)
    if first != total:
        shuffle_idx = np.concatenate([shuffle_idx, _shuffled_range(first, total, dtype, rng)])
    log(f" > shuffle_idx: {len(shuffle_idx)} entries in {time.time() - start:.2f} s")
    return {"doc_idx": doc_idx, "sample_idx": sample_idx, "shuffle_idx": shuffle_idx}


def _describe_documents(documents: np.ndarray) -> str:
    if len(documents) and np.array_equal(documents, np.arange(documents[0], documents[0] + len(documents))):
        return f"[{int(documents[0])}, {int(documents[0]) + len(documents)})"
    return f"{len(documents)} listed, md5 {hashlib.md5(np.ascontiguousarray(documents, np.int64).tobytes()).hexdigest()}"


class GPTDataset(torch.utils.data.Dataset):
    """`dataset[i]` = {"text": int64 array of seq_length + 1 tokens}, the i-th shuffled sample."""

    def __init__(self, name: str, data_prefix: str, documents, indexed_dataset, num_samples: int, seq_length: int,
                 seed: int, *, split: str = "", data_cache_path: str | None = None,
                 log: Callable[[str], None] = print, cache_timings: CacheTimings = CacheTimings(),
                 train_num_epochs: int | None = None):
        documents = np.asarray(documents)
        sizes = indexed_dataset.sizes
        if len(documents) == 0:
            raise ValueError(f"{name} split of {data_prefix} has no documents")
        if documents.min() < 0 or documents.max() >= len(sizes):
            raise ValueError(f"{name}: document indices must lie in [0, {len(sizes)}) for {data_prefix}")
        if seq_length < 1 or num_samples < 0:
            raise ValueError(f"{name}: seq_length must be >= 1 and num_samples >= 0, got {seq_length}, {num_samples}")
        tokens = int(np.sum(sizes[documents], dtype=np.int64))
        if tokens == 0:
            raise ValueError(f"the {name} split of {data_prefix} (documents {_describe_documents(documents)}) "
                             "has no tokens")
        self.name, self.data_prefix, self.seq_length = name, str(data_prefix), int(seq_length)
        self.indexed_dataset = indexed_dataset
        self.desc = "\n".join([
            "megatron_ds GPTDataset index v1",
            f"data prefix: {os.path.abspath(self.data_prefix)}",
            f"dataset: {len(sizes)} sequences",
            f"name: {name}",
            f"split: {split}",
            f"documents: {_describe_documents(documents)} with {tokens} tokens",
            f"number of samples: {int(num_samples)}",
            f"sequence length: {self.seq_length}",
            f"seed: {int(seed)}",
        ])
        # --train-data-exact-num-epochs applies to the train split only (Megatron: name == 'train')
        epochs = train_num_epochs if name == "train" else None
        if epochs is not None:  # a line only then, so caches built without it keep their key
            self.desc += f"\nexactly {epochs} epoch(s)"
        helpers.announce_backend(log)
        log(f" > {name}: {len(documents)} documents, {tokens} tokens")
        if tokens <= seq_length:
            log(f" > WARNING: the {name} split of {data_prefix} has {tokens} tokens, fewer than one sample of "
                f"{seq_length + 1}; each sample repeats its documents several times")
        look, build_dir = cache_dirs(self.data_prefix, data_cache_path)
        arrays = load_or_build(
            self.desc, _INDEX_NAMES,
            lambda: build_index_mappings(documents, sizes, int(num_samples), self.seq_length, int(seed), log,
                                         num_epochs=epochs),
            search_dirs=look, build_dir=build_dir, log=log, timings=cache_timings)
        self.doc_idx, self.sample_idx, self.shuffle_idx = (arrays[n] for n in _INDEX_NAMES)
        log(f" > {name}: {len(self)} samples available, {int(num_samples)} requested")

    def __len__(self) -> int:
        # Row k + 1 of sample_idx is where sample k ends, hence one row more than samples.
        return self.sample_idx.shape[0] - 1

    def __getitem__(self, idx) -> dict[str, np.ndarray]:
        n = len(self)
        if not -n <= idx < n:
            raise IndexError(f"sample {idx} out of range for {self.name} with {n} samples")
        k = int(self.shuffle_idx[idx])
        first_doc, first_offset = (int(v) for v in self.sample_idx[k])
        last_doc, last_offset = (int(v) for v in self.sample_idx[k + 1])
        get = self.indexed_dataset.get
        if first_doc == last_doc:
            sample = get(self.doc_idx[first_doc], offset=first_offset, length=last_offset - first_offset + 1)
        else:
            parts = [get(self.doc_idx[first_doc], offset=first_offset)]
            parts += [get(self.doc_idx[d]) for d in range(first_doc + 1, last_doc)]
            parts.append(get(self.doc_idx[last_doc], length=last_offset + 1))
            sample = np.concatenate(parts)
        return {"text": np.asarray(sample, dtype=np.int64)}

    def __getstate__(self):
        return mmap_state(self.__dict__)

    def __setstate__(self, state):
        self.__dict__.update(mmap_restore(state))


# ---------------------------------------------------------------------------------------------
# Building train / valid / test datasets from command-line style arguments.

SPLIT_NAMES = ("train", "valid", "test")


def parse_split(split: str) -> list[float]:
    """'949,50,1' (or '949/50/1', or '1') -> three fractions summing to 1; missing parts are 0.

    The numbers are read as Megatron-LM reads them (megatron/core/datasets/blended_megatron_dataset_config.py
    ``parse_and_normalize_split``: ``re.findall(r"[.0-9]+", split)``), so quotes a launch script passes
    literally (NVIDIA's Llama 3 example: ``--split "'99,1,0'"``) or spaces ("969, 30, 1") are skipped."""
    text = str(split)
    unquoted = text.replace("'", "").replace('"', "")
    sep = "," if "," in unquoted else "/"
    try:
        parts = [float(p) for p in unquoted.split(sep) if p.strip()]
    except ValueError:
        raise ValueError(f"--split {text!r} is not a list of numbers like '949,50,1'") from None
    parts = (parts + [0.0, 0.0])[:3]
    if any(p < 0 for p in parts) or sum(parts) <= 0:
        raise ValueError(f"--split {text!r} needs non-negative parts with a positive sum")
    total = sum(parts)
    return [p / total for p in parts]


def split_document_ranges(split: str, num_documents: int) -> list[int]:
    """Document boundaries [0, a, b, num_documents]: split s is documents [bounds[s], bounds[s+1]).

    Megatron's rounding: each part is round(fraction * n) documents, then every boundary is moved
    by the rounding excess so the last one lands on n.
    """
    bounds = [0]
    for fraction in parse_split(split):
        bounds.append(bounds[-1] + int(round(fraction * float(num_documents))))
    excess = bounds[-1] - num_documents
    return [bounds[0]] + [b - excess for b in bounds[1:]]


def _open_indexed(prefix: str, log):
    from megatron_ds.data.indexed_dataset import MMapIndexedDataset, dataset_exists

    if not dataset_exists(prefix):
        hint = " (give the path without the .bin/.idx suffix)" if prefix.endswith((".bin", ".idx")) else ""
        present = [f for f in (f"{prefix}.bin", f"{prefix}.idx") if os.path.exists(f)]
        if present:  # half a dataset: name the half that is missing
            [there] = present
            missing = f"{prefix}.idx" if there.endswith(".bin") else f"{prefix}.bin"
            raise FileNotFoundError(f"dataset {prefix} is incomplete: {missing} is missing ({there} exists)")
        raise FileNotFoundError(f"no dataset at {prefix}: expected {prefix}.bin and {prefix}.idx{hint}")
    start = time.time()
    indexed = MMapIndexedDataset(prefix)
    log(f" > opened {prefix}: {len(indexed.sizes)} documents in {time.time() - start:.3f} s")
    return indexed


def _open_split(prefix: str, split: str, log):
    """The prefix's indexed dataset and its document bounds under --split (logged as Megatron does)."""
    indexed = _open_indexed(prefix, log)
    bounds = split_document_ranges(split, len(indexed.sizes))
    for s, name in enumerate(SPLIT_NAMES):
        log(f"    {name}: document indices in [{bounds[s]}, {bounds[s + 1]}) total of "
            f"{bounds[s + 1] - bounds[s]} documents")
    return indexed, bounds


def _report_empty(split: str, name: str, empty: list[str], documents: list[int], *, blended: bool, log) -> None:
    """A split --split leaves without documents. Megatron-DeepSpeed builds no dataset for it
    (megatron/data/gpt_dataset.py build_dataset: only when splits[index + 1] > splits[index]) and so
    skips its evaluation; in a blend where only some prefixes lack it, BlendableDataset's
    `assert num_datasets == len(weights)` fails. Here: the evaluation is skipped with a warning, the
    blend keeps the prefixes that have documents; an empty train split stays an error (upstream
    would silently train on nothing)."""
    where = f"--split {split} leaves the {name} split of {' '.join(empty)} without documents " \
            f"({', '.join(map(str, documents))} in total)"
    if blended:
        log(f"WARNING: {where}: the {name} blend uses the other prefixes, their weights renormalized")
    elif name == "train":
        raise ValueError(f"{where}; use more data or change --split")
    else:
        log(f"WARNING: {where}: no {name} dataset, its evaluation is skipped (as in Megatron-DeepSpeed)")


def _with_documents(prefixes, weights, opened, split: str, s: int, num_samples: int, warn) -> list[int]:
    """Indices of the prefixes whose part of split s has documents (and weight); reports the others
    when that split was asked for samples."""
    have = [i for i, (_, b) in enumerate(opened) if b[s + 1] > b[s] and (weights is None or weights[i] > 0)]
    empty = [i for i, (_, b) in enumerate(opened) if b[s + 1] <= b[s]]
    if empty and parse_split(split)[s] > 0 and num_samples > 0:
        _report_empty(split, SPLIT_NAMES[s], [prefixes[i] for i in empty], [len(opened[i][0].sizes) for i in empty],
                      blended=bool(have), log=warn)
    return have


def _split_datasets(prefixes, weights, split, num_samples, **kw) -> list:
    """(train, valid, test) from the documents of each prefix cut by --split: a GPTDataset each for a
    single prefix (weights None), else a blend of the prefixes whose part of the split has documents."""
    from megatron_ds.data.blendable_dataset import blended_num_samples

    log = kw["log"]
    opened = [_open_split(p, split, log) for p in prefixes]
    out = []
    for s, name in enumerate(SPLIT_NAMES):
        have = _with_documents(prefixes, weights, opened, split, s, num_samples[s], log)
        if not have or (weights is not None and num_samples[s] == 0):
            out.append(None)
            continue
        kept = [1.0] if weights is None else [weights[i] / sum(weights[j] for j in have) for i in have]
        # Megatron's per-dataset requests (each with its margin) over the prefixes kept
        counts = [num_samples[s]] if weights is None else [c for [c] in blended_num_samples(kept, [num_samples[s]])]
        parts = [GPTDataset(name, prefixes[i], np.arange(opened[i][1][s], opened[i][1][s + 1], dtype=np.int64),
                            opened[i][0], n, split=split, **kw) for i, n in zip(have, counts)]
        out.append(parts[0] if weights is None else _blend(parts, kept, sum(counts), prefixes[0], **kw))
    return out


def _whole_dataset(name, data_path, num_samples, **kw):
    """A dataset over all documents of data_path (a PATH or a W1 PATH1 W2 PATH2 ... blend)."""
    from megatron_ds.data.blendable_dataset import blended_num_samples, parse_data_path

    prefixes, weights = parse_data_path(data_path)
    if weights is None:
        return _all_documents(name, prefixes[0], num_samples, **kw)
    counts = [c[0] for c in blended_num_samples(weights, [num_samples])]
    parts = [_all_documents(name, p, c, **kw) for p, c in zip(prefixes, counts)]
    return _blend(parts, weights, sum(counts), prefixes[0], **kw)


def _all_documents(name, prefix, num_samples, **kw):
    indexed = _open_indexed(prefix, kw["log"])
    return GPTDataset(name, prefix, np.arange(len(indexed.sizes), dtype=np.int64), indexed, num_samples,
                      split="all", **kw)


def _blend(parts, weights, size, first_prefix, *, data_cache_path, log, cache_timings, **_):
    from megatron_ds.data.blendable_dataset import BlendableDataset

    # A component is None only for a split nobody asked samples from; drop it with its weight.
    kept = [(d, w) for d, w in zip(parts, weights) if d is not None]
    if not kept or size == 0:  # a blend nobody asked samples from is no dataset, like a plain split
        return None
    datasets, kept_weights = zip(*kept)
    _, cache_dir = cache_dirs(first_prefix, data_cache_path)
    return BlendableDataset(datasets, kept_weights, size, cache_dir=cache_dir, log=log, cache_timings=cache_timings)


def build_train_valid_test_datasets(*, data_path=None, split: str = "969,30,1", train_valid_test_num_samples,
                                    seq_length: int, seed: int, train_data_path=None, valid_data_path=None,
                                    test_data_path=None, data_cache_path: str | None = None,
                                    log: Callable[[str], None] = print,
                                    cache_timings: CacheTimings = CacheTimings(), train_num_epochs: int | None = None):
    """(train, valid, test) datasets, each a GPTDataset, a BlendableDataset or None.

    data_path (`PATH` or `W1 PATH1 W2 PATH2 ...`, a string or list of words) is split into
    documents by `split`; or train/valid/test_data_path each give a whole dataset (or blend).
    """
    from megatron_ds.data.blendable_dataset import parse_data_path

    nums = [int(n) for n in train_valid_test_num_samples]
    if len(nums) != 3 or min(nums) < 0:
        raise ValueError(f"train_valid_test_num_samples must be three counts >= 0, got {train_valid_test_num_samples}")
    kw = dict(seq_length=int(seq_length), seed=int(seed), data_cache_path=data_cache_path, log=log,
              cache_timings=cache_timings, train_num_epochs=train_num_epochs)
    separate = (train_data_path, valid_data_path, test_data_path)
    if data_path:
        if any(separate):
            raise ValueError("--data-path cannot be combined with --train-data-path/--valid-data-path/"
                             "--test-data-path; use one or the other")
        prefixes, weights = parse_data_path(data_path)
        log(f" > building train, valid, test datasets from {' '.join(prefixes)} with --split {split}")
        return tuple(_split_datasets(prefixes, weights, split, nums, **kw))
    if not any(separate):
        raise ValueError("no data given: pass --data-path, or --train-data-path (and optionally "
                         "--valid-data-path/--test-data-path)")
    log(" > building datasets from separate train/valid/test paths (--split is ignored)")
    return tuple(None if path is None else _whole_dataset(name, path, nums[s], **kw)
                 for s, (name, path) in enumerate(zip(SPLIT_NAMES, separate)))


def check_train_valid_test_data(*, data_path=None, split: str = "969,30,1", train_valid_test_num_samples,
                                train_data_path=None, valid_data_path=None, test_data_path=None,
                                warn: Callable[[str], None] = print) -> None:
    """What build_train_valid_test_datasets would refuse or warn about, found from the index files
    alone (their headers and sizes; no samples, no index caches): for --dry-run, before the queue.
    Raises ValueError / OSError as it does; warnings (empty evaluation splits) go to ``warn``."""
    from megatron_ds.data.blendable_dataset import parse_data_path

    quiet = lambda *a: None  # noqa: E731 - the per-split document ranges are start-up detail
    if data_path:
        prefixes, weights = parse_data_path(data_path)
        opened = [_open_split(p, split, quiet) for p in prefixes]
        for s in range(len(SPLIT_NAMES)):
            _with_documents(prefixes, weights, opened, split, s, train_valid_test_num_samples[s], warn)
        return
    for path in (train_data_path, valid_data_path, test_data_path):
        for prefix in parse_data_path(path)[0] if path else ():
            _open_indexed(prefix, quiet)
