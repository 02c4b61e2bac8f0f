"""The BERT model family (pretrain_bert.py): ``BERT``, the ``ModelFamily`` (``config/family.py``) its
entry point gives the shared stack -- model builders, datasets and micro-batches here, its parameter
count, checks and memory terms (``bert_params.py``), FLOPs (``bert_flops.py``), the layer specs its
checkpoints follow (``bert_model.py``).

Micro-batches are Megatron-DeepSpeed's pretrain_bert.py ``get_batch`` fields, split the way
DeepSpeed's engines take them: ``inputs = (text, types, padding_mask)`` for the first stage and
``labels = (labels, loss_mask, is_random)`` for the loss (``families/bert/bert_model.py`` ``bert_loss_fn``).
"""
from __future__ import annotations

import numpy as np
import torch

from megatron_ds.config.family import ExportOptions, HFMapping, ModelFamily
from megatron_ds.errors import DataError
from megatron_ds.families.bert.bert_flops import bert_iteration_flops
from megatron_ds.families.bert.bert_params import bert_stage_activations, check_bert, count_bert_parameters
from megatron_ds.families.bert.bert_quickstart import EVALUATION, QUICKSTART

# Megatron-DeepSpeed's pretrain_bert.py: args_defaults={'tokenizer_type': 'BertWordPieceLowerCase'}
DEFAULT_TOKENIZER = "BertWordPieceLowerCase"
LOSS_NAMES = ("lm loss", "sop loss")  # families/bert/bert_model.py LOSS_NAMES (pretrain_bert.py loss_func's names)
SAMPLE_KEYS = ("text", "types", "labels", "is_random", "loss_mask", "padding_mask")


def _model_kwargs(run, tp_group, device):
    from megatron_ds.training.engine import model_kwargs  # noqa: PLC0415

    return model_kwargs(run, tp_group, eod_token=None, device=device)  # BERT has no end-of-document token


def build_bert_model(run, ps, eod_token: int, device, loss_report):
    """BERT as a PipelineModule (pipeline engine) or a plain module (--no-pipeline-parallel)."""
    from megatron_ds.families.bert.bert_model import build_pipeline_bert, build_sequential_bert  # noqa: PLC0415

    layout, common = run.layout, _model_kwargs(run, ps.tp_group, device)
    if layout.use_pipeline:
        return build_pipeline_bert(layout.model, topology=ps.topology, loss_report=loss_report,
                                   partition_method=run.distributed.pipeline_partition_method, **common)
    return build_sequential_bert(layout.model, loss_report=loss_report, **common)


def bert_checkpoint_specs(model, padded_vocab_size: int, **kwargs) -> list:
    """``ModelFamily.layer_specs`` of BERT: the pipeline layer specs its checkpoints' layer files follow."""
    from megatron_ds.families.bert.bert_model import bert_layer_specs  # noqa: PLC0415

    return bert_layer_specs(model, padded_vocab_size=padded_vocab_size, **kwargs)


def build_bert_stage(run, stage: int, tp_group, eod_token: int):
    """Pipeline stage ``stage`` on the meta device (--dry-run's build)."""
    from megatron_ds.families.bert.bert_model import build_sequential_bert, build_stage_bert  # noqa: PLC0415

    layout, common = run.layout, _model_kwargs(run, tp_group, "meta")
    if layout.use_pipeline:
        return build_stage_bert(layout.model, num_stages=layout.pp, stage=stage,
                                partition_method=run.distributed.pipeline_partition_method, **common)
    return build_sequential_bert(layout.model, **common)


