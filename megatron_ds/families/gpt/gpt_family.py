"""The GPT model family (pretrain_gpt.py; Llama-style models and mixture of experts included): ``GPT``,
the ``ModelFamily`` (``config/family.py``) its entry point gives the shared stack.

The GPT is the model the generic floors are built around, so its pieces live there and this module
only names them: the dense transformer's parameter count and checks (``config/layout.py``
``count_parameters``, ``check_gpt``; MoE's in ``config/moe_params.py``), its model and stage builders
(``training/engine.py``, ``training/meta_build.py`` over ``model/layer_specs.py``), its datasets and
micro-batches (``training/data.py``), its FLOPs (``training/flops.py``). A floor given no family
runs these same pieces. The heavy imports (the model, DeepSpeed) happen inside the functions, so
--help and flag errors stay fast.
"""
from __future__ import annotations

from megatron_ds.config.family import ModelFamily
from megatron_ds.config.layout import check_gpt, count_parameters
from megatron_ds.training.flops import gpt_iteration_flops


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


def gpt_checkpoint_specs(model, padded_vocab_size: int, **kwargs) -> list:
    """``ModelFamily.layer_specs`` of the GPT (with MoE layers too): ``model/layer_specs.py``'s specs."""
    from megatron_ds.model.layer_specs import gpt_layer_specs  # noqa: PLC0415

    return gpt_layer_specs(model, padded_vocab_size=padded_vocab_size, **kwargs)


# the family of every checkpoint and run from before families were named (legacy_unnamed)
GPT = ModelFamily(name="gpt", label="GPT", check=check_gpt, count_parameters=count_parameters,
                  build_model=_gpt_model, build_stage=_gpt_stage, build_datasets=_gpt_datasets,
                  make_collator=_gpt_collator, flops=gpt_iteration_flops, layer_specs=gpt_checkpoint_specs,
                  moe_layers=True, universal_checkpoints=True, legacy_unnamed=True)
