"""tools/evaluate.py takes Megatron's zero-shot command line whole (examples/evaluate_zeroshot_gpt.sh:
the model shape, --tensor-model-parallel-size, --log-interval, --no-load-optim, --no-load-rng): flags
that agree with the checkpoint give the results of the command without them; one that disagrees is
an error naming each mismatch, in one line."""
from __future__ import annotations

import json

import pytest

from tests.inference.common import imported_gpt2, sentence

pytest.importorskip("transformers")


def test_megatron_model_flags_are_checked_against_the_checkpoint(tmp_path, capsys):
    from megatron_ds.cli.evaluate import main

    ckpt = imported_gpt2(tmp_path)  # 2 layers, hidden 32, 4 heads, 48 positions
    lam = tmp_path / "lambada.jsonl"
    lam.write_text("".join(json.dumps({"text": sentence(i, 8)}) + "\n" for i in range(6)))
    # one batch size for both: batches of another size pad to other shapes, whose matmuls may sum in
    # another order (AVX-512 kernels do), and the perplexity is compared exactly
    plain = ["--load", ckpt, "--task", "LAMBADA", "--valid-data", str(lam), "--strict-lambada", "--no-progress",
             "--batch-size", "8"]
    megatron = ["--tensor-model-parallel-size", "1", "--num-layers", "2", "--hidden-size", "32",
                "--num-attention-heads", "4", "--batch-size", "8", "--seq-length", "48",
                "--max-position-embeddings", "48", "--log-interval", "10", "--no-load-optim", "--no-load-rng"]
    assert main(plain + ["--output", str(tmp_path / "plain.json")]) == 0
    assert main(plain + megatron + ["--output", str(tmp_path / "megatron.json")]) == 0
    a, b = (json.load(open(tmp_path / f"{n}.json"))["task"] for n in ("plain", "megatron"))
    assert a == b and a["samples"] == 6
    capsys.readouterr()

    wrong = ["--num-layers", "24", "--hidden-size", "32", "--num-attention-heads", "16",
             "--tensor-model-parallel-size", "2"]
    assert main(plain + wrong + ["--output", str(tmp_path / "wrong.json")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: the command line does not match the checkpoint: --num-layers 24 (the checkpoint has 2); "
                   "--num-attention-heads 16 (the checkpoint has 4); --tensor-model-parallel-size 2 (1 process "
                   "launched, one per tensor parallel rank)"]
    assert not (tmp_path / "wrong.json").exists()