class MockBertDataset(torch.utils.data.Dataset):
    """--mock-data: synthetic samples in BERT's format, a fixed function of (seed, index).

    Ids 0-3 play [PAD], [CLS], [SEP], [MASK]; each sample holds 1/2 to all of ``seq_length`` tokens
    ``[CLS] A [SEP] B [SEP]``, 15% of the others replaced by [MASK] and predicted. B is A's
    continuation or, with ``is_random`` 1, another draw, so the sentence-order head has a signal."""

    PAD, CLS, SEP, MASK = 0, 1, 2, 3

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int):
        if vocab_size < 8 or seq_length < 8:
            raise DataError(f"--mock-data for BERT needs --vocab-size >= 8 and --seq-length >= 8 "
                            f"(got {vocab_size}, {seq_length})")
        self.num_samples, self.seq_length, self.vocab_size, self.seed = num_samples, seq_length, vocab_size, seed

    def __len__(self):
        return self.num_samples

    def __getitem__(self, idx):
        rng = np.random.default_rng((self.seed, int(idx)))
        s = self.seq_length
        n = int(rng.integers(s // 2, s + 1))
        half = (n - 3) // 2
        a = rng.integers(4, self.vocab_size, half)
        is_random = int(rng.integers(0, 2))
        # not random: B continues A (each id one more than the last); random: independent ids
        b = rng.integers(4, self.vocab_size, n - 3 - half) if is_random else \
            4 + (a[-1] - 4 + 1 + np.arange(n - 3 - half)) % (self.vocab_size - 4)
        tokens = np.concatenate([[self.CLS], a, [self.SEP], b, [self.SEP]]).astype(np.int64)
        types = np.concatenate([np.zeros(half + 2), np.ones(n - half - 2)]).astype(np.int64)
        special = np.isin(tokens, (self.CLS, self.SEP))
        masked = (rng.random(n) < 0.15) & ~special
        labels = np.where(masked, tokens, -1)
        tokens = np.where(masked, self.MASK, tokens)
        pad = s - n
        return {"text": np.pad(tokens, (0, pad), constant_values=self.PAD), "types": np.pad(types, (0, pad)),
                "labels": np.pad(labels, (0, pad), constant_values=-1), "is_random": np.int64(is_random),
                "loss_mask": np.pad(masked.astype(np.float32), (0, pad)),
                "padding_mask": np.pad(np.ones(n, dtype=np.int64), (0, pad)), "truncated": np.int64(0)}


def build_bert_datasets(run, tokenizer, num_samples, log):
    """(train, valid, test) BERT datasets: synthetic with --mock-data, else Megatron-DeepSpeed's BERT
    samples of the --split-sentences data (``megatron_ds.data.bert_t5_datasets``, dataset type
    standard_bert: --mask-prob, --short-seq-prob, the binary head's sentence-order swap)."""
    data, seq, seed = run.data, run.layout.model.seq_length, run.training.seed
    if data.mock_data:
        return tuple(MockBertDataset(n, seq, tokenizer.vocab_size, seed + i) if n else None
                     for i, n in enumerate(num_samples))
    from megatron_ds.data.bert_t5_datasets import build_train_valid_test_datasets  # noqa: PLC0415

    ml = run.masked_lm
    try:
        return build_train_valid_test_datasets(
            data.data_path, data.split, num_samples, max_seq_length=seq, masked_lm_prob=ml.mask_prob,
            short_seq_prob=ml.short_seq_prob, seed=seed, tokenizer=tokenizer,
            binary_head=run.layout.model.bert_binary_head, dataset_type="standard_bert",
            data_cache_path=data.data_cache_path, train_num_epochs=data.train_data_exact_num_epochs, log=log)
    except (ValueError, OSError) as exc:  # the data package's messages are written for the user
        raise DataError(str(exc)) from None


class BertCollator:
    """Stacks BERT samples into ``((text, types, padding_mask), (labels, loss_mask, is_random))``;
    checks token ids against the vocabulary first (another tokenizer's data would index past it)."""

    def __init__(self, vocab_size: int, source: str):
        self.vocab_size, self.source = vocab_size, source

    def __call__(self, samples):
        batch = {key: np.stack([np.asarray(s[key]) for s in samples]) for key in SAMPLE_KEYS}
        text = batch["text"]
        low, high = text.min(initial=0), text.max(initial=0)
        if high >= self.vocab_size or low < 0:
            raise DataError(f"token id {high if high >= self.vocab_size else low} is outside the model's vocabulary "
                            f"(size {self.vocab_size}) in data set {self.source}: was it preprocessed with "
                            f"another tokenizer?")
        t = {key: torch.from_numpy(np.ascontiguousarray(value)) for key, value in batch.items()}
        return ((t["text"].long(), t["types"].long(), t["padding_mask"].long()),
                (t["labels"].long(), t["loss_mask"].float(), t["is_random"].long()))


def make_bert_collator(run, tokenizer):
    from megatron_ds.training.data import describe_source  # noqa: PLC0415

    return BertCollator(tokenizer.vocab_size, describe_source(run.data))


def _import_hf(hf_dir: str, save_dir: str, log=print) -> None:
    from megatron_ds.families.bert.bert_hf import import_hf_bert  # noqa: PLC0415

    import_hf_bert(hf_dir, save_dir, family=BERT, log=log)


def _export_hf(load_dir: str, out_dir: str, options: ExportOptions, log=print) -> None:
    """(Megatron)BertForPreTraining; of the options, those a WordPiece vocabulary and BERT's export take."""
    from megatron_ds.families.bert.bert_hf import export_hf_bert  # noqa: PLC0415

    export_hf_bert(load_dir, out_dir, family=BERT, iteration=options.iteration, dtype=options.dtype,
                   vocab_size=options.vocab_size, vocab_file=options.vocab_file, log=log)


BERT = ModelFamily(name="bert", label="BERT", check=check_bert, count_parameters=count_bert_parameters,
                   build_model=build_bert_model, build_stage=build_bert_stage, build_datasets=build_bert_datasets,
                   make_collator=make_bert_collator, flops=bert_iteration_flops, layer_specs=bert_checkpoint_specs,
                   activations=bert_stage_activations, loss_names=lambda layout: LOSS_NAMES,
                   default_tokenizer_type=DEFAULT_TOKENIZER, uses_eod=False,
                   causal_attention=False,
                   # its MLM bias (bert_model.py BertLMBias): a column parallel bias, one per vocabulary entry
                   tp_split={("lm_head", "bias"): 0}, vocab_parameters=(("lm_head", "bias"),),
                   hf=HFMapping(model_types=("bert", "megatron-bert"), import_dir=_import_hf, export=_export_hf,
                                architectures="MegatronBertForPreTraining or BertForPreTraining"),
                   evaluation=EVALUATION, quickstart=QUICKSTART)
