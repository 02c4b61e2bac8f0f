"""BERT pretraining samples: Megatron-DeepSpeed's megatron/data/bert_dataset.py semantics.

`dataset[i]` is built from row i of the (shuffled, cached) samples mapping, a run of whole
sentences of one document, with `np.random.RandomState((seed + i) % 2**32)`:
`[CLS] A [SEP] B [SEP]` (A and B swapped with p 0.5 when the binary head is on; without it all
sentences form A and there is no B), truncated to the row's target length from the longer
segment's front or back, masked (`masking.create_masked_lm_predictions`: whole words, n-grams up
to 3, 80/10/10), padded to max_seq_length. The sample is upstream's dict:
`text types labels loss_mask padding_mask` (int64 arrays of max_seq_length; labels -1 where not
masked), `is_random` and `truncated` (ints).
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from megatron_ds.data import masking
from megatron_ds.data.index_cache import CacheTimings, mmap_restore, mmap_state
from megatron_ds.data.samples_mapping import get_samples_mapping
from megatron_ds.errors import ConfigError, DataError


def pad_and_convert_to_numpy(tokens, tokentypes, masked_positions, masked_labels, pad_id, max_seq_length):
    """(tokens, types, labels, padding_mask, loss_mask), int64 arrays of max_seq_length."""
    num_tokens = len(tokens)
    padding = max_seq_length - num_tokens
    if padding < 0:
        raise ValueError(f"a sample of {num_tokens} tokens does not fit max_seq_length {max_seq_length}")
    tokens_np = np.full(max_seq_length, pad_id, dtype=np.int64)
    tokens_np[:num_tokens] = tokens
    types_np = np.full(max_seq_length, pad_id, dtype=np.int64)  # upstream pads the types with pad_id too
    types_np[:num_tokens] = tokentypes
    padding_mask = np.zeros(max_seq_length, dtype=np.int64)
    padding_mask[:num_tokens] = 1
    labels = np.full(max_seq_length, -1, dtype=np.int64)
    loss_mask = np.zeros(max_seq_length, dtype=np.int64)
    if masked_positions:
        labels[masked_positions] = masked_labels
        loss_mask[masked_positions] = 1
    return tokens_np, types_np, labels, padding_mask, loss_mask


def build_training_sample(sample, target_seq_length, max_seq_length, vocab_id_list, is_continuation, cls_id, sep_id,
                          mask_id, pad_id, masked_lm_prob, np_rng, binary_head) -> dict:
    """One BERT sample from `sample` (a list of sentences, each a list of token ids)."""
    if target_seq_length > max_seq_length:
        raise ValueError(f"target length {target_seq_length} exceeds max_seq_length {max_seq_length}")
    if binary_head:
        tokens_a, tokens_b, is_random = masking.get_a_and_b_segments(sample, np_rng)
    else:
        tokens_a, tokens_b, is_random = [t for s in sample for t in s], [], False
    max_num_tokens = target_seq_length
    truncated = masking.truncate_segments(tokens_a, tokens_b, max_num_tokens, np_rng)
    tokens, tokentypes = masking.create_tokens_and_tokentypes(tokens_a, tokens_b, cls_id, sep_id)
    result = masking.create_masked_lm_predictions(
        tokens, vocab_id_list, is_continuation, masked_lm_prob, cls_id, sep_id, mask_id,
        masked_lm_prob * max_num_tokens, np_rng)
    text, types, labels, padding_mask, loss_mask = pad_and_convert_to_numpy(
        result.tokens, tokentypes, result.positions, result.labels, pad_id, max_seq_length)
    return {"text": text, "types": types, "labels": labels, "is_random": int(is_random), "loss_mask": loss_mask,
            "padding_mask": padding_mask, "truncated": int(truncated)}


class TokenizerIds:
    """What the samples need from a tokenizer (Megatron's BERT WordPiece tokenizer's attributes):
    the special ids, the id list random replacements draw from (inv_vocab's keys, in order) and
    which ids are `##` continuations."""

    def __init__(self, tokenizer, source: str = "this data set"):
        self.source = source
        missing = [a for a in ("cls", "sep", "mask", "pad") if not hasattr(tokenizer, a)]
        if missing:
            raise ConfigError(f"the {getattr(tokenizer, 'name', type(tokenizer).__name__)} tokenizer has no "
                              f"{', '.join(missing)} id; BERT/T5 data needs --tokenizer-type BertWordPieceLowerCase, "
                              f"BertWordPieceCase or SentencePieceTokenizer")
        inv = tokenizer.inv_vocab
        self.vocab_id_list = list(inv.keys())
        self.table = masking.continuation_table(inv)
        self.cls, self.sep, self.mask, self.pad = tokenizer.cls, tokenizer.sep, tokenizer.mask, tokenizer.pad
        self.bos = getattr(tokenizer, "bos_token_id", None)
        self.eos = getattr(tokenizer, "eos_token_id", None)
        self.sentinels = list(getattr(tokenizer, "additional_special_tokens_ids", []))

    def is_continuation(self, token) -> bool:
        # the first look-up of every token (masking asks before anything else indexes by it): data made
        # with another tokenizer fails here in one line instead of an IndexError inside the sampler
        if not 0 <= token < len(self.table):
            raise DataError(f"token id {token} is outside the tokenizer's vocabulary ({len(self.table)} ids) in "
                            f"data set {self.source}: was it preprocessed with another tokenizer?")
        return bool(self.table[token])


class BertDataset(torch.utils.data.Dataset):
    """BERT samples over the documents `doc_bounds` (a slice of the indexed dataset's doc_idx:
    document d is sentences [doc_bounds[d], doc_bounds[d + 1]))."""

    def __init__(self, name: str, indexed_dataset, data_prefix: str, doc_bounds, num_samples: int,
                 masked_lm_prob: float, max_seq_length: int, short_seq_prob: float, seed: int, binary_head: bool,
                 tokenizer, *, num_epochs: int | None = None, data_cache_path: str | None = None,
                 log: Callable[[str], None] = print, cache_timings: CacheTimings = CacheTimings()):
        self.name, self.seed, self.masked_lm_prob = name, int(seed), float(masked_lm_prob)
        self.max_seq_length, self.binary_head = int(max_seq_length), bool(binary_head)
        self.indexed_dataset = indexed_dataset
        self.ids = TokenizerIds(tokenizer, data_prefix)
        self.samples_mapping = get_samples_mapping(
            indexed_dataset, data_prefix, doc_bounds, name, num_epochs=num_epochs, max_num_samples=num_samples,
            max_seq_length=self.max_seq_length - 3,  # room for [CLS] and two [SEP]
            short_seq_prob=short_seq_prob, seed=self.seed, min_num_sent=2 if binary_head else 1,
            data_cache_path=data_cache_path, log=log, cache_timings=cache_timings)
        # what a blend of this dataset is keyed by (BlendableDataset's cache description)
        self.desc = (f"BertDataset {name} of {data_prefix}: sentences [{int(doc_bounds[0])}, {int(doc_bounds[-1])}), "
                     f"{len(self)} samples, length {self.max_seq_length}, mask prob {self.masked_lm_prob!r}, "
                     f"short seq prob {float(short_seq_prob)!r}, seed {self.seed}, binary head: {self.binary_head}")

    def __len__(self) -> int:
        return self.samples_mapping.shape[0]

    def sentences(self, idx: int) -> tuple[list[list[int]], int]:
        start, end, target = (int(v) for v in self.samples_mapping[idx])
        return [self.indexed_dataset[i].tolist() for i in range(start, end)], target

    def __getitem__(self, idx) -> dict:
        sample, target = self.sentences(idx)
        np_rng = np.random.RandomState(seed=(self.seed + int(idx)) % 2**32)
        ids = self.ids
        return build_training_sample(sample, target, self.max_seq_length, ids.vocab_id_list, ids.is_continuation,
                                     ids.cls, ids.sep, ids.mask, ids.pad, self.masked_lm_prob, np_rng,
                                     self.binary_head)

    def __getstate__(self):
        return mmap_state(self.__dict__)

    def __setstate__(self, state):
        self.__dict__.update(mmap_restore(state))
