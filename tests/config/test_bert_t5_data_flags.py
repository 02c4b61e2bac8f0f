"""The BERT/T5 data flags of Megatron-DeepSpeed's megatron/arguments.py _add_data_args: accepted with
upstream's defaults (--mask-prob 0.15, --short-seq-prob 0.1, --vocab-extra-ids 0), --encoder-seq-length as
validate_args treats it (it becomes --seq-length), range-checked in one line."""
from __future__ import annotations

import pytest

from megatron_ds.config import parse_args
from megatron_ds.config.validation import check_ranges, missing_flags
from megatron_ds.errors import ConfigError


def test_defaults_are_megatron_deepspeeds():
    cfg, _ = parse_args([])
    assert (cfg.masked_lm.mask_prob, cfg.masked_lm.short_seq_prob, cfg.masked_lm.vocab_extra_ids,
            cfg.masked_lm.decoder_seq_length) == (0.15, 0.1, 0, None)


def test_t5_script_flags():
    # examples/pretrain_t5.sh style
    cfg, ignored = parse_args(["--encoder-seq-length", "512", "--decoder-seq-length", "128", "--vocab-extra-ids",
                               "100", "--mask-prob", "0.2", "--short-seq-prob", "0.05", "--tokenizer-type",
                               "BertWordPieceCase", "--vocab-file", "vocab.txt"])
    assert not ignored
    assert cfg.model.seq_length == 512 and cfg.masked_lm.decoder_seq_length == 128
    assert (cfg.masked_lm.vocab_extra_ids, cfg.masked_lm.mask_prob, cfg.masked_lm.short_seq_prob) == (100, 0.2, 0.05)
    assert cfg.data.tokenizer_type == "BertWordPieceCase"


@pytest.mark.parametrize("argv,message", [
    (["--mask-prob", "1.5"], "--mask-prob 1.5 is out of range"),
    (["--short-seq-prob", "-0.1"], "--short-seq-prob -0.1 is out of range"),
    (["--vocab-extra-ids", "-1"], "--vocab-extra-ids -1 is out of range"),
    (["--decoder-seq-length", "0"], "--decoder-seq-length 0 is out of range"),
])
def test_out_of_range_is_one_line(argv, message):
    cfg, _ = parse_args(argv)
    with pytest.raises(ConfigError, match=message):
        check_ranges(cfg)


def test_bert_tokenizer_needs_its_vocab_file():
    cfg, _ = parse_args(["--tokenizer-type", "BertWordPieceLowerCase"])
    assert "--vocab-file (a BERT vocab.txt, for BertWordPieceLowerCase)" in missing_flags(cfg)
