"""Upstream Megatron-LM's example scripts (tests/config/megatron_lm_scripts.py) through --dry-run as their
launchers pass the arguments: what Megatron-LM itself accepts passes; what it refuses is refused here too."""
from __future__ import annotations

import pytest

from tests.config.megatron_lm_scripts import scripts
from tests.config.test_megatron_scripts import GPT2_DIR, _files, dry_run


def _script(tmp_path, name):
    files = {**_files(tmp_path), "cache": str(tmp_path / "cache")}
    return next(s for s in scripts(files) if s.name == name)


def _without(argv: list, *flags: str) -> list:
    """argv less ``flags`` and the values that follow each."""
    out, skip = [], False
    for arg in argv:
        if arg in flags:
            skip = True
            continue
        if skip and not arg.startswith("--"):
            continue
        skip = False
        out.append(arg)
    return out


@pytest.mark.skipif(not (GPT2_DIR / "gpt2-vocab.json").is_file(), reason="GPT-2 vocab/merges not found")
def test_gpt3_175b_example_is_refused_as_megatron_lm_refuses_it(tmp_path):
    script = _script(tmp_path, "gpt3_175b_distributed")
    # megatron/training/arguments.py validate_args (core_v0.19.0): "Cannot specify both
    # --step-batch-size-schedule and --global-batch-size" -- the example passes both
    rc, out, err = dry_run(script, _files(tmp_path))
    assert rc != 0 and "--step-batch-size-schedule and --global-batch-size are both set" in out + err
    # as upstream would run it: without --global-batch-size, the schedule's last size (1536) is the run's
    fixed = type(script)(script.name, script.world, _without(script.argv, "--global-batch-size"))
    rc, out, err = dry_run(fixed, _files(tmp_path, write_data=False))
    assert rc == 0, out[-2000:] + err[-2000:]
    assert "global 1536" in out and "batch size by step: 16 from 0 tokens, 320 from 2,400,000,000 tokens," in out
    assert "TP 8 x PP 16 x DP 1" in out and "flags read as Megatron-LM's" in out


def test_llama3_8b_fp8_example_passes_with_bf16_gradients_as_it_asks(tmp_path):
    script = _script(tmp_path, "llama3_8b_h100_fp8")
    rc, out, err = dry_run(script, _files(tmp_path, write_data=False))
    assert rc == 0, out[-2000:] + err[-2000:]
    assert "kv 8" in out and "ZeRO 1" in out and "flags read as Megatron-LM's" in out
    assert "delayed scaling" in out  # FP8 as upstream's default recipe runs it (docs/fp8.md)
    # --grad-reduce-in-bf16, as the script passes it; without it Megatron-LM's fp32 default
    assert "gradients: accumulated in bf16, reduced in bf16 (DeepSpeed's ZeRO stage 1 optimizer" in out
    rest = type(script)(script.name, script.world, _without(script.argv, "--grad-reduce-in-bf16"))
    rc, out, err = dry_run(rest, _files(tmp_path, write_data=False))
    assert rc == 0 and "gradients: accumulated in fp32, reduced in fp32 (DeepSpeed's BF16_Optimizer" in out, err[-2000:]
