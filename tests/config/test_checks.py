"""Numeric flags are range-checked by name, through pretrain_gpt.py's main (--dry-run: no processes)."""
import pytest

from megatron_ds.families import main

BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 16 --micro-batch-size 2 "
        "--train-iters 10 --lr 1e-3 --mock-data --vocab-size 128 --dry-run --world-size 1").split()


def _error(capsys, *flags):
    rc = main(BASE + list(flags))
    err = capsys.readouterr().err
    assert rc == 1, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err.strip()


@pytest.mark.parametrize("flags,expected", [
    (["--lr", "nan"], "error: --lr nan is out of range: it must be a finite number >= 0.0"),
    (["--lr", "-1e-3"], "error: --lr -0.001 is out of range: it must be a finite number >= 0.0"),
    (["--lr", "inf"], "error: --lr inf is out of range"),
    (["--train-iters", "-5"], "error: --train-iters -5 is out of range: it must be >= 0"),
    (["--micro-batch-size", "0"], "error: --micro-batch-size 0 is out of range: it must be >= 1"),
    (["--global-batch-size", "-8"], "error: --global-batch-size -8 is out of range: it must be >= 1"),
    (["--hidden-dropout", "1.5"], "error: --hidden-dropout 1.5 is out of range: it must be a finite number in [0.0, 1.0)"),
    (["--attention-dropout", "-0.1"], "error: --attention-dropout -0.1 is out of range"),
    (["--clip-grad", "-1"], "error: --clip-grad -1.0 is out of range: it must be a finite number >= 0.0"),
    (["--min-lr", "nan"], "error: --min-lr nan is out of range"),
    (["--distributed-timeout-minutes", "0"], "error: --distributed-timeout-minutes 0.0 is out of range: it must be a finite number > 0.0"),
    (["--keep-last", "0"], "error: --keep-last 0 is out of range: it must be >= 1"),
    # checked before Megatron-DeepSpeed's overrides clear the loss-scale flags (which read the value:
    # log2(-1) was a traceback when the override ran first)
    (["--fp16", "--initial-loss-scale", "-1"],
     "error: --initial-loss-scale -1.0 is out of range: it must be a finite number >= 1.0"),
])
def test_out_of_range_flag_is_named(capsys, flags, expected):
    assert _error(capsys, *flags).startswith(expected)


def test_every_bad_flag_is_listed_at_once(capsys):
    err = _error(capsys, "--lr", "-1", "--train-iters", "-5")
    assert "--lr -1.0 is out of range" in err and "--train-iters -5 is out of range" in err


def test_min_lr_above_lr_still_names_both(capsys):
    assert _error(capsys, "--lr", "1e-4", "--min-lr", "1e-3") == "error: --min-lr 0.001 is above --lr 0.0001"


def test_valid_values_pass(capsys):
    assert main(BASE + ["--hidden-dropout", "0", "--clip-grad", "0", "--lr", "0"]) == 0
    capsys.readouterr()
