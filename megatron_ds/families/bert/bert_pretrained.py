"""A BERT pretraining checkpoint (pretrain_bert.py's --save, any TP / PP / DP / ZeRO / precision) into the
parameters of a fine-tuning model at this run's layout: tasks/finetune_utils.py's
``--pretrained-checkpoint``, which loads the model's weights only (no optimizer, no iteration).

The checkpoint is read one pipeline layer at a time, merged over its tensor parallel shards
(``checkpoint.consolidate``), fitted to this run's padded vocabulary and split for this rank
(``checkpoint.tp``). Every parameter of this rank whose name the checkpoint holds is loaded; the
task head's last linear (and a pooler or token-type table a checkpoint trained with
--bert-no-binary-head lacks) keeps its fresh initialization, as Megatron's task models do for
``classification_head`` / ``multichoice_head``. Any other parameter missing, or a shape that differs,
is a ConfigError: the fine-tuning flags (--num-layers, --hidden-size, ...) must be the pretrained model's.
"""
from __future__ import annotations

from megatron_ds.checkpoint import tp as tp_rules
from megatron_ds.checkpoint.consolidate import iter_consolidated_layers
from megatron_ds.checkpoint.engine_state import set_weight
from megatron_ds.checkpoint.files import open_checkpoint, saved_family_name
from megatron_ds.checkpoint.vocabulary import fit_vocab_rows
from megatron_ds.errors import ConfigError
from megatron_ds.families.bert.bert_family import BERT

# fresh where the checkpoint has none: the task's own linear, and what --bert-no-binary-head pretraining lacks
MAY_START_FRESH = ("classification_head.", "pooler.", "tokentype_embeddings.")


def check_pretrained(path: str) -> None:
    """Refuse, before anything starts, a checkpoint that is not BERT's (Megatron's tasks fine-tune BERT only)."""
    try:
        family = saved_family_name(path)
    except (OSError, KeyError, ValueError) as exc:
        raise ConfigError(f"--pretrained-checkpoint {path}: no readable checkpoint ({exc})") from None
    if family != BERT.name:
        raise ConfigError(f"--pretrained-checkpoint {path} holds a {family} model (pretrain_{family}.py wrote it); "
                          f"MNLI, QQP and RACE fine-tune a BERT checkpoint (pretrain_bert.py), as Megatron's tasks do")


def load_pretrained(path: str, module, run, ps, log=print) -> None:
    """Fill ``module`` (this rank's model) from the BERT checkpoint in ``path`` (module docstring)."""
    ckpt = open_checkpoint(path, None, BERT)
    params = dict(module.named_parameters())
    loaded = set()
    for _, tensors in iter_consolidated_layers(ckpt, log=lambda *a: None):
        for name, full in tensors.items():
            if name not in params:
                continue  # another stage's layer, or the MLM head fine-tuning drops
            fitted = fit_vocab_rows(name, {"weight": full}, run.layout.padded_vocab_size, None, BERT)["weight"]
            shard = tp_rules.split(name, fitted, ps.tp_size, ps.tp_rank, ckpt.model, BERT)
            if shard.shape != params[name].shape:
                raise ConfigError(f"--pretrained-checkpoint {path}: {name} is {tuple(shard.shape)} there but "
                                  f"{tuple(params[name].shape)} here; give the pretrained model's --num-layers, "
                                  f"--hidden-size, --num-attention-heads and --ffn-hidden-size")
            set_weight(params[name], shard)
            loaded.add(name)
    missing = [n for n in params if n not in loaded and not any(f".{p}" in f".{n}" for p in MAY_START_FRESH)]
    if missing:
        raise ConfigError(f"--pretrained-checkpoint {path} has no {missing[0]} ({len(missing)} parameters missing): "
                          f"was it saved with other --num-layers?")
    fresh = sorted({n.split(".")[-2] for n in params if n not in loaded})
    log(f"loaded pretrained BERT weights from {ckpt.path}; fresh: {', '.join(fresh)}")
