"""T5 span-corruption samples: Megatron-DeepSpeed's megatron/data/t5_dataset.py semantics.

`dataset[i]` takes row i of the samples mapping (whole sentences of one document), flattens the
sentences, cuts them to the row's target length, and masks spans with
`np.random.RandomState((seed + i) % 2**32)` (`masking.create_masked_lm_predictions`, T5 style:
whole words, n-grams of geometric(0.2) length capped at 10). Each masked span becomes one
sentinel (`<extra_id_k>`, in order) in the encoder input; the decoder input is
`[BOS] s_0 span_0 s_1 span_1 ...` and the labels the same shifted by one and ended by `[EOS]`.
The sample is upstream's dict: `text_enc` (encoder_seq_length), `text_dec`, `labels`, `loss_mask`
(decoder_seq_length), `enc_mask`, `dec_mask` (with the causal mask), `enc_dec_mask`: int64 [0/1]
attention masks (query, key) where both tokens are not padding (ids >= 1, as upstream assumes
[PAD] is id 0), and `truncated` (int).
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from megatron_ds.data import masking
from megatron_ds.data.bert_dataset import TokenizerIds
from megatron_ds.data.index_cache import CacheTimings, mmap_restore, mmap_state
from megatron_ds.data.samples_mapping import get_samples_mapping
from megatron_ds.errors import ConfigError

MAX_NGRAMS = 10  # upstream's span-length cap for T5


def make_attention_mask(source_block: np.ndarray, target_block: np.ndarray) -> np.ndarray:
    """[len(source), len(target)] int64: 1 where both tokens are real (id >= 1)."""
    return ((source_block[:, None] >= 1) & (target_block[None, :] >= 1)).astype(np.int64)


def make_history_mask(block: np.ndarray) -> np.ndarray:
    """[n, n] int64 lower triangle: a decoder position sees itself and earlier ones."""
    return np.tril(np.ones((block.shape[0], block.shape[0]), dtype=np.int64))


def pad_and_convert_to_numpy(tokens, masked_spans, pad_id, max_seq_length, max_seq_length_dec, bos_id, eos_id,
                             sentinel_tokens):
    """(text_enc, text_dec, labels, enc_mask, dec_mask, enc_dec_mask, loss_mask) for one sample."""
    if len(masked_spans) > len(sentinel_tokens):
        raise ValueError(f"{len(masked_spans)} masked spans but only {len(sentinel_tokens)} sentinel tokens; "
                         "raise --vocab-extra-ids (T5 uses 100)")
    enc, dec_in, dec_out, start = [], [bos_id], [], 0
    for span, sentinel in zip(masked_spans, sentinel_tokens):
        dec_in += [sentinel, *span.label]
        dec_out += [sentinel, *span.label]
        enc += [*tokens[start:span.index[0]], sentinel]
        start = span.index[-1] + 1
    dec_out.append(eos_id)
    enc += tokens[start:]
    if len(enc) > max_seq_length or len(dec_in) > max_seq_length_dec:
        raise ValueError(f"a T5 sample of {len(enc)} encoder / {len(dec_in)} decoder tokens does not fit "
                         f"{max_seq_length} / {max_seq_length_dec}; raise --decoder-seq-length")
    text_enc = np.full(max_seq_length, pad_id, dtype=np.int64)
    text_enc[:len(enc)] = enc
    text_dec = np.full(max_seq_length_dec, pad_id, dtype=np.int64)
    text_dec[:len(dec_in)] = dec_in
    enc_mask = make_attention_mask(text_enc, text_enc)
    enc_dec_mask = make_attention_mask(text_dec, text_enc)
    dec_mask = make_attention_mask(text_dec, text_dec) * make_history_mask(text_dec)
    labels = np.full(max_seq_length_dec, -1, dtype=np.int64)
    labels[:len(dec_out)] = dec_out
    loss_mask = np.zeros(max_seq_length_dec, dtype=np.int64)
    loss_mask[:len(dec_in)] = 1  # upstream counts the decoder inputs (as many as the labels)
    return text_enc, text_dec, labels, enc_mask, dec_mask, enc_dec_mask, loss_mask


def build_training_sample(sample, target_seq_length, max_seq_length, max_seq_length_dec, vocab_id_list,
                          is_continuation, cls_id, sep_id, mask_id, pad_id, masked_lm_prob, np_rng, bos_id, eos_id,
                          sentinel_tokens) -> dict:
    """One T5 sample from `sample` (a list of sentences, each a list of token ids)."""
    if target_seq_length > max_seq_length:
        raise ValueError(f"target length {target_seq_length} exceeds max_seq_length {max_seq_length}")
    tokens = [t for sentence in sample for t in sentence]
    max_num_tokens = target_seq_length
    truncated = len(tokens) > max_num_tokens
    tokens = tokens[:max_num_tokens]
    result = masking.create_masked_lm_predictions(
        tokens, vocab_id_list, is_continuation, masked_lm_prob, cls_id, sep_id, mask_id,
        masked_lm_prob * max_num_tokens, np_rng, max_ngrams=MAX_NGRAMS, geometric_dist=True, masking_style="t5")
    text_enc, text_dec, labels, enc_mask, dec_mask, enc_dec_mask, loss_mask = pad_and_convert_to_numpy(
        result.tokens, result.spans, pad_id, max_seq_length, max_seq_length_dec, bos_id, eos_id, sentinel_tokens)
    return {"text_enc": text_enc, "text_dec": text_dec, "labels": labels, "loss_mask": loss_mask,
            "truncated": int(truncated), "enc_mask": enc_mask, "dec_mask": dec_mask, "enc_dec_mask": enc_dec_mask}


class T5Dataset(torch.utils.data.Dataset):
    """T5 samples over the documents `doc_bounds` (a slice of the indexed dataset's doc_idx)."""

    def __init__(self, name: str, indexed_dataset, data_prefix: str, doc_bounds, num_samples: int,
                 masked_lm_prob: float, max_seq_length: int, max_seq_length_dec: int, short_seq_prob: float,
                 seed: int, tokenizer, *, num_epochs: int | None = None, data_cache_path: str | None = None,
                 log: Callable[[str], None] = print, cache_timings: CacheTimings = CacheTimings()):
        self.name, self.seed, self.masked_lm_prob = name, int(seed), float(masked_lm_prob)
        self.max_seq_length, self.max_seq_length_dec = int(max_seq_length), int(max_seq_length_dec)
        self.indexed_dataset = indexed_dataset
        self.ids = TokenizerIds(tokenizer, data_prefix)
        if not self.ids.sentinels:
            raise ConfigError("T5 data needs sentinel tokens: pass --vocab-extra-ids 100")
        if self.ids.bos is None or self.ids.eos is None:
            raise ConfigError("T5 data needs a tokenizer with [BOS] and [EOS] (BertWordPieceLowerCase/Case)")
        self.samples_mapping = get_samples_mapping(
            indexed_dataset, data_prefix, doc_bounds, name, num_epochs=num_epochs, max_num_samples=num_samples,
            max_seq_length=self.max_seq_length - 2,  # upstream leaves room for two added tokens
            short_seq_prob=short_seq_prob, seed=self.seed, min_num_sent=1,
            data_cache_path=data_cache_path, log=log, cache_timings=cache_timings)
        # what a blend of this dataset is keyed by (BlendableDataset's cache description)
        self.desc = (f"T5Dataset {name} of {data_prefix}: sentences [{int(doc_bounds[0])}, {int(doc_bounds[-1])}), "
                     f"{len(self)} samples, length {self.max_seq_length}, mask prob {self.masked_lm_prob!r}, "
                     f"short seq prob {float(short_seq_prob)!r}, seed {self.seed}, decoder length: {self.max_seq_length_dec}")

    def __len__(self) -> int:
        return self.samples_mapping.shape[0]

    def __getitem__(self, idx) -> dict:
        start, end, target = (int(v) for v in self.samples_mapping[idx])
        sample = [self.indexed_dataset[i].tolist() for i in range(start, end)]
        np_rng = np.random.RandomState(seed=(self.seed + int(idx)) % 2**32)
        ids = self.ids
        return build_training_sample(sample, target, self.max_seq_length, self.max_seq_length_dec,
                                     ids.vocab_id_list, ids.is_continuation, ids.cls, ids.sep, ids.mask, ids.pad,
                                     self.masked_lm_prob, np_rng, ids.bos, ids.eos, ids.sentinels)

    def __getstate__(self):
        return mmap_state(self.__dict__)

    def __setstate__(self, state):
        self.__dict__.update(mmap_restore(state))
