"""Building blocks of BERT and T5 samples, with Megatron-DeepSpeed's semantics and random draws.

Algorithms of megatron/data/dataset_utils.py (deepspeedai/Megatron-DeepSpeed): `get_a_and_b_segments`,
`truncate_segments`, `create_tokens_and_tokentypes`, `create_masked_lm_predictions`. Every draw from
the per-sample `np.random.RandomState` happens in the same order with the same calls as there, so
a sample equals upstream's for the same sentences and seed (tests/data/test_bert_t5_datasets.py
compares with a transcription of upstream's code).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np


class MaskedSpan(NamedTuple):
    """Positions masked together (one whole-word n-gram) and their original tokens."""

    index: list[int]
    label: list[int]


def get_a_and_b_segments(sample: list[list[int]], np_rng) -> tuple[list[int], list[int], bool]:
    """Sentences [0, a_end) form segment A, the rest B; with probability 0.5 they are swapped
    (BERT's sentence-order prediction target, `is_random`). a_end is 1 for two sentences, else
    drawn uniformly from [1, n)."""
    n = len(sample)
    if n < 2:
        raise ValueError("a BERT sample with a binary head needs at least two sentences")
    a_end = np_rng.randint(1, n) if n >= 3 else 1
    tokens_a = [t for sentence in sample[:a_end] for t in sentence]
    tokens_b = [t for sentence in sample[a_end:] for t in sentence]
    swapped = bool(np_rng.random() < 0.5)
    if swapped:
        tokens_a, tokens_b = tokens_b, tokens_a
    return tokens_a, tokens_b, swapped


def truncate_segments(tokens_a: list, tokens_b: list, max_num_tokens: int, np_rng) -> bool:
    """Shorten A + B in place to max_num_tokens, one token at a time from the longer segment (B on
    ties), from its front or its back with probability 0.5 each. True when anything was cut."""
    len_a, len_b = len(tokens_a), len(tokens_b)
    if len_a == 0:
        raise ValueError("segment A of a BERT sample is empty")
    if len_a + len_b <= max_num_tokens:
        return False
    while len_a + len_b > max_num_tokens:
        if len_a > len_b:
            len_a -= 1
            tokens = tokens_a
        else:
            len_b -= 1
            tokens = tokens_b
        if np_rng.random() < 0.5:
            del tokens[0]
        else:
            tokens.pop()
    return True


def create_tokens_and_tokentypes(tokens_a, tokens_b, cls_id, sep_id) -> tuple[list[int], list[int]]:
    """[CLS] A [SEP] (type 0) then B [SEP] (type 1) when B is not empty."""
    tokens = [cls_id, *tokens_a, sep_id]
    types = [0] * len(tokens)
    if tokens_b:
        tokens += [*tokens_b, sep_id]
        types += [1] * (len(tokens_b) + 1)
    return tokens, types


class MaskingResult(NamedTuple):
    tokens: list[int]          # the input tokens after masking
    positions: list[int]       # masked positions, ascending
    labels: list[int]          # the original token at each masked position
    spans: list[MaskedSpan]    # the masked n-grams, by first position


def _word_starts(tokens, is_continuation, cls_id, sep_id, whole_word: bool) -> list[list[int]]:
    """Candidate units: one per word (a piece and the `##` pieces after it) with whole-word masking,
    else one per token; [CLS]/[SEP] are never candidates. As upstream, a `##` piece right after a
    [SEP] joins the word before the [SEP]."""
    words: list[list[int]] = []
    for i, token in enumerate(tokens):
        if token == cls_id or token == sep_id:
            continue
        if whole_word and words and is_continuation(token):
            words[-1].append(i)
        else:
            words.append([i])
    return words


def create_masked_lm_predictions(tokens, vocab_id_list, is_continuation, masked_lm_prob, cls_id, sep_id, mask_id,
                                 max_predictions_per_seq, np_rng, *, max_ngrams: int = 3, whole_word: bool = True,
                                 favor_longer_ngram: bool = False, geometric_dist: bool = False,
                                 masking_style: str = "bert") -> MaskingResult:
    """Megatron's n-gram masking. `is_continuation(id)`: the token is a `##` piece.

    About masked_lm_prob * len(tokens) positions (at least 1, at most max_predictions_per_seq) are
    masked in whole n-grams of words: the words are visited in a random order, each giving an
    n-gram from that word on, n drawn with p ~ 1/n (BERT) or geometric(0.2) capped at max_ngrams
    (T5); an n-gram that would overshoot shrinks, and one touching masked positions is skipped.
    BERT replaces a masked token by [MASK] 80%, keeps it 10%, a random vocabulary id 10%; T5 always
    by [MASK] (its sentinels replace whole spans later).
    """
    if masking_style not in ("bert", "t5"):
        raise ValueError(f"masking_style must be 'bert' or 't5', got {masking_style!r}")
    output = list(tokens)
    if masked_lm_prob == 0:
        return MaskingResult(output, [], [], [])
    words = _word_starts(tokens, is_continuation, cls_id, sep_id, whole_word)
    # Upstream compares against this float (masked_lm_prob * max_num_tokens is not rounded).
    num_to_predict = min(max_predictions_per_seq, max(1, int(round(len(tokens) * masked_lm_prob))))
    ngrams = np.arange(1, max_ngrams + 1, dtype=np.int64)
    pvals = None
    if not geometric_dist:
        pvals = 1.0 / np.arange(1, max_ngrams + 1)
        pvals /= pvals.sum(keepdims=True)
        if favor_longer_ngram:
            pvals = pvals[::-1]
        pvals = pvals / pvals.sum(keepdims=True)  # what upstream passes to choice() (all n are candidates)
    order = list(range(len(words)))
    np_rng.shuffle(order)  # a list, as upstream shuffles its list of candidate n-grams

    masked: list[tuple[int, int]] = []
    spans: list[MaskedSpan] = []
    covered: set[int] = set()
    for start in order:
        if len(masked) >= num_to_predict:
            break
        if geometric_dist:
            n = min(np_rng.geometric(0.2), max_ngrams)
        else:
            n = np_rng.choice(ngrams, p=pvals)
        # shrink the n-gram until it fits the budget (upstream's loop, down to one word)
        index_set = [i for word in words[start:start + n] for i in word]
        n -= 1
        while len(masked) + len(index_set) > num_to_predict and n != 0:
            index_set = [i for word in words[start:start + n] for i in word]
            n -= 1
        if len(masked) + len(index_set) > num_to_predict or any(i in covered for i in index_set):
            continue
        for index in index_set:
            covered.add(index)
            if masking_style == "t5" or np_rng.random() < 0.8:
                replacement = mask_id
            elif np_rng.random() < 0.5:
                replacement = tokens[index]
            else:
                replacement = vocab_id_list[np_rng.randint(0, len(vocab_id_list))]
            output[index] = replacement
            masked.append((index, tokens[index]))
        spans.append(MaskedSpan(index_set, [tokens[i] for i in index_set]))
    # Upstream shuffles its candidates once more (for an optional permutation step it leaves off);
    # the draw is kept so the generator ends in the same state.
    np_rng.shuffle(list(range(len(words))))
    masked.sort(key=lambda m: m[0])
    spans.sort(key=lambda s: s.index[0])
    return MaskingResult(output, [m[0] for m in masked], [m[1] for m in masked], spans)


def continuation_table(inv_vocab: dict, size: int | None = None) -> np.ndarray:
    """bool per id: the token is a WordPiece continuation (`##...`); ids missing from inv_vocab
    are never continuations."""
    size = (max(inv_vocab) + 1) if size is None else size
    table = np.zeros(size, dtype=bool)
    for i, token in inv_vocab.items():
        table[i] = token.startswith("##")
    return table
