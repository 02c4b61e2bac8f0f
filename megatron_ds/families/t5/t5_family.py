"""The T5 model family: ``T5``, the ``ModelFamily`` (``config/family.py``) pretrain_t5.py gives the
shared training stack -- model builders, datasets and micro-batches here, its parameter count, checks,
memory terms and pipeline split (``t5_params.py``), FLOPs (``t5_flops.py``), the layer specs its
checkpoints follow (``t5_model.py``).

Samples are Megatron-DeepSpeed's T5 samples (megatron/data/t5_dataset.py ``build_training_sample``:
``text_enc, text_dec, labels, loss_mask, truncated, enc_mask, dec_mask, enc_dec_mask``). The
collator turns a batch of them into DeepSpeed's micro-batch
``((text_enc, text_dec, enc_flags, dec_flags), (labels, loss_mask))`` for ``families/t5/t5_model.py``:

- the ``[s_q, s_k]`` masks are outer products of "not padding" (``make_attention_mask``; the
  decoder's times the causal ``make_history_mask``), so each column's any() is that key's flag
  (``[b, s]`` int64; the model rebuilds the masks, see families/t5/t5_model.py);
- ``labels`` are -1 where ``loss_mask`` is 0 upstream (its cross entropy masks them); here they
  become 0, a real id, whose loss the zero ``loss_mask`` drops all the same.

The loss is pretrain_t5.py's ``loss_func``: the vocab-parallel cross entropy averaged over
``loss_mask`` (the GPT's ``language_model_loss``), printed as ``lm loss``.
"""
from __future__ import annotations

import numpy as np
import torch

from megatron_ds.config.family import ExportOptions, HFMapping, ModelFamily
from megatron_ds.errors import ConfigError, DataError
from megatron_ds.families.t5.t5_flops import t5_iteration_flops
from megatron_ds.families.t5.t5_params import (check_t5, count_t5_parameters, decoder_layers, t5_decoder_seq_length,
                                               t5_pipeline_choice, t5_stage_activations)
from megatron_ds.families.t5.t5_quickstart import EVALUATION, QUICKSTART

KEYS = ("text_enc", "text_dec", "labels", "loss_mask", "enc_mask", "dec_mask", "enc_dec_mask")
# --mock-data ids: padding 0 (what upstream's masks treat as padding: ``>= 1`` is a token), then the
# decoder's start and end
MOCK_PAD, MOCK_BOS, MOCK_EOS = 0, 1, 2


