"""Every model family, registered once, and what the entry points and tools look up by name.

``get_family("bert")`` is the ``ModelFamily`` (``config/family.py``) that pretrain_bert.py trains
and every floor below receives; ``checkpoint_family(dir)`` the family that wrote a checkpoint (its
meta's ``model_family``). ``main`` and ``pretrain`` are ``training.pretrain``'s with the family
looked up here (the GPT's when none is named), for callers that start a run in-process.
"""
from __future__ import annotations

from megatron_ds.checkpoint.files import saved_family_name
from megatron_ds.config.family import ModelFamily
from megatron_ds.errors import ConfigError
from megatron_ds.families.bert.bert_family import BERT
from megatron_ds.families.bert.bert_hf import export_hf_bert
from megatron_ds.families.gpt.gpt_family import GPT
from megatron_ds.families.t5.t5_family import T5
from megatron_ds.families.t5.t5_hf import export_hf_t5
from megatron_ds.training import pretrain as entry

FAMILIES: dict[str, ModelFamily] = {family.name: family for family in (GPT, BERT, T5)}

# the families with a Hugging Face export of their own, (load_dir, out_dir, *, iteration, dtype, vocab_size,
# vocab_file) -> None; the GPT's is checkpoint/export.py's, which takes more (tokenizer files, fp32 masters)
HF_EXPORTS = {BERT.name: export_hf_bert, T5.name: export_hf_t5}


def get_family(name: str) -> ModelFamily:
    """The registered family called ``name`` (pretrain_<name>.py's)."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ConfigError(f"no model family {name!r}: megatron_ds trains {', '.join(FAMILIES)}") from None


def checkpoint_family(load_dir: str, iteration: int | None = None) -> ModelFamily:
    """The family whose model the checkpoint in ``load_dir`` holds (at ``iteration``, default the tracker's)."""
    return get_family(saved_family_name(load_dir, iteration))


def main(argv=None, family: ModelFamily | None = None) -> int:
    """``training.pretrain.main`` for ``family`` (None: the GPT, pretrain_gpt.py's)."""
    return entry.main(argv, family=family or GPT)


def pretrain(flags, ignored: list[str], family: ModelFamily | None = None):
    """``training.pretrain.pretrain`` for ``family`` (None: the GPT); the final ``TrainState``."""
    return entry.pretrain(flags, ignored, family or GPT)
