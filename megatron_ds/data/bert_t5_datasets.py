"""Train / valid / test BERT or T5 datasets from `--data-path` and `--split`.

Megatron-DeepSpeed's megatron/data/dataset_utils.py `build_train_valid_test_datasets` with
dataset_type 'standard_bert' or 't5': --split cuts the *documents* of each prefix (data made with
`tools/preprocess_data.py --split-sentences`, one sequence per sentence), each split's samples
mapping covers its documents' sentences, and `W1 P1 W2 P2 ...` blends the prefixes, each asked for
its weight's share of the samples plus 0.5%. Differences: a split that is asked for no samples
gets no dataset (upstream fails building a mapping for 0 samples), and a split without
documents gets none either (as upstream).
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from megatron_ds.data.blendable_dataset import BlendableDataset, blended_num_samples, parse_data_path
from megatron_ds.data.gpt_dataset import SPLIT_NAMES, split_document_ranges
from megatron_ds.data.index_cache import CacheTimings, cache_dirs
from megatron_ds.errors import DataError

DSET_TYPE_BERT = "standard_bert"
DSET_TYPE_T5 = "t5"
DSET_TYPES = (DSET_TYPE_BERT, DSET_TYPE_T5)


def _open(prefix: str, log):
    from megatron_ds.data.indexed_dataset import MMapIndexedDataset, dataset_exists

    if not dataset_exists(prefix):
        raise DataError(f"no dataset at {prefix}: expected {prefix}.bin and {prefix}.idx (give the prefix without "
                        "the suffix, e.g. data/my_text_sentence)")
    indexed = MMapIndexedDataset(prefix)
    num_docs = len(indexed.doc_idx) - 1
    log(f" > opened {prefix}: {num_docs} documents, {len(indexed.sizes)} sentences")
    if num_docs < 1 or indexed.doc_idx[-1] != len(indexed.sizes):
        raise DataError(f"{prefix}: its document index does not cover its {len(indexed.sizes)} sentences")
    return indexed


def _dataset(dataset_type, name, indexed, prefix, bounds, num_samples, kw):
    from megatron_ds.data.bert_dataset import BertDataset
    from megatron_ds.data.t5_dataset import T5Dataset

    doc_bounds = np.asarray(indexed.doc_idx[bounds[0]:bounds[1] + 1], dtype=np.int64)
    epochs = kw["train_num_epochs"] if name == "train" else None
    if epochs is not None:  # upstream: exactly that many epochs, however many samples they hold
        num_samples = None
    common = dict(num_epochs=epochs, data_cache_path=kw["data_cache_path"], log=kw["log"],
                  cache_timings=kw["cache_timings"])
    if dataset_type == DSET_TYPE_BERT:
        return BertDataset(name, indexed, prefix, doc_bounds, num_samples, kw["masked_lm_prob"], kw["max_seq_length"],
                           kw["short_seq_prob"], kw["seed"], kw["binary_head"], kw["tokenizer"], **common)
    return T5Dataset(name, indexed, prefix, doc_bounds, num_samples, kw["masked_lm_prob"], kw["max_seq_length"],
                     kw["max_seq_length_dec"], kw["short_seq_prob"], kw["seed"], kw["tokenizer"], **common)


def _split_datasets(dataset_type, prefix, split, nums, kw) -> list:
    indexed = _open(prefix, kw["log"])
    bounds = split_document_ranges(split, len(indexed.doc_idx) - 1)
    out = []
    for s, name in enumerate(SPLIT_NAMES):
        kw["log"](f"    {name}: document indices in [{bounds[s]}, {bounds[s + 1]}) total of "
                  f"{bounds[s + 1] - bounds[s]} documents")
        wanted = nums[s] > 0 or (name == "train" and kw["train_num_epochs"] is not None)
        if bounds[s + 1] <= bounds[s] or not wanted:
            out.append(None)
            continue
        out.append(_dataset(dataset_type, name, indexed, prefix, bounds[s:s + 2], nums[s], kw))
    return out


def build_train_valid_test_datasets(data_prefix, splits_string: str, train_valid_test_num_samples, *,
                                    max_seq_length: int, masked_lm_prob: float, short_seq_prob: float, seed: int,
                                    tokenizer, binary_head: bool = False, max_seq_length_dec: int | None = None,
                                    dataset_type: str = DSET_TYPE_BERT, data_cache_path: str | None = None,
                                    train_num_epochs: int | None = None, log: Callable[[str], None] = print,
                                    cache_timings: CacheTimings = CacheTimings()):
    """(train, valid, test): BertDataset / T5Dataset, a BlendableDataset of them, or None each.

    data_prefix: `PATH` or `W1 PATH1 W2 PATH2 ...` (a string or a list of words). tokenizer: a BERT
    WordPiece tokenizer (megatron_ds.data.tokenizer.build_tokenizer; T5 needs --vocab-extra-ids).
    max_seq_length: --seq-length (BERT) / --encoder-seq-length (T5); max_seq_length_dec:
    --decoder-seq-length (T5 only). train_num_epochs: --train-data-exact-num-epochs.
    """
    if dataset_type not in DSET_TYPES:
        raise ValueError(f"dataset_type must be one of {DSET_TYPES}, got {dataset_type!r}")
    if dataset_type == DSET_TYPE_T5 and not max_seq_length_dec:
        raise ValueError("T5 data needs max_seq_length_dec (--decoder-seq-length)")
    nums = [int(n) for n in train_valid_test_num_samples]
    if len(nums) != 3 or min(nums) < 0:
        raise ValueError(f"train_valid_test_num_samples must be three counts >= 0, got {train_valid_test_num_samples}")
    kw = dict(max_seq_length=int(max_seq_length), masked_lm_prob=float(masked_lm_prob),
              short_seq_prob=float(short_seq_prob), seed=int(seed), binary_head=bool(binary_head),
              max_seq_length_dec=max_seq_length_dec, tokenizer=tokenizer, data_cache_path=data_cache_path,
              train_num_epochs=train_num_epochs, log=log, cache_timings=cache_timings)
    prefixes, weights = parse_data_path(data_prefix)
    log(f" > building {dataset_type} train, valid, test datasets from {' '.join(prefixes)} with --split {splits_string}")
    if weights is None:
        return tuple(_split_datasets(dataset_type, prefixes[0], splits_string, nums, kw))
    counts = blended_num_samples(weights, nums)  # [prefix][split], each with upstream's 0.5% margin
    parts = [_split_datasets(dataset_type, p, splits_string, c, kw) for p, c in zip(prefixes, counts)]
    _, cache_dir = cache_dirs(prefixes[0], data_cache_path)
    out = []
    for s in range(len(SPLIT_NAMES)):
        kept = [(parts[i][s], weights[i]) for i in range(len(prefixes)) if parts[i][s] is not None]
        size = sum(c[s] for c in counts)
        if not kept or nums[s] == 0:
            out.append(None)
            continue
        datasets, kept_weights = zip(*kept)
        out.append(BlendableDataset(datasets, kept_weights, size, cache_dir=cache_dir, log=log,
                                    cache_timings=cache_timings))
    return tuple(out)
