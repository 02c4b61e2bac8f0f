"""Model families: what an entry point (pretrain_gpt.py, pretrain_bert.py, ...) gives the shared
training stack, so that each family lives in its own modules and the stack stays one.

A ``ModelFamily`` bundles the family's pieces on every floor:

- ``shape`` (``config.layout.FamilyShape``): the analytic parameter count per stage and the flag
  combinations it refuses, given to ``config.resolve``;
- ``build_model(run, ps, eod_token, device, loss_report)``: this rank's module (a DeepSpeed
  ``PipelineModule``, or a plain one with --no-pipeline-parallel), whose ``loss_fn`` adds its named
  terms to ``loss_report`` (the ``model.loss_report.LossReport`` of ``loss_names``);
- ``build_stage(run, stage, tp_group, eod_token)``: one pipeline stage on the meta device (--dry-run);
- ``build_datasets(run, tokenizer, num_samples, log)``: (train, valid, test) datasets (None where a
  split has no samples), and ``make_collator(run, tokenizer)``: samples -> ``(inputs, labels)``,
  the micro-batch DeepSpeed's engines take (inputs to the first stage, labels to the loss);
- ``loss_names``: the terms its loss reports, printed on the iteration and validation lines
  (``"lm loss"`` first: that is the line's ``lm loss``);
- ``flops(layout, seq_length)``: the model FLOPs of one iteration (``training/flops.py``: the
  family's own count, for the iteration line's TFLOP/s);
- ``default_tokenizer_type``: --tokenizer-type when the command line names none (Megatron-DeepSpeed's
  ``args_defaults`` of the family's pretrain script); ``uses_eod``: whether the builders need the
  tokenizer's end-of-document id.

The GPT is ``GPT`` below; BERT is ``training/bert.py``'s ``BERT``. The heavy imports (the model,
DeepSpeed) happen inside the functions, so --help and flag errors stay fast.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from megatron_ds.config.layout import GPT_SHAPE, FamilyShape
from megatron_ds.training.flops import gpt_iteration_flops


@dataclass(frozen=True)
class ModelFamily:
    name: str
    shape: FamilyShape
    build_model: Callable
    build_stage: Callable
    build_datasets: Callable
    make_collator: Callable
    loss_names: tuple[str, ...] = ()
    flops: Callable = gpt_iteration_flops  # (layout, sequence length) -> model FLOPs of one iteration
    default_tokenizer_type: str | None = None
    uses_eod: bool = True  # the model reads the tokenizer's end-of-document id (--reset-attention-mask)

    def eod_token(self, tokenizer) -> int | None:
        """What the builders get as ``eod_token``: None for a family without documents in a sample
        (a BERT WordPiece tokenizer has no end-of-document token)."""
        return tokenizer.eod if self.uses_eod else None


def _gpt_model(run, ps, eod_token: int, device, loss_report):
    from megatron_ds.training.engine import build_model  # noqa: PLC0415

    return build_model(run, ps, eod_token, device, loss_report)


def _gpt_stage(run, stage: int, tp_group, eod_token: int):
    from megatron_ds.training.meta_build import build_stage  # noqa: PLC0415

    return build_stage(run, stage, tp_group, eod_token)


def _gpt_datasets(run, tokenizer, num_samples, log):
    from megatron_ds.training.data import build_datasets  # noqa: PLC0415

    return build_datasets(run.data, num_samples=num_samples, seq_length=run.layout.model.seq_length,
                          seed=run.training.seed, vocab_size=tokenizer.vocab_size, log=log)


def _gpt_collator(run, tokenizer):
    from megatron_ds.training.data import BatchCollator, describe_source  # noqa: PLC0415

    return BatchCollator(run.data, tokenizer.eod, tokenizer.vocab_size, describe_source(run.data))


GPT = ModelFamily(name="gpt", shape=GPT_SHAPE, build_model=_gpt_model, build_stage=_gpt_stage,
                  build_datasets=_gpt_datasets, make_collator=_gpt_collator)
