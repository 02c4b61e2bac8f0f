"""Test-only transcription of Megatron-DeepSpeed's BERT/T5 sampling code (deepspeedai/Megatron-DeepSpeed,
commit 4efb479): megatron/data/helpers.cpp `build_mapping` (with `get_target_sample_len`),
megatron/data/dataset_utils.py `get_a_and_b_segments`, `truncate_segments`,
`create_tokens_and_tokentypes`, `create_masked_lm_predictions`, `pad_and_convert_to_numpy`,
megatron/data/bert_dataset.py `build_training_sample`, megatron/data/t5_dataset.py
`build_training_sample`, `pad_and_convert_to_numpy`, `make_attention_mask`, `make_history_mask`.

Written from upstream's code, loop for loop, with nothing from megatron_ds: the C++ random engines
(std::mt19937, std::mt19937_64) are written out here in plain Python (test_mersenne_twisters checks
them against the C++ standard's required 10000th outputs). It is slow and only for small inputs.
"""
from __future__ import annotations

import collections

import numpy as np

# ---------------------------------------------------------------------------------------------
# C++ <random> engines


class MT19937:
    """std::mt19937 (32-bit Mersenne Twister), seeded as the std::mt19937(seed) constructor."""

    def __init__(self, seed):
        self.mt = [0] * 624
        self.mt[0] = seed & 0xFFFFFFFF
        for i in range(1, 624):
            self.mt[i] = (1812433253 * (self.mt[i - 1] ^ (self.mt[i - 1] >> 30)) + i) & 0xFFFFFFFF
        self.index = 624

    def __call__(self):
        if self.index >= 624:
            for i in range(624):
                y = (self.mt[i] & 0x80000000) | (self.mt[(i + 1) % 624] & 0x7FFFFFFF)
                v = self.mt[(i + 397) % 624] ^ (y >> 1)
                if y & 1:
                    v ^= 0x9908B0DF
                self.mt[i] = v
            self.index = 0
        y = self.mt[self.index]
        self.index += 1
        y ^= y >> 11
        y ^= (y << 7) & 0x9D2C5680
        y ^= (y << 15) & 0xEFC60000
        y ^= y >> 18
        return y & 0xFFFFFFFF


class MT19937_64:
    """std::mt19937_64, seeded as its constructor."""

    def __init__(self, seed):
        mask = (1 << 64) - 1
        self.mt = [0] * 312
        self.mt[0] = seed & mask
        for i in range(1, 312):
            self.mt[i] = (6364136223846793005 * (self.mt[i - 1] ^ (self.mt[i - 1] >> 62)) + i) & mask
        self.index = 312

    def __call__(self):
        mask = (1 << 64) - 1
        if self.index >= 312:
            for i in range(312):
                x = (self.mt[i] & 0xFFFFFFFF80000000) | (self.mt[(i + 1) % 312] & 0x7FFFFFFF)
                xa = x >> 1
                if x & 1:
                    xa ^= 0xB5026F5AA96619E9
                self.mt[i] = self.mt[(i + 156) % 312] ^ xa
            self.index = 0
        x = self.mt[self.index]
        self.index += 1
        x ^= (x >> 29) & 0x5555555555555555
        x ^= (x << 17) & 0x71D67FFFEDA60000
        x ^= (x << 37) & 0xFFF7EEE000000000
        x ^= x >> 43
        return x & mask


# ---------------------------------------------------------------------------------------------
# helpers.cpp

LONG_SENTENCE_LEN = 512


def get_target_sample_len(short_seq_ratio, max_length, rand32_gen):
    if short_seq_ratio == 0:
        return max_length
    random_number = rand32_gen()
    if (random_number % short_seq_ratio) == 0:
        return 2 + random_number % (max_length - 1)
    return max_length


