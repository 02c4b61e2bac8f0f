"""Megatron-DeepSpeed flags that are another spelling of something here, resolved as its
megatron/arguments.py and megatron/checkpointing.py read them (deepspeedai/Megatron-DeepSpeed, commit 4efb479)."""
from __future__ import annotations

import pytest

from megatron_ds.config import parse_args, resolve
from megatron_ds.errors import ConfigError
from megatron_ds.families.gpt.gpt_family import GPT

ARGS = ("--num-layers 2 --hidden-size 8 --num-attention-heads 2 --seq-length 8 --micro-batch-size 1 "
        "--lr 1e-3 --train-iters 4 --mock-data --vocab-size 64").split()


def _run(*argv):
    cfg, _ = parse_args(ARGS + list(argv))
    return resolve(cfg, world_size=1, vocab_size=64, device_type="cpu", family=GPT)


@pytest.mark.parametrize("extra,notes", [((), 0), (("--recompute-granularity", "full"), 1),
                                         (("--checkpoint-activations",), 0)])
def test_recompute_activations_is_selective(extra, notes):
    # validate_args: `if args.recompute_activations: args.recompute_granularity = 'selective'` (it wins
    # over --recompute-granularity full; --checkpoint-activations then stays without effect, as there)
    run = _run("--recompute-activations", *extra)
    assert run.layout.recompute == "selective"
    assert sum("--recompute-activations" in n for n in run.notes) == notes


def test_load_tag_is_the_checkpoint_directory():
    # load_checkpoint passes tag=args.load_tag to DeepSpeed's engine: the global_stepN directory to load
    assert _run("--load", "ck", "--load-tag", "global_step40").checkpoint.ckpt_step == 40
    assert _run("--load", "ck", "--load-tag", "global_step40", "--ckpt-step", "40").checkpoint.ckpt_step == 40
    with pytest.raises(ConfigError, match="name different checkpoints"):
        _run("--load", "ck", "--load-tag", "global_step40", "--ckpt-step", "30")
    with pytest.raises(ConfigError, match="--load-tag best: checkpoints here are named global_stepN"):
        _run("--load", "ck", "--load-tag", "best")


def test_rotary_theta_spelling():
    # --rotary-position-embeddings-theta is Megatron-DeepSpeed's name for the RoPE base
    cfg, _ = parse_args(["--rotary-position-embeddings-theta", "500000"])
    assert cfg.model.rope_theta == 500000.0


def test_lr_scalar_can_be_left_out_of_tensorboard():
    assert parse_args(["--no-log-learnig-rate-to-tensorboard"])[0].logging.log_learning_rate_to_tensorboard is False
    assert parse_args([])[0].logging.log_learning_rate_to_tensorboard is True
