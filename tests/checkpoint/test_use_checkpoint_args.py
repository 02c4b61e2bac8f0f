"""--use-checkpoint-args: the model shape, tokenizer type and parallel sizes from the flags the --load
checkpoint was saved with, as Megatron-DeepSpeed's load_args_from_checkpoint sets them
(megatron/checkpointing.py, commit 4efb479): sizes fill flags the command line left unset, the
switches (biases, SwiGLU, untied output, position embeddings) and the parallel sizes win over it."""
from __future__ import annotations

import contextlib
import io
import json
import os

import pytest

from megatron_ds.checkpoint.format import META, write_trackers
from megatron_ds.checkpoint.integrity import write_manifest
from megatron_ds.config import parse_args, resolve
from megatron_ds.errors import ConfigError
from megatron_ds.families import main
from megatron_ds.families.gpt.gpt_family import GPT

SAVED = ("--num-layers 4 --hidden-size 64 --num-attention-heads 8 --num-key-value-heads 2 --seq-length 32 "
         "--max-position-embeddings 32 --micro-batch-size 1 --lr 1e-3 --train-iters 10 --swiglu "
         "--disable-bias-linear --untie-embeddings-and-output-weights --use-rotary-position-embeddings "
         "--no-position-embedding --tensor-model-parallel-size 2 --mock-data --vocab-size 512").split()


def _checkpoint(tmp_path, argv=SAVED, iteration=5):
    """A --save directory holding one complete checkpoint whose record is ``argv``'s flags."""
    step = tmp_path / f"global_step{iteration}"
    step.mkdir(parents=True)
    (step / "mp_rank_00_model_states.pt").write_bytes(b"weights")
    (step / META).write_text(json.dumps({"config": parse_args(argv)[0].to_dict()}))
    write_manifest(str(step), iteration)
    write_trackers(str(tmp_path), iteration)
    return str(tmp_path)


def test_checkpoint_flags_fill_and_win(tmp_path):
    load = _checkpoint(tmp_path)
    argv = ["--load", load, "--use-checkpoint-args", "--hidden-size", "128", "--num-attention-heads", "8",
            "--micro-batch-size", "1", "--lr", "1e-3", "--train-iters", "3", "--mock-data", "--vocab-size", "512"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv + ["--dry-run", "--world-size", "2"]) == 0
    text = out.getvalue()
    # filled (unset here): layers, kv heads, sequence length; kept (set here): hidden size 128
    assert "model: 4 layers, hidden 128, heads 8 (kv 2)" in text and "seq 32" in text
    # won over the command line's defaults: SwiGLU, no biases, RoPE, TP 2
    assert "swiglu" in text and "positions rope" in text and "TP 2" in text
    assert "WARNING: --use-checkpoint-args: swiglu = True from the checkpoint (command line: False)" in text
    assert "num_layers" in text and "hidden_size = " not in text


def test_needs_load_and_tolerates_a_checkpoint_without_flags(tmp_path):
    cfg, _ = parse_args(["--use-checkpoint-args", *SAVED])
    with pytest.raises(ConfigError, match="--use-checkpoint-args needs --load"):
        resolve(cfg, world_size=2, vocab_size=512, device_type="cpu", saved_flags=None, family=GPT)
    cfg, _ = parse_args(["--use-checkpoint-args", "--load", str(tmp_path), *SAVED])
    run = resolve(cfg, world_size=2, vocab_size=512, device_type="cpu", saved_flags=None, family=GPT)
    assert any("has no saved flags" in n for n in run.notes)
    assert os.listdir(tmp_path) == []