def build_mapping(docs, sizes, num_epochs, max_num_samples, max_seq_length, short_seq_prob, seed, min_num_sent):
    """build_mapping_impl: both passes, then the shuffle (uint32 rows, as for < 2^32 sentences)."""
    short_seq_ratio = 0
    if short_seq_prob > 0:
        x = 1.0 / short_seq_prob  # C round(): halves away from zero
        short_seq_ratio = int(np.floor(x + 0.5))
    maps = None
    num_samples = -1
    for iteration in range(2):
        rand32_gen = MT19937(seed)
        second = iteration == 1
        map_index = 0
        for epoch in range(num_epochs):
            if map_index >= max_num_samples:
                break
            for doc in range(len(docs) - 1):
                sent_index_first = docs[doc]
                sent_index_last = docs[doc + 1]
                prev_start_index = sent_index_first
                num_remain_sent = sent_index_last - sent_index_first
                contains_long_sentence = False
                if num_remain_sent > 1:
                    for sent_index in range(sent_index_first, sent_index_last):
                        if sizes[sent_index] > LONG_SENTENCE_LEN:
                            contains_long_sentence = True
                            break
                if num_remain_sent >= min_num_sent and not contains_long_sentence:
                    seq_len = 0
                    num_sent = 0
                    target_seq_len = get_target_sample_len(short_seq_ratio, max_seq_length, rand32_gen)
                    for sent_index in range(sent_index_first, sent_index_last):
                        seq_len += sizes[sent_index]
                        num_sent += 1
                        num_remain_sent -= 1
                        if ((seq_len >= target_seq_len and num_remain_sent > 1 and num_sent >= min_num_sent)
                                or num_remain_sent == 0):
                            if second:
                                maps[map_index] = [prev_start_index, sent_index + 1, target_seq_len]
                            map_index += 1
                            prev_start_index = sent_index + 1
                            target_seq_len = get_target_sample_len(short_seq_ratio, max_seq_length, rand32_gen)
                            seq_len = 0
                            num_sent = 0
            if epoch == 0 and map_index == 0:
                break  # upstream would spin through ~2^31 empty epochs; megatron_ds refuses instead
        if not second:
            maps = [None] * map_index
            num_samples = map_index
    rand64_gen = MT19937_64(seed + 1)
    for i in range(num_samples - 1, 0, -1):
        j = rand64_gen() % (i + 1)
        maps[i], maps[j] = maps[j], maps[i]
    return np.array(maps, dtype=np.uint32).reshape(-1, 3)


# ---------------------------------------------------------------------------------------------
# dataset_utils.py


def get_a_and_b_segments(sample, np_rng):
    n_sentences = len(sample)
    assert n_sentences > 1
    a_end = 1
    if n_sentences >= 3:
        a_end = np_rng.randint(1, n_sentences)
    tokens_a = []
    for j in range(a_end):
        tokens_a.extend(sample[j])
    tokens_b = []
    for j in range(a_end, n_sentences):
        tokens_b.extend(sample[j])
    is_next_random = False
    if np_rng.random() < 0.5:
        is_next_random = True
        tokens_a, tokens_b = tokens_b, tokens_a
    return tokens_a, tokens_b, is_next_random


def truncate_segments(tokens_a, tokens_b, len_a, len_b, max_num_tokens, np_rng):
    assert len_a > 0
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


def create_tokens_and_tokentypes(tokens_a, tokens_b, cls_id, sep_id):
    tokens = [cls_id]
    tokentypes = [0]
    for token in tokens_a:
        tokens.append(token)
        tokentypes.append(0)
    tokens.append(sep_id)
    tokentypes.append(0)
    for token in tokens_b:
        tokens.append(token)
        tokentypes.append(1)
    if tokens_b:
        tokens.append(sep_id)
        tokentypes.append(1)
    return tokens, tokentypes


MaskedLmInstance = collections.namedtuple("MaskedLmInstance", ["index", "label"])


def is_start_piece(piece):
    return not piece.startswith("##")


