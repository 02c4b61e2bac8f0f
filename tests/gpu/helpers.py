"""Running the real pretrain_gpt.py on this machine's first GPU and reading its log."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch.helpers import free_port

REPO = Path(__file__).resolve().parents[2]
# Where two runs are compared with a tolerance: GPU kernels are not bitwise reproducible from one
# process to the next (atomics in attention and matmul backward, split-K choices), and bf16 rounds
# at 2^-8. Over a dozen steps of a 4-layer model losses then agree to ~1e-3 relative; a lost piece
# of state (Adam moments, LR step, data position, a skipped recompute) moves them by >= 1e-2.
RUN_TO_RUN = dict(rtol=5e-3, atol=0.0)

SHAPE = ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 256 "
         "--max-position-embeddings 256 --micro-batch-size 4 --global-batch-size 8 --lr 1e-3 "
         "--lr-warmup-iters 2 --lr-decay-style cosine --log-interval 1 --eval-interval 1000 --eval-iters 0 "
         "--hidden-dropout 0 --attention-dropout 0 --seed 1234 --num-workers 2").split()


def data_flags(data: dict) -> list[str]:
    return ["--data-path", data["prefix"], "--split", "98,2,0", "--tokenizer-type", "GPT2BPETokenizer",
            "--vocab-file", data["vocab"], "--merge-file", data["merges"]]


def run_cli(argv: list[str], timeout: int = 300) -> dict:
    """pretrain_gpt.py as a user starts it (one process, GPU 0); returns the parsed log:
    {"lines": [iteration line fields], "losses": [...], "stdout": ...}."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                        "DS_ACCELERATOR")}
    # a port of our own: the single-process default (29500) may be held by another job
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="4", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    proc = subprocess.run([sys.executable, str(REPO / "pretrain_gpt.py"), *argv], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"pretrain_gpt.py exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    lines = [parse_iteration_line(line) for line in proc.stdout.splitlines() if line.startswith(" iteration ")]
    return {"lines": lines, "losses": [x.get("lm loss") for x in lines], "stdout": proc.stdout, "stderr": proc.stderr}


def parse_iteration_line(line: str) -> dict:
    """Megatron's iteration line as {field: number}; "iteration" is the step number. Fields that a
    step does not have (the grad norm of a skipped fp16 step) are simply absent."""
    fields = {}
    for part in line.split("|"):
        key, sep, value = part.rpartition(":")
        if not sep:
            continue
        key, value = key.strip(), value.strip()
        try:
            fields[key] = float(value)
        except ValueError:
            continue
    first = line.split("|")[0].split()
    fields["iteration"] = int(first[1].split("/")[0])
    return fields


def startup_device(stdout: str) -> str:
    match = re.search(r"> megatron_ds on (\w+):", stdout)
    return match.group(1) if match else ""
