"""--exit-on-missing-checkpoint: a --load without a checkpoint stops the run instead of training from
random weights (Megatron's load_checkpoint, megatron/checkpointing.py, commit 4efb479)."""
from __future__ import annotations

import pytest

from megatron_ds.checkpoint.checkpointing import load_checkpoint
from megatron_ds.config import parse_args
from megatron_ds.errors import ConfigError
from megatron_ds.families.gpt.gpt_family import GPT


def _settings(load_dir, *extra):
    return parse_args(["--load", str(load_dir), *extra])[0].checkpoint


def test_missing_checkpoint_exits_with_the_flag(tmp_path):
    with pytest.raises(ConfigError, match="no checkpoint in --load .* --exit-on-missing-checkpoint"):
        load_checkpoint(None, _settings(tmp_path / "typo", "--exit-on-missing-checkpoint"), signature={},
                        log=lambda *a: None, family=GPT)


def test_missing_checkpoint_starts_fresh_without_it(tmp_path):
    lines = []
    assert load_checkpoint(None, _settings(tmp_path), signature={}, log=lines.append, family=GPT) == (0, {})
    assert "starting from scratch" in lines[0]
