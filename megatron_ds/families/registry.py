"""Every model family, registered once, and what the entry points and tools look up by name.

``get_family("bert")`` is the ``ModelFamily`` (``config/family.py``) that pretrain_bert.py trains
and every floor below receives; ``checkpoint_family(dir)`` the family that wrote a checkpoint (its
meta's ``model_family``); ``hf_family(model_type)`` the family that imports a Hugging Face model of
that ``model_type``. ``main`` and ``pretrain`` are ``training.pretrain``'s with a family (the GPT's,
pretrain_gpt.py's, where none is given), for callers that start a run in-process.

Adding a family is a package under ``families/`` that builds its ``ModelFamily``, and one entry in
``FAMILIES`` below; the tools list the registered families' quickstarts, Hugging Face model types and
evaluations from there.
"""
from __future__ import annotations

import json
import os

from megatron_ds.config.family import UNRECORDED_FAMILY, ModelFamily
from megatron_ds.errors import ConfigError
from megatron_ds.families.bert.bert_family import BERT
from megatron_ds.families.gpt.gpt_family import GPT
from megatron_ds.families.t5.t5_family import T5

FAMILIES: dict[str, ModelFamily] = {family.name: family for family in (GPT, BERT, T5)}
# a checkpoint without "model_family" is the legacy_unnamed family's: one family, of that name
assert [f.name for f in FAMILIES.values() if f.legacy_unnamed] == [UNRECORDED_FAMILY]


def get_family(name: str) -> ModelFamily:
    """The registered family called ``name`` (pretrain_<name>.py's)."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ConfigError(f"no model family {name!r}: megatron_ds trains {', '.join(FAMILIES)}") from None


def checkpoint_family(load_dir: str, iteration: int | None = None) -> ModelFamily:
    """The family whose model the checkpoint in ``load_dir`` holds (at ``iteration``, default the tracker's)."""
    from megatron_ds.checkpoint.files import saved_family_name  # noqa: PLC0415 - DeepSpeed: not for --help

    return get_family(saved_family_name(load_dir, iteration))


def hf_family(model_type: str | None) -> ModelFamily:
    """The family that imports a Hugging Face model whose config.json says ``model_type``."""
    for family in FAMILIES.values():
        if family.hf is not None and model_type in family.hf.model_types:
            return family
    known = ", ".join(t for f in FAMILIES.values() if f.hf for t in f.hf.model_types)
    raise ConfigError(f"model_type {model_type!r}: megatron_ds imports Hugging Face models of type {known}")


def hf_dir_family(hf_dir: str) -> ModelFamily:
    """The family that imports the Hugging Face model directory ``hf_dir`` (by its config.json's
    ``model_type``; without a readable one, the first family that imports any, whose import says what
    is missing)."""
    try:
        with open(os.path.join(hf_dir, "config.json")) as f:
            model_type = json.load(f).get("model_type")
    except (OSError, ValueError):
        return next(f for f in FAMILIES.values() if f.hf is not None)
    return hf_family(model_type)


def weights_family(load_dir: str | None, iteration: int | None, hf_dir: str | None) -> ModelFamily:
    """The family of the weights an inference tool reads: a checkpoint's (--load) or a Hugging Face
    directory's (--hf-model)."""
    return checkpoint_family(load_dir, iteration) if load_dir else hf_dir_family(hf_dir)


def main(argv=None, family: ModelFamily = GPT) -> int:
    """``training.pretrain.main`` for ``family`` (pretrain_gpt.py's unless given)."""
    from megatron_ds.training import pretrain as entry  # noqa: PLC0415 - the training stack: not for --help

    return entry.main(argv, family=family)


def pretrain(flags, ignored: list[str], family: ModelFamily = GPT):
    """``training.pretrain.pretrain`` for ``family`` (pretrain_gpt.py's unless given); the final ``TrainState``."""
    from megatron_ds.training import pretrain as entry  # noqa: PLC0415

    return entry.pretrain(flags, ignored, family)