class MockT5Dataset(torch.utils.data.Dataset):
    """--mock-data for T5: a fixed function of (seed, index), in upstream's sample format. The decoder
    copies a random span of the encoder's text (a task the loss can fall on), with padding on both
    sides as real samples have."""

    def __init__(self, num_samples: int, enc_length: int, dec_length: int, vocab_size: int, seed: int):
        if vocab_size <= MOCK_EOS + 1 or dec_length < 2:
            raise ConfigError(f"--mock-data T5 samples need --vocab-size > {MOCK_EOS + 1} and "
                              f"--decoder-seq-length >= 2")
        self.n, self.enc, self.dec, self.vocab, self.seed = num_samples, enc_length, dec_length, vocab_size, seed

    def __len__(self):
        return self.n

    def __getitem__(self, idx):
        rng = np.random.default_rng((self.seed, int(idx)))
        n_enc = int(rng.integers(self.enc // 2, self.enc + 1))
        text = rng.integers(MOCK_EOS + 1, self.vocab, n_enc)
        n_span = int(rng.integers(1, min(self.dec - 1, n_enc) + 1))
        start = int(rng.integers(0, n_enc - n_span + 1))
        target = list(text[start:start + n_span]) + [MOCK_EOS]
        return t5_sample(list(text), [MOCK_BOS] + target[:-1], target, self.enc, self.dec, MOCK_PAD)


def t5_sample(enc: list[int], dec_in: list[int], target: list[int], enc_length: int, dec_length: int,
              pad: int) -> dict:
    """Padded arrays and masks exactly as upstream's ``pad_and_convert_to_numpy`` builds them."""
    tokens_enc = np.array(enc + [pad] * (enc_length - len(enc)), dtype=np.int64)
    tokens_dec = np.array(dec_in + [pad] * (dec_length - len(dec_in)), dtype=np.int64)

    def attention(source, target_):
        return ((target_[None, :] >= 1) * (source[:, None] >= 1)).astype(np.int64)

    history = (np.arange(dec_length)[None, :] <= np.arange(dec_length)[:, None]).astype(np.int64)
    return {"text_enc": tokens_enc, "text_dec": tokens_dec,
            "labels": np.array(target + [-1] * (dec_length - len(target)), dtype=np.int64),
            "loss_mask": np.array([1] * len(dec_in) + [0] * (dec_length - len(dec_in)), dtype=np.int64),
            "truncated": 0, "enc_mask": attention(tokens_enc, tokens_enc),
            "dec_mask": attention(tokens_dec, tokens_dec) * history,
            "enc_dec_mask": attention(tokens_dec, tokens_enc)}


class T5Collator:
    """Samples -> ``((text_enc, text_dec, enc_flags, dec_flags), (labels, loss_mask))`` (module docstring)."""

    def __init__(self, vocab_size: int, source: str):
        self.vocab_size, self.source = vocab_size, source

    def __call__(self, samples):
        b = {k: np.stack([s[k] for s in samples]) for k in KEYS}
        for key in ("text_enc", "text_dec"):
            low, high = b[key].min(initial=0), b[key].max(initial=0)
            if high >= self.vocab_size or low < 0:
                raise DataError(f"token id {high if high >= self.vocab_size else low} is outside the model's "
                                f"vocabulary (size {self.vocab_size}) in data set {self.source}: was it "
                                f"preprocessed with another tokenizer (--vocab-extra-ids)?")
        enc_flags = b["enc_mask"].any(axis=-2).astype(np.int64)
        dec_flags = b["dec_mask"].any(axis=-2).astype(np.int64)
        loss_mask = b["loss_mask"]
        labels = np.where(loss_mask > 0, b["labels"], 0)
        t = torch.from_numpy
        return ((t(b["text_enc"]), t(b["text_dec"]), t(enc_flags), t(dec_flags)),
                (t(labels), t(loss_mask.astype(np.float32))))


def _model_kwargs(run, tp_group, device, loss_report=None) -> dict:
    from megatron_ds.training.engine import params_dtype  # noqa: PLC0415

    layout = run.layout
    kwargs = dict(decoder_num_layers=decoder_layers(layout.model), padded_vocab_size=layout.padded_vocab_size,
                  vocab_size=layout.vocab_size, tp_group=tp_group, seed=run.training.seed,
                  recompute_granularity=layout.recompute, params_dtype=params_dtype(layout), device=device,
                  fp8=layout.fp8,
                  activation_checkpoint_interval=(layout.recompute_num_layers if layout.recompute == "full" else 0))
    if loss_report is not None:
        kwargs["loss_report"] = loss_report
    return kwargs


def _t5_model(run, ps, eod_token: int, device, loss_report):
    from megatron_ds.families.t5.t5_model import build_pipeline_t5, build_sequential_t5  # noqa: PLC0415

    m = run.layout.model
    kwargs = _model_kwargs(run, ps.tp_group, device, loss_report)
    if run.layout.use_pipeline:
        return build_pipeline_t5(m, ps.topology, split_rank=m.pipeline_model_parallel_split_rank, **kwargs)
    return build_sequential_t5(m, **kwargs)


def t5_checkpoint_specs(model, padded_vocab_size: int, **kwargs) -> list:
    """``ModelFamily.layer_specs`` of T5: the pipeline layer specs its checkpoints' layer files follow."""
    from megatron_ds.families.t5.t5_model import t5_layer_specs  # noqa: PLC0415

    return t5_layer_specs(model, decoder_num_layers=decoder_layers(model), padded_vocab_size=padded_vocab_size,
                          **kwargs)


def _t5_stage(run, stage: int, tp_group, eod_token: int):
    from megatron_ds.families.t5.t5_model import build_sequential_t5, build_stage_t5  # noqa: PLC0415

    kwargs = _model_kwargs(run, tp_group, "meta")
    if run.layout.use_pipeline:
        return build_stage_t5(run.layout.model, num_stages=run.layout.pp, stage=stage, **kwargs)
    return build_sequential_t5(run.layout.model, **kwargs)


def _t5_datasets(run, tokenizer, num_samples, log):
    m, data = run.layout.model, run.data
    if data.mock_data:
        return tuple(MockT5Dataset(n, m.seq_length, run.masked_lm.decoder_seq_length, tokenizer.vocab_size,
                                   run.training.seed + i)
                     if n else None for i, n in enumerate(num_samples))
    from megatron_ds.data.bert_t5_datasets import build_train_valid_test_datasets  # noqa: PLC0415

    ml = run.masked_lm
    try:  # pretrain_t5.py's train_valid_test_datasets_provider: dataset_type 't5'
        return build_train_valid_test_datasets(
            data.data_path, data.split, num_samples, max_seq_length=m.seq_length, masked_lm_prob=ml.mask_prob,
            short_seq_prob=ml.short_seq_prob, seed=run.training.seed, tokenizer=tokenizer,
            max_seq_length_dec=ml.decoder_seq_length, dataset_type="t5", data_cache_path=data.data_cache_path,
            train_num_epochs=data.train_data_exact_num_epochs, log=log)
    except (ValueError, OSError) as exc:  # the data package's messages are written for the user
        raise DataError(str(exc)) from None


def _t5_collator(run, tokenizer):
    from megatron_ds.training.data import describe_source  # noqa: PLC0415

    return T5Collator(tokenizer.vocab_size, describe_source(run.data))


def _import_hf(hf_dir: str, save_dir: str, log=print) -> None:
    from megatron_ds.families.t5.t5_hf import import_hf_t5  # noqa: PLC0415

    import_hf_t5(hf_dir, save_dir, family=T5, log=log)


def _export_hf(load_dir: str, out_dir: str, options: ExportOptions, log=print) -> None:
    """T5ForConditionalGeneration (the variant HF's T5 computes); of the options, those a WordPiece
    vocabulary and T5's export take."""
    from megatron_ds.families.t5.t5_hf import export_hf_t5  # noqa: PLC0415

    export_hf_t5(load_dir, out_dir, family=T5, iteration=options.iteration, dtype=options.dtype,
                 vocab_size=options.vocab_size, vocab_file=options.vocab_file, log=log)


# What T5's own layers split over tensor parallel ranks (t5_model.py): the cross-attention's column
# parallel query and key_value (heads split), the relative position bias tables ([buckets, heads]: heads
# split) and the LM head's bias (one per vocabulary entry)
T5_TP_SPLIT = {("query", "weight"): 0, ("query", "bias"): 0, ("key_value", "weight"): 0, ("key_value", "bias"): 0,
               ("encoder_relative_attention_bias", "weight"): 1, ("decoder_relative_attention_bias", "weight"): 1,
               ("lm_head", "bias"): 0}

# Megatron-DeepSpeed's validate_args has no --num-layers % PP check; its transformer.py _get_num_layers
# divides each side of the split rank over that side's stages (check_t5, t5_pipeline_choice)
T5 = ModelFamily(name="t5", label="T5", check=check_t5, count_parameters=count_t5_parameters,
                 build_model=_t5_model, build_stage=_t5_stage, build_datasets=_t5_datasets,
                 make_collator=_t5_collator, flops=t5_iteration_flops, layer_specs=t5_checkpoint_specs,
                 partition_activations=False, activations=t5_stage_activations, pipeline_choice=t5_pipeline_choice,
                 decoder_seq_length=t5_decoder_seq_length,
                 default_tokenizer_type="BertWordPieceLowerCase",  # pretrain_t5.py's args_defaults
                 uses_eod=False,  # documents are delimited in the index; the model never reads an EOD id
                 tp_split=T5_TP_SPLIT, vocab_parameters=(("lm_head", "bias"),),
                 hf=HFMapping(model_types=("t5",), import_dir=_import_hf, export=_export_hf,
                              architectures="T5ForConditionalGeneration"),
                 evaluation=EVALUATION, quickstart=QUICKSTART)
