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


def test_pretrained_checkpoint_is_read_only_where_load_has_none(tmp_path):
    """Megatron-LM's --pretrained-checkpoint (training/checkpointing.py load_checkpoint): the fallback of an
    empty --load, loaded as --finetune; an error when neither holds a checkpoint."""
    from megatron_ds.checkpoint.checkpointing import pretrained_start

    pretrained, load = tmp_path / "imported", tmp_path / "run"
    settings = _settings(load, "--pretrained-checkpoint", str(pretrained))
    with pytest.raises(ConfigError, match=r"no checkpoint in --load .*run nor in --pretrained-checkpoint .*imported"):
        pretrained_start(settings)
    pretrained.mkdir()
    (pretrained / "latest_checkpointed_iteration.txt").write_text("0")
    lines = []
    start = pretrained_start(settings, log=lines.append)
    assert (start.load, start.finetune) == (str(pretrained), True)
    assert "starting from --pretrained-checkpoint" in lines[0]
    load.mkdir()
    (load / "latest_checkpointed_iteration.txt").write_text("5")
    assert pretrained_start(settings) is settings
