"""DeepSpeed universal checkpoints (``--universal-checkpoint``).

Ours -> universal -> any layout: a run at (TP 2, PP 2) with ZeRO-1 saves at steps 3 and 6;
DeepSpeed's own converter (``deepspeed.checkpoint.ds_to_universal``, run in-process exactly as its
command line does) turns step 3 into a universal checkpoint, and a run at another layout resumes
from it with ``--universal-checkpoint``: losses of steps 4-6 and the step-6 weights must equal the
uninterrupted run's. The bf16 case converts through tools/checkpoint/to_universal.py (the same
converter behind checks that refuse what it cannot take). The run flags, layouts and tolerances are those of test_reshard.py (see its
docstring: same model, same reasons); the universal files hold the same fp32 masters and Adam
moments that resharding reads, so nothing here is looser.
"""
import argparse
import json
import os

import pytest

from megatron_ds.cli import to_universal
from tests.checkpoint.test_reshard import BF16, FP32, _check_resumed, _straight
from tests.checkpoint.test_reshard_interleaved import INTERLEAVED


def ds_to_universal(ckpt: str, iteration: int) -> str:
    """``python -m deepspeed.checkpoint.ds_to_universal --input_folder ckpt/global_stepN
    --output_folder ckpt/global_stepN_universal`` (one worker: the test machine has two cores)."""
    from deepspeed.checkpoint import ds_to_universal as tool

    out = os.path.join(ckpt, f"global_step{iteration}_universal")
    tool.main(argparse.Namespace(input_folder=os.path.join(ckpt, f"global_step{iteration}"), output_folder=out,
                                 num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
                                 inject_missing_state=False))
    return out


@pytest.mark.parametrize("precision,tol", [([], FP32), (["--bf16"], BF16)], ids=["fp32", "bf16"])
def test_ours_tp2_pp2_zero1_to_universal_resumes_at_dp2(tmp_path_factory, tmp_path, precision, tol):
    extra = [*precision, "--zero-stage", "1"]
    straight, ckpt = _straight(tmp_path_factory, "uc", (2, 2, 1), extra)
    if precision:
        assert to_universal.main(["--load", ckpt, "--iteration", "3", "--workers", "1"]) == 0
        out = os.path.join(ckpt, "global_step3_universal")
    else:
        out = ds_to_universal(ckpt, 3)
    assert sorted(os.listdir(os.path.join(out, "zero", "tied_modules.embed.word_embeddings.weight"))) == \
        ["exp_avg.pt", "exp_avg_sq.pt", "fp32.pt", "step.pt"]
    _check_resumed(straight, ckpt, (1, 1, 2), [*extra, "--universal-checkpoint"], tmp_path, tol)
    if not precision:  # and into the interleaved schedule's model chunks (their own parameter names)
        _check_resumed(straight, ckpt, (1, 2, 1), [*extra, "--universal-checkpoint", *INTERLEAVED],
                       tmp_path_factory.mktemp("interleaved"), tol)


def test_what_ds_to_universal_cannot_take_is_refused_in_one_line(tmp_path, capsys):
    """ZeRO-0: DeepSpeed writes no per-parameter optimizer fragments for ds_to_universal to read
    (fp32: "can't find *_optim_states.pt files"; bf16: no param_shapes)."""
    step = tmp_path / "global_step1"
    step.mkdir()
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("1")
    sig = dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, data_parallel_size=1, zero_stage=0,
               precision="fp32", padded_vocab_size=64)
    model = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, max_position_embeddings=16)
    (step / "megatron_ds_config.json").write_text(json.dumps({"signature": sig, "config": {"model": model}}))
    assert to_universal.main(["--load", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "saved without ZeRO" in err and "--zero-stage 1" in err


def test_load_without_a_universal_checkpoint_says_how_to_make_one(tmp_path):
    from megatron_ds.checkpoint.universal import find_universal
    from megatron_ds.errors import ConfigError

    with pytest.raises(ConfigError, match="ds_to_universal --input_folder"):
        find_universal(str(tmp_path))


def test_bert_and_t5_are_refused_both_ways(tmp_path, capsys):
    """The converter's parameter patterns are the GPT's (Megatron-DeepSpeed declares
    UniversalCheckpointInfo in gpt_model.py only): a BERT checkpoint is refused before conversion, and a
    BERT/T5 run asked for --universal-checkpoint says to use --load (which reshards those families)."""
    from megatron_ds.checkpoint.universal import load_universal
    from megatron_ds.errors import ConfigError
    from megatron_ds.families import get_family

    step = tmp_path / "global_step1"
    step.mkdir()
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("1")
    sig = dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, data_parallel_size=1, zero_stage=1,
               precision="fp32", padded_vocab_size=64, model_family="bert")
    model = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, max_position_embeddings=16)
    meta = {"signature": sig, "config": {"model": model}, "model_family": "bert"}  # as training/trainer.py writes
    (step / "megatron_ds_config.json").write_text(json.dumps(meta))
    assert to_universal.main(["--load", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is a BERT checkpoint" in err and "--load" in err
    with pytest.raises(ConfigError, match="this run is T5; load its checkpoints with --load alone"):
        load_universal(None, str(tmp_path), signature={"model_family": "t5"}, ps=None, load_optim=True,
                       load_lr_state=True, family=get_family("t5"))
