"""End to end through the real CLIs: preprocess_data output -> a launcher running pretrain_gpt.py
on CPU with two pipeline stages -> Megatron-format logs -> checkpoint -> resume.

The log lines are parsed with the regex a Megatron log parser uses, so a format drift fails here.
"""
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Megatron-LM's iteration line, field by field (the shape log parsers match).
ITERATION_RE = re.compile(
    r"^ iteration\s+(?P<it>\d+)/\s*(?P<total>\d+) \|"
    r" consumed samples:\s+(?P<samples>\d+) \|"
    r" elapsed time per iteration \(ms\): (?P<ms>[0-9.]+) \|"
    r" learning rate: (?P<lr>[0-9.]+E[+-]\d+) \|"
    r" global batch size:\s+(?P<gbs>\d+) \|"
    r" lm loss: (?P<loss>[0-9.]+E[+-]\d+) \|"
    r" loss scale: (?P<scale>[0-9.]+) \|"
    r" grad norm: (?P<gnorm>[0-9.]+) \|"
    r" number of skipped iterations:\s+(?P<skipped>\d+) \|"
    r" number of nan iterations:\s+(?P<nans>\d+) \|"
    r" samples per second: [0-9.]+ \| tokens per second per GPU: [0-9.]+ \| TFLOP/s per GPU: [0-9.]+ \|"
    r" peak memory \(GB\): [0-9.]+ \|( ETA: [0-9:]+ \|)?$")
VALIDATION_RE = re.compile(r"^ validation loss at iteration (\d+) \| lm loss value: ([0-9.]+E[+-]\d+) \|"
                           r" lm loss PPL: ([0-9.]+E[+-]\d+) \| $")


def _train(launcher, data, ckpt, iters, extra=()):
    cmd = launcher + [str(REPO / "pretrain_gpt.py"),
                      "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                      "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "4",
                      "--global-batch-size", "16", "--pipeline-model-parallel-size", "2",
                      "--train-iters", str(iters), "--lr-decay-iters", "40", "--lr", "3e-3",
                      "--lr-decay-style", "cosine", "--lr-warmup-iters", "3", "--hidden-dropout", "0",
                      "--attention-dropout", "0", "--data-path", data["prefix"], "--split", "95,5,0",
                      "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", data["vocab"],
                      "--merge-file", data["merges"], "--log-interval", "2", "--eval-interval", "10",
                      "--eval-iters", "2", "--save", ckpt, "--save-interval", "100", "--num-workers", "1",
                      "--deepspeed", "--no-masked-softmax-fusion", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


def _parse(stdout):
    its = [m.groupdict() for m in map(ITERATION_RE.match, stdout.splitlines()) if m]
    vals = [m.groups() for m in map(VALIDATION_RE.match, stdout.splitlines()) if m]
    return its, vals


def _check_tensorboard(tb_dir, losses, vals):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    scalars = acc.Tags()["scalars"]
    assert {"lm loss", "learning-rate", "grad-norm", "lm loss validation", "lm loss validation ppl"} <= set(scalars)
    logged = [e.value for e in acc.Scalars("lm loss")]
    # the printed values are rounded to 7 significant digits
    assert logged == pytest.approx(losses, rel=1e-6)
    assert acc.Scalars("lm loss validation")[0].value == pytest.approx(float(vals[0][1]), rel=1e-6)


@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed"])
def test_train_and_resume_with_launcher(tmp_path, e2e_data, launcher):
    bindir = Path(sys.executable).parent
    # the venv's `deepspeed` command, run by this interpreter: where the venv is reached through a
    # symlink, its shebang names the venv's other path, whose processes would rebuild the DeepSpeed
    # op (shared-memory comm) of TORCH_EXTENSIONS_DIR for their include paths, and the next test's
    # processes rebuild it back (~45 s each on two cores)
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
           if launcher == "torchrun" else [sys.executable, str(bindir / "deepspeed"), "--num_gpus", "2",
                                           "--master_port", str(29700 + os.getpid() % 200)])
    ckpt, tb_dir = str(tmp_path / "ckpt"), tmp_path / "tb"
    out = _train(cmd, e2e_data, ckpt, 30, ["--tensorboard-dir", str(tb_dir), "--log-validation-ppl-to-tensorboard"])
    its, vals = _parse(out)
    assert [int(r["it"]) for r in its] == list(range(2, 31, 2))
    for r in its:
        assert int(r["total"]) == 30 and int(r["gbs"]) == 16
        assert int(r["samples"]) == 16 * int(r["it"])
        assert int(r["skipped"]) == 0 and int(r["nans"]) == 0
        assert math.isfinite(float(r["loss"]))
    losses = [float(r["loss"]) for r in its]
    # ln(1024) = 6.93 is the loss of a uniform guess; 30 steps on real text take it down by about a
    # nat, far beyond the +-0.1 step-to-step noise of a batch of 16 x 64 tokens
    assert losses[0] > 6.0 and losses[-1] < losses[0] - 0.6, losses
    assert len(vals) >= 3  # iterations 10, 20, 30 and the final validation-set pass
    assert math.exp(float(vals[0][1])) == pytest.approx(float(vals[0][2]), rel=1e-5)
    assert "WARNING: ignoring flags with no effect here: --no-masked-softmax-fusion" in out
    assert (Path(ckpt) / "latest_checkpointed_iteration.txt").read_text() == "30"
    _check_tensorboard(tb_dir, losses, vals)

    resumed = _train(cmd, e2e_data, ckpt, 34, ["--load", ckpt])
    its2, _ = _parse(resumed)
    assert "loaded checkpoint" in resumed and "(iteration 30)" in resumed
    assert [int(r["it"]) for r in its2] == [32, 34]
    assert int(its2[0]["samples"]) == 32 * 16
    assert float(its2[-1]["loss"]) < losses[0] - 0.6


def test_wrong_tokenizer_data_is_reported(tmp_path, e2e_data):
    """Data made with a bigger vocabulary than the model's tokenizer: a message, not a device assert."""

    # NullTokenizer with 100 ids claims a vocabulary far smaller than the BPE ids in the data
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
            "--micro-batch-size", "2", "--train-iters", "1", "--lr", "1e-3", "--data-path", e2e_data["prefix"],
            "--split", "95,5,0", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
            "--num-workers", "0", "--data-cache-path", str(tmp_path / "cache")]
    rc = subprocess.run([sys.executable, str(REPO / "pretrain_gpt.py"), *argv], capture_output=True, text=True,
                        cwd=REPO, timeout=300, env={k: v for k, v in os.environ.items()
                                                    if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")})
    assert rc.returncode == 1, rc.stdout[-2000:] + rc.stderr[-2000:]
    assert re.search(r"error: token id \d+ is outside the model's vocabulary \(size 101\) in data set "
                     + re.escape(e2e_data["prefix"]), rc.stderr), rc.stderr[-2000:]
    assert "Traceback" not in rc.stderr
