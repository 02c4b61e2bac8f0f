"""Megatron-LM's logging, straggler and garbage-collection flags: names, defaults and ranges as upstream
(core_v0.19.0 megatron/training/config/training_config.py LoggerConfig and TrainingConfig,
megatron/training/config/resilience_config.py StragglerDetectionConfig, turned into flags by
megatron/training/argument_utils.py ArgumentGroupFactory: a bool defaulting to True becomes --no-X / --disable-X)."""
from __future__ import annotations

import pytest

from megatron_ds.config import parse_args, resolve
from megatron_ds.errors import ConfigError
from megatron_ds.families.gpt.gpt_family import GPT

ARGS = ("--num-layers 2 --hidden-size 8 --num-attention-heads 2 --seq-length 8 --micro-batch-size 1 "
        "--lr 1e-3 --train-iters 4 --mock-data --vocab-size 64").split()

# field -> upstream default, transcribed from the dataclasses named above
UPSTREAM_DEFAULTS = {
    ("logging", "log_throughput"): False, ("logging", "log_progress"): False, ("logging", "logging_level"): None,
    ("logging", "log_straggler"): False, ("logging", "disable_straggler_on_startup"): False,
    ("logging", "straggler_ctrlr_port"): 65535, ("logging", "straggler_minmax_count"): 1,
    ("training", "manual_gc"): False, ("training", "manual_gc_interval"): 0, ("training", "manual_gc_eval"): True,
}


def test_defaults_are_upstream_s():
    cfg, ignored = parse_args(ARGS)
    assert {key: getattr(getattr(cfg, key[0]), key[1]) for key in UPSTREAM_DEFAULTS} == UPSTREAM_DEFAULTS
    assert not ignored


def test_an_upstream_command_line_sets_every_field():
    cfg, ignored = parse_args(ARGS + (
        "--log-throughput --log-progress --logging-level 10 --log-straggler --disable-straggler-on-startup "
        "--straggler-ctrlr-port 12345 --straggler-minmax-count 4 --manual-gc --manual-gc-interval 100 "
        "--no-manual-gc-eval").split())
    assert not ignored  # each one does something here: none is merely accepted
    lg, t = cfg.logging, cfg.training
    assert (lg.log_throughput, lg.log_progress, lg.logging_level) == (True, True, 10)
    assert (lg.log_straggler, lg.disable_straggler_on_startup, lg.straggler_ctrlr_port,
            lg.straggler_minmax_count) == (True, True, 12345, 4)
    assert (t.manual_gc, t.manual_gc_interval, t.manual_gc_eval) == (True, 100, False)
    run = resolve(cfg, world_size=1, vocab_size=64, device_type="cpu", family=GPT)
    assert (run.training.manual_gc, run.training.manual_gc_interval, run.training.manual_gc_eval) == (True, 100, False)


@pytest.mark.parametrize("flag, value, message", [
    ("--straggler-minmax-count", "0", "--straggler-minmax-count 0 is out of range: it must be >= 1"),
    ("--straggler-ctrlr-port", "70000", "--straggler-ctrlr-port 70000 is out of range: it must be in [0, 65535]"),
    ("--manual-gc-interval", "-5", "--manual-gc-interval -5 is out of range: it must be >= 0"),
])
def test_out_of_range_values_are_refused_in_one_line(flag, value, message):
    cfg, _ = parse_args(ARGS + [flag, value])
    with pytest.raises(ConfigError) as info:
        resolve(cfg, world_size=1, vocab_size=64, device_type="cpu", family=GPT)
    assert message in str(info.value) and "\n" not in str(info.value)