def create_masked_lm_predictions(tokens, vocab_id_list, vocab_id_to_token_dict, masked_lm_prob, cls_id, sep_id,
                                 mask_id, max_predictions_per_seq, np_rng, max_ngrams=3, do_whole_word_mask=True,
                                 favor_longer_ngram=False, geometric_dist=False, masking_style="bert"):
    cand_indexes = []
    for (i, token) in enumerate(tokens):
        if token == cls_id or token == sep_id:
            continue
        if (do_whole_word_mask and len(cand_indexes) >= 1 and not is_start_piece(vocab_id_to_token_dict[token])):
            cand_indexes[-1].append(i)
        else:
            cand_indexes.append([i])
    output_tokens = list(tokens)
    masked_lm_positions = []
    masked_lm_labels = []
    if masked_lm_prob == 0:
        return output_tokens, masked_lm_positions, masked_lm_labels, None
    num_to_predict = min(max_predictions_per_seq, max(1, int(round(len(tokens) * masked_lm_prob))))
    ngrams = np.arange(1, max_ngrams + 1, dtype=np.int64)
    if not geometric_dist:
        pvals = 1. / np.arange(1, max_ngrams + 1)
        pvals /= pvals.sum(keepdims=True)
        if favor_longer_ngram:
            pvals = pvals[::-1]
    ngram_indexes = []
    for idx in range(len(cand_indexes)):
        ngram_index = []
        for n in ngrams:
            ngram_index.append(cand_indexes[idx:idx + n])
        ngram_indexes.append(ngram_index)
    np_rng.shuffle(ngram_indexes)
    (masked_lms, masked_spans) = ([], [])
    covered_indexes = set()
    for cand_index_set in ngram_indexes:
        if len(masked_lms) >= num_to_predict:
            break
        if not cand_index_set:
            continue
        if not geometric_dist:
            n = np_rng.choice(ngrams[:len(cand_index_set)],
                              p=pvals[:len(cand_index_set)] / pvals[:len(cand_index_set)].sum(keepdims=True))
        else:
            n = min(np_rng.geometric(0.2), max_ngrams)
        index_set = sum(cand_index_set[n - 1], [])
        n -= 1
        while len(masked_lms) + len(index_set) > num_to_predict:
            if n == 0:
                break
            index_set = sum(cand_index_set[n - 1], [])
            n -= 1
        if len(masked_lms) + len(index_set) > num_to_predict:
            continue
        is_any_index_covered = False
        for index in index_set:
            if index in covered_indexes:
                is_any_index_covered = True
                break
        if is_any_index_covered:
            continue
        for index in index_set:
            covered_indexes.add(index)
            masked_token = None
            if masking_style == "bert":
                if np_rng.random() < 0.8:
                    masked_token = mask_id
                else:
                    if np_rng.random() < 0.5:
                        masked_token = tokens[index]
                    else:
                        masked_token = vocab_id_list[np_rng.randint(0, len(vocab_id_list))]
            elif masking_style == "t5":
                masked_token = mask_id
            output_tokens[index] = masked_token
            masked_lms.append(MaskedLmInstance(index=index, label=tokens[index]))
        masked_spans.append(MaskedLmInstance(index=index_set, label=[tokens[index] for index in index_set]))
    assert len(masked_lms) <= num_to_predict
    np_rng.shuffle(ngram_indexes)
    masked_lms = sorted(masked_lms, key=lambda x: x.index)
    masked_spans = sorted(masked_spans, key=lambda x: x.index[0])
    for p in masked_lms:
        masked_lm_positions.append(p.index)
        masked_lm_labels.append(p.label)
    return output_tokens, masked_lm_positions, masked_lm_labels, masked_spans


def bert_pad_and_convert_to_numpy(tokens, tokentypes, masked_positions, masked_labels, pad_id, max_seq_length):
    num_tokens = len(tokens)
    padding_length = max_seq_length - num_tokens
    assert padding_length >= 0
    filler = [pad_id] * padding_length
    tokens_np = np.array(tokens + filler, dtype=np.int64)
    tokentypes_np = np.array(tokentypes + filler, dtype=np.int64)
    padding_mask_np = np.array([1] * num_tokens + [0] * padding_length, dtype=np.int64)
    labels = [-1] * max_seq_length
    loss_mask = [0] * max_seq_length
    for i in range(len(masked_positions)):
        labels[masked_positions[i]] = masked_labels[i]
        loss_mask[masked_positions[i]] = 1
    return (tokens_np, tokentypes_np, np.array(labels, dtype=np.int64), padding_mask_np,
            np.array(loss_mask, dtype=np.int64))


