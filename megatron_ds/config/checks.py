"""Range checks of numeric flags, by flag name, before anything else looks at the values.

argparse only checks types: ``--lr nan`` and ``--train-iters -5`` parse fine and then fail deep
inside torch or as a message about some other flag. ``check_ranges(cfg)`` runs first in
``derive()`` and names the flag, the value and the accepted range in one line.
"""
from __future__ import annotations

import dataclasses
import math

# (section, field, lower bound, lower inclusive, upper bound, upper inclusive); None = unbounded.
# Only values that were given (not None) are checked; fields absent from the config are skipped,
# so this table stays valid while other fields come and go.
_RANGES: tuple = (
    ("optimizer", "lr", 0.0, True, None, False),
    ("optimizer", "min_lr", 0.0, True, None, False),
    ("optimizer", "weight_decay", 0.0, True, None, False),
    ("optimizer", "clip_grad", 0.0, True, None, False),
    ("optimizer", "adam_beta1", 0.0, True, 1.0, False),
    ("optimizer", "adam_beta2", 0.0, True, 1.0, False),
    ("optimizer", "adam_eps", 0.0, False, None, False),
    ("optimizer", "sgd_momentum", 0.0, True, None, False),
    ("optimizer", "lr_decay_iters", 1, True, None, False),
    ("optimizer", "lr_decay_samples", 1, True, None, False),
    ("optimizer", "lr_warmup_fraction", 0.0, True, 1.0, True),
    ("optimizer", "lr_warmup_iters", 0, True, None, False),
    ("optimizer", "lr_warmup_samples", 0, True, None, False),
    ("training", "micro_batch_size", 1, True, None, False),
    ("training", "global_batch_size", 1, True, None, False),
    ("training", "train_iters", 0, True, None, False),
    ("training", "train_samples", 0, True, None, False),
    ("training", "exit_interval", 1, True, None, False),
    ("training", "exit_duration_in_mins", 0.0, False, None, False),
    ("training", "eval_interval", 0, True, None, False),
    ("training", "eval_iters", 0, True, None, False),
    ("training", "seed", 0, True, None, False),
    ("training", "recompute_num_layers", 1, True, None, False),
    ("training", "max_consecutive_nan_iters", 1, True, None, False),
    ("training", "loss_scale", 0.0, True, None, False),
    ("training", "initial_loss_scale", 1.0, True, None, False),
    ("training", "min_loss_scale", 0.0, False, None, False),
    ("training", "loss_scale_window", 1, True, None, False),
    ("training", "hysteresis", 1, True, None, False),
    ("model", "num_layers", 1, True, None, False),
    ("model", "hidden_size", 1, True, None, False),
    ("model", "num_attention_heads", 1, True, None, False),
    ("model", "num_key_value_heads", 1, True, None, False),
    ("model", "ffn_hidden_size", 1, True, None, False),
    ("model", "kv_channels", 1, True, None, False),
    ("model", "seq_length", 1, True, None, False),
    ("model", "max_position_embeddings", 1, True, None, False),
    ("model", "hidden_dropout", 0.0, True, 1.0, False),
    ("model", "attention_dropout", 0.0, True, 1.0, False),
    ("model", "init_method_std", 0.0, False, None, False),
    ("model", "layernorm_epsilon", 0.0, False, None, False),
    ("model", "make_vocab_size_divisible_by", 1, True, None, False),
    ("model", "rope_theta", 0.0, False, None, False),
    ("model", "rotary_percent", 0.0, False, 1.0, True),
    ("parallel", "tensor_model_parallel_size", 1, True, None, False),
    ("parallel", "pipeline_model_parallel_size", 1, True, None, False),
    ("parallel", "distributed_timeout_minutes", 0.0, False, None, False),
    ("data", "num_workers", 0, True, None, False),
    ("data", "vocab_size", 1, True, None, False),
    ("checkpoint", "save_interval", 1, True, None, False),
    ("checkpoint", "keep_last", 1, True, None, False),
    ("checkpoint", "ckpt_step", 0, True, None, False),
    ("logging", "log_interval", 1, True, None, False),
)


def flag_name(section_obj, name: str) -> str:
    """The command-line spelling of a config field (its first declared flag)."""
    for f in dataclasses.fields(section_obj):
        if f.name == name:
            flags = f.metadata.get("flags") or ()
            if flags and not f.metadata.get("invert"):
                return flags[0]
    return "--" + name.replace("_", "-")


def _describe(lo, lo_inc, hi, hi_inc) -> str:
    if hi is None:
        return f"{'>=' if lo_inc else '>'} {lo}"
    return f"in {'[' if lo_inc else '('}{lo}, {hi}{']' if hi_inc else ')'}"


def _bad(value, lo, lo_inc, hi, hi_inc) -> bool:
    if isinstance(value, float) and not math.isfinite(value):
        return True
    if lo is not None and (value < lo or (value == lo and not lo_inc)):
        return True
    return hi is not None and (value > hi or (value == hi and not hi_inc))


def range_errors(cfg) -> list[str]:
    """One message per flag whose value is out of range (NaN/inf included)."""
    errors = []
    for section, name, lo, lo_inc, hi, hi_inc in _RANGES:
        obj = getattr(cfg, section, None)
        value = getattr(obj, name, None)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if _bad(value, lo, lo_inc, hi, hi_inc):
            errors.append(f"{flag_name(obj, name)} {value} is out of range: it must be "
                          f"{'a finite number ' if isinstance(value, float) else ''}"
                          f"{_describe(lo, lo_inc, hi, hi_inc)}")
    return errors


def check_ranges(cfg) -> None:
    """Raise ConfigError naming every out-of-range flag (imported lazily: derive imports us)."""
    from megatron_ds.config.derive import ConfigError  # noqa: PLC0415

    errors = range_errors(cfg)
    if errors:
        raise ConfigError("; ".join(errors))
