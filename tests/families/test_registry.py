"""The registry (megatron_ds/families/registry.py): every family registered once and complete, looked up by
name, by checkpoint and by Hugging Face model type; the tools list what the registry holds, not names of
their own."""
from __future__ import annotations

import dataclasses
import json

import pytest

from megatron_ds.config.family import UNRECORDED_FAMILY, ModelFamily
from megatron_ds.errors import ConfigError
from megatron_ds.families import FAMILIES, get_family, hf_dir_family, hf_family


def test_every_family_is_complete_and_named_by_its_entry_point():
    for name, family in FAMILIES.items():
        assert family.name == name and family.label
        required = [f.name for f in dataclasses.fields(ModelFamily) if f.default is dataclasses.MISSING
                    and f.default_factory is dataclasses.MISSING]
        assert all(getattr(family, field) is not None for field in required), name
        assert family.quickstart is not None and family.hf is not None and family.evaluation, name
    # checkpoints without "model_family" are the one legacy family's
    assert [f.name for f in FAMILIES.values() if f.legacy_unnamed] == [UNRECORDED_FAMILY]
    assert [f.recorded_name for f in FAMILIES.values()] == [None, "bert", "t5"]


def test_lookups():
    assert get_family("t5") is FAMILIES["t5"]
    with pytest.raises(ConfigError, match="no model family 'llama': megatron_ds trains gpt, bert, t5"):
        get_family("llama")
    assert hf_family("llama") is hf_family("gpt2") is hf_family("mixtral") is hf_family("qwen3") is get_family("gpt")
    assert hf_family("megatron-bert") is get_family("bert") and hf_family("t5") is get_family("t5")
    with pytest.raises(ConfigError, match="model_type 'gemma': megatron_ds imports Hugging Face models of type"):
        hf_family("gemma")


def test_a_hugging_face_directory_names_its_family(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    assert hf_dir_family(str(tmp_path)) is get_family("bert")
    # without a readable config.json: the first family that imports any, whose import names what is missing
    assert hf_dir_family(str(tmp_path / "nowhere")) is get_family("gpt")


def test_the_quickstart_lists_the_registered_families(capsys):
    from megatron_ds.cli.quickstart import build_parser

    help_text = build_parser().format_help()
    for name, family in FAMILIES.items():
        assert f"--model {name}:" in help_text and family.quickstart.steps.splitlines()[0] in help_text
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--model", "llama"])
    assert "invalid choice: 'llama' (choose from 'gpt', 'bert', 't5')" in capsys.readouterr().err


def test_the_planner_takes_the_plannable_families(capsys):
    from megatron_ds.cli.plan import main

    assert main(["--family", "llama"]) == 2
    assert "--family takes gpt, bert, t5" in capsys.readouterr().err