# ---------------------------------------------------------------------------------------------
# bert_dataset.py / t5_dataset.py


def bert_training_sample(sample, target_seq_length, max_seq_length, vocab_id_list, vocab_id_to_token_dict, cls_id,
                         sep_id, mask_id, pad_id, masked_lm_prob, np_rng, binary_head):
    if binary_head:
        tokens_a, tokens_b, is_next_random = get_a_and_b_segments(sample, np_rng)
    else:
        tokens_a = []
        for j in range(len(sample)):
            tokens_a.extend(sample[j])
        tokens_b = []
        is_next_random = False
    max_num_tokens = target_seq_length
    truncated = truncate_segments(tokens_a, tokens_b, len(tokens_a), len(tokens_b), max_num_tokens, np_rng)
    tokens, tokentypes = create_tokens_and_tokentypes(tokens_a, tokens_b, cls_id, sep_id)
    max_predictions_per_seq = masked_lm_prob * max_num_tokens
    (tokens, masked_positions, masked_labels, _) = create_masked_lm_predictions(
        tokens, vocab_id_list, vocab_id_to_token_dict, masked_lm_prob, cls_id, sep_id, mask_id,
        max_predictions_per_seq, np_rng)
    tokens_np, tokentypes_np, labels_np, padding_mask_np, loss_mask_np = bert_pad_and_convert_to_numpy(
        tokens, tokentypes, masked_positions, masked_labels, pad_id, max_seq_length)
    return {"text": tokens_np, "types": tokentypes_np, "labels": labels_np, "is_random": int(is_next_random),
            "loss_mask": loss_mask_np, "padding_mask": padding_mask_np, "truncated": int(truncated)}


def make_attention_mask(source_block, target_block):
    mask = (target_block[None, :] >= 1) * (source_block[:, None] >= 1)
    return mask.astype(np.int64)


def make_history_mask(block):
    length = block.shape[0]
    arange = np.arange(length)
    history_mask = (arange[None, ] <= arange[:, None])
    return history_mask.astype(np.int64)


def t5_pad_and_convert_to_numpy(tokens, masked_positions, masked_labels, pad_id, max_seq_length, max_seq_length_dec,
                                masked_spans=None, bos_id=None, eos_id=None, sentinel_tokens=None):
    sentinel_tokens = collections.deque(sentinel_tokens)
    t5_input = []
    (t5_decoder_in, t5_decoder_out) = ([bos_id], [])
    (start_index, end_index) = (0, None)
    for span in masked_spans:
        flag = sentinel_tokens.popleft()
        t5_decoder_in.append(flag)
        t5_decoder_in.extend(span.label)
        t5_decoder_out.append(flag)
        t5_decoder_out.extend(span.label)
        end_index = span.index[0]
        t5_input.extend(tokens[start_index: end_index])
        t5_input.append(flag)
        start_index = span.index[-1] + 1
    t5_decoder_out.append(eos_id)
    t5_input.extend(tokens[start_index:])
    num_tokens = len(t5_input)
    padding_length = max_seq_length - num_tokens
    assert padding_length >= 0
    filler = [pad_id] * padding_length
    tokens_enc = np.array(t5_input + filler, dtype=np.int64)
    num_tokens_dec = len(t5_decoder_in)
    padding_length_dec = max_seq_length_dec - num_tokens_dec
    assert padding_length_dec >= 0
    filler_dec = [pad_id] * padding_length_dec
    tokens_dec_in = np.array(t5_decoder_in + filler_dec, dtype=np.int64)
    enc_mask = make_attention_mask(tokens_enc, tokens_enc)
    enc_dec_mask = make_attention_mask(tokens_dec_in, tokens_enc)
    dec_mask = make_attention_mask(tokens_dec_in, tokens_dec_in)
    dec_mask = dec_mask * make_history_mask(tokens_dec_in)
    labels = np.array(t5_decoder_out + ([-1] * padding_length_dec), dtype=np.int64)
    loss_mask = np.array(([1] * num_tokens_dec) + ([0] * padding_length_dec), dtype=np.int64)
    return tokens_enc, tokens_dec_in, labels, enc_mask, dec_mask, enc_dec_mask, loss_mask


