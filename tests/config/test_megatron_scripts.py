"""Real Megatron-DeepSpeed launch scripts (tests/config/megatron_scripts.py) through --dry-run as written.

Each must be accepted, with the warnings Megatron-DeepSpeed's silent overrides call for, or -- where
it uses a feature out of scope here (DeepSpeed-Ulysses) -- refused with a one-line
reason before anything starts.
"""
import contextlib
import io
import json
import os
import re
from pathlib import Path

import pytest

from megatron_ds.families import main
from tests.config.megatron_scripts import scripts
from tests.data.test_gpt_dataset import write_dataset
from tests.data.test_japanese_sentencepiece import train_abci_recipe

# the real GPT-2 files: ../shared/data/gpt2 beside the checkout (or MEGATRON_DS_GPT2_DIR)
GPT2_DIR = Path(os.environ.get("MEGATRON_DS_GPT2_DIR",
                               Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "gpt2"))
pytestmark = pytest.mark.skipif(not (GPT2_DIR / "gpt2-vocab.json").is_file(),
                                reason="GPT-2 vocab/merges not found in ../shared/data/gpt2")


def _files(tmp_path, write_data=True) -> dict:
    """The files the scripts name; the data set is real (--dry-run opens it): 1000 tiny documents,
    so that --split 949,50,1 leaves every split some."""
    data = str(tmp_path / "corpus_text_document")
    if write_data:
        write_dataset(data, [[464, 2068]] * 1000)
    return {"vocab": str(GPT2_DIR / "gpt2-vocab.json"), "merges": str(GPT2_DIR / "gpt2-merges.txt"),
            "data": data, "ckpt": str(tmp_path / "ckpt"), "tb": str(tmp_path / "tb"),
            "json": str(tmp_path / "ds_config.json"), "spm": str(tmp_path / "abci.model")}


def dry_run(script, files) -> tuple[int, str, str]:
    if script.ds_json is not None:
        Path(files["json"]).write_text(json.dumps(script.ds_json))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(script.argv + ["--dry-run", "--world-size", str(script.world)])
        except SystemExit as exc:  # argparse refusals
            rc = exc.code
    return rc, out.getvalue(), err.getvalue()


CASES = scripts(_files(Path("/nonexistent"), write_data=False))


@pytest.mark.parametrize("index", range(len(CASES)), ids=[s.name for s in CASES])
def test_script_runs_as_written(tmp_path, index):
    files = _files(tmp_path)
    script = scripts(files)[index]
    if files["spm"] in script.argv:
        train_abci_recipe(tmp_path)
    rc, out, err = dry_run(script, files)
    if script.refused:
        assert rc != 0 and re.search(script.refused, err), (rc, err)
        assert len(err.strip().splitlines()) <= 2, err  # one line (+ argparse's pointer to --help)
        return
    assert rc == 0, err
    for note in script.notes:
        assert note in out, (note, out)
    ds = json.loads(out[out.index("DeepSpeed config:") + len("DeepSpeed config:"):])
    assert ds["train_micro_batch_size_per_gpu"] == int(script.argv[script.argv.index("--micro-batch-size") + 1])


def test_token_script_resolves_its_token_schedule(tmp_path):
    """rebase_125M trains 300B tokens (not the 600B-token --train-samples cap) with token warmup/decay."""
    files = _files(tmp_path)
    script = next(s for s in scripts(files) if s.name == "rebase_125M")
    rc, out, err = dry_run(script, files)
    assert rc == 0, err
    assert "train until 300,000,000,000 tokens" in out
    # the cap: --train-samples 292968750 // global batch 256
    assert "global 256; 1144409 iterations" in out


def test_rampup_script_iterations_follow_megatron(tmp_path):
    """pretrain_gpt3_175B.sh: ramp 16 -> 1536 by 16 over 5,859,375 samples; the iteration count is
    Megatron's update_train_iters, computed here by its loop transcribed independently."""
    files = _files(tmp_path)
    script = next(s for s in scripts(files) if s.name == "megatron_gpt3_175B")
    rc, out, err = dry_run(script, files)
    assert rc == 0, err
    per_increment = 5859375 / ((1536 - 16) // 16)
    consumed = iterations = 0
    while consumed <= 5859375:
        batch = 1536 if consumed > 5859375 else 16 + 16 * int(consumed / per_increment)
        consumed += batch
        iterations += 1
    iterations += (146484375 - consumed) // 1536
    assert f"global 1536; {iterations} iterations" in out
    assert "batch ramp-up: global 16 + 16 every" in out


def test_ulysses_script_shows_its_layout_and_memory(tmp_path):
    """The 32k example: 8 GPUs = SP 4 x DP 2; ZeRO 1 splits the fp32 master weights and Adam moments
    (12 bytes per parameter) over the 8 ranks holding the same weights (DeepSpeed hands ZeRO the
    sequence data parallel group), and one rank keeps the activations of 32768 / 4 positions."""
    files = _files(tmp_path)
    script = next(s for s in scripts(files) if s.name == "sequence_parallel_1.3B_32k")
    rc, out, err = dry_run(script, files)
    assert rc == 0, err
    assert "world size 8 = TP 1 x PP 1 x SP 4 (DeepSpeed-Ulysses) x DP 2 (plain engine, ZeRO 1, fp16)" in out
    params = 1_378_734_080  # the meta-device build's count, printed above the estimate
    assert f"stage 0: {params:,} parameters built" in out
    assert f"optimizer states {params * 12 / 8 / 1e9:.2f}," in out