def t5_training_sample(sample, target_seq_length, max_seq_length, max_seq_length_dec, vocab_id_list,
                       vocab_id_to_token_dict, cls_id, sep_id, mask_id, pad_id, masked_lm_prob, np_rng, bos_id=None,
                       eos_id=None, sentinel_tokens=None):
    tokens = [token for sentence in sample for token in sentence]
    max_num_tokens = target_seq_length
    truncated = len(tokens) > max_num_tokens
    tokens = tokens[:max_num_tokens]
    max_predictions_per_seq = masked_lm_prob * max_num_tokens
    (tokens, masked_positions, masked_labels, masked_spans) = create_masked_lm_predictions(
        tokens, vocab_id_list, vocab_id_to_token_dict, masked_lm_prob, cls_id, sep_id, mask_id,
        max_predictions_per_seq, np_rng, max_ngrams=10, geometric_dist=True, masking_style="t5")
    tokens_enc, tokens_dec_in, labels, enc_mask, dec_mask, enc_dec_mask, loss_mask = t5_pad_and_convert_to_numpy(
        tokens, masked_positions, masked_labels, pad_id, max_seq_length, max_seq_length_dec, masked_spans,
        bos_id, eos_id, sentinel_tokens)
    return {"text_enc": tokens_enc, "text_dec": tokens_dec_in, "labels": labels, "loss_mask": loss_mask,
            "truncated": int(truncated), "enc_mask": enc_mask, "dec_mask": dec_mask, "enc_dec_mask": enc_dec_mask}


def get_train_valid_test_split_(splits_string, size):
    """dataset_utils.py: document bounds [0, a, b, size] for '949,50,1'."""
    if splits_string.find(",") != -1:
        splits = [float(s) for s in splits_string.split(",")]
    elif splits_string.find("/") != -1:
        splits = [float(s) for s in splits_string.split("/")]
    else:
        splits = [float(splits_string)]
    while len(splits) < 3:
        splits.append(0.)
    splits = splits[:3]
    splits_sum = sum(splits)
    splits = [split / splits_sum for split in splits]
    splits_index = [0]
    for index, split in enumerate(splits):
        splits_index.append(splits_index[index] + int(round(split * float(size))))
    diff = splits_index[-1] - size
    for index in range(1, len(splits_index)):
        splits_index[index] -= diff
    return splits_index


def megatron_bert_vocab(vocab_file, vocab_extra_ids=0):
    """_BertWordPieceTokenizer's vocabulary: the file's, then [BOS], [EOS] and the sentinels appended
    by add_token (a new id = len(vocab)). Returns (vocab, inv_vocab, bos, eos, sentinel ids)."""
    from tests.data.bert_tokenization_reference import load_vocab

    vocab = load_vocab(vocab_file)
    inv_vocab = {v: k for k, v in vocab.items()}

    def add_token(token):
        if token not in vocab:
            inv_vocab[len(vocab)] = token
            vocab[token] = len(vocab)

    for token in ["[BOS]", "[EOS]"] + ["<extra_id_{}>".format(i) for i in range(vocab_extra_ids)]:
        add_token(token)
    sentinels = [vocab["<extra_id_{}>".format(i)] for i in range(vocab_extra_ids)]
    return vocab, inv_vocab, vocab["[BOS]"], vocab["[EOS]"], sentinels
