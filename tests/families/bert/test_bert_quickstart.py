"""BERT end to end on real text (the quickstart's corpus, a WordPiece vocabulary trained on it,
--split-sentences data, Megatron-DeepSpeed's BERT samples):

- the tiny quickstart (`python tools/quickstart.py --model bert --size tiny`) trains on 2 CPU
  processes (pipeline parallel 2) with falling masked-LM loss, resumes from its checkpoint,
  evaluates masked-LM accuracy on held-out modules and exports a model transformers loads;
- resume is exact: 6 steps straight == 3 steps, save, fresh processes, load, 3 more (bitwise on
  CPU fp32, dropout on, pipeline parallel 2: weights, Adam moments, LR step, data position and
  RNG streams all restored, as tests/training/test_resume.py shows for the GPT).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ds.data.tokenizer import build_tokenizer
from tests.distributed import run_distributed
from tests.e2e_data import seed_masked_workdir
from tests.families.bert.test_bert_parity import bert_losses

pytestmark = pytest.mark.timeout(1200)
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def bert_data(masked_tiny_data):
    """(training prefix, held-out prefix, vocab.txt) of the tiny quickstart (tests/conftest.py)."""
    return masked_tiny_data["prefix"], masked_tiny_data["heldout"], masked_tiny_data["vocab"]


def test_bert_resume_equals_straight_run(bert_data, tmp_path):
    prefix, _, vocab = bert_data
    run = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
           "--micro-batch-size 2 --global-batch-size 8 --lr 1e-3 --train-iters 6 --log-interval 1 "
           "--eval-interval 1000 --eval-iters 1 --num-workers 0 --split 949,50,1 "
           "--tokenizer-type BertWordPieceLowerCase --pipeline-model-parallel-size 2").split()
    run += ["--data-path", prefix, "--vocab-file", vocab, "--data-cache-path", str(tmp_path / "cache")]
    straight = run_distributed(bert_losses, 2, run, timeout=900)[-1]
    ckpt = str(tmp_path / "ckpt")
    first = run_distributed(bert_losses, 2, run + ["--save", ckpt, "--save-interval", "100", "--exit-interval", "3"],
                            timeout=900)[-1]
    second = run_distributed(bert_losses, 2, run + ["--load", ckpt], timeout=900)[-1]
    assert [it for it, _ in first] == [1, 2, 3] and [it for it, _ in second] == [4, 5, 6]
    assert first + second == straight


def test_quickstart_bert_tiny_trains_evaluates_and_exports(tmp_path, capsys, masked_tiny_data):
    from megatron_ds.cli.quickstart import main
    from megatron_ds.families.bert.bert_quickstart import BERT_PRESETS

    preset = BERT_PRESETS["tiny"]
    work = tmp_path / "qs"
    seed_masked_workdir(masked_tiny_data, preset, work)  # steps 1-3 built once per session
    assert main(["--model", "bert", "--workdir", str(work), "--size", "tiny", "--workers", "1"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "Writing model shards" not in captured.err  # transformers' progress bar, around the one file saved
    assert (work / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == str(preset.iters)
    assert "loaded checkpoint" in (work / "resume.log").read_text()

    # the masked-LM loss falls over the first job's iterations (logged every iteration at this size)
    lm = [float(x) for x in re.findall(r" iteration\s+\d+/\s*\d+ \|.*? lm loss: ([0-9.E+-]+) \|",
                                       (work / "train.log").read_text())]
    assert len(lm) == preset.iters - preset.resume_iters and lm[-1] < lm[0]
    assert "sop loss:" in (work / "train.log").read_text()

    evaluation = json.load(open(work / "evaluation.json"))
    assert evaluation["masked_tokens"] > 50 and 0 <= evaluation["accuracy"] <= 1
    assert 0 <= evaluation["sop_accuracy"] <= 1 and evaluation["lm_loss"] > 0
    assert "masked-LM accuracy" in out

    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForPreTraining.from_pretrained(work / "hf")
    assert type(model).__name__ == "MegatronBertForPreTraining"
    tokenizer = transformers.AutoTokenizer.from_pretrained(work / "hf")
    ours = build_tokenizer("BertWordPieceLowerCase", vocab_file=str(work / "tokenizer" / "vocab.txt"),
                           log=lambda *a: None)
    text = "Return a new list of the items, sorted."
    ids = tokenizer(text, return_tensors="pt")
    assert ids["input_ids"][0].tolist() == [ours.cls] + ours.tokenize(text) + [ours.sep]
    assert model(**ids).prediction_logits.shape[-1] == len(tokenizer) == ours.vocab_size

    # Step 7 again, as its own process, where nothing has imported transformers' model classes (and so
    # torchao) yet: what a new user's export prints is our lines only, none of torchao's "Failed to load
    # .../_C_mxfp8...so" nor torch's register_constant() deprecation, nor a progress bar.
    export = subprocess.run([sys.executable, str(REPO / "tools" / "checkpoint" / "to_hf.py"), "--load",
                             str(work / "checkpoints"), "--out", str(tmp_path / "hf_again")],
                            capture_output=True, text=True, cwd=REPO, timeout=600)
    assert export.returncode == 0, export.stderr[-2000:]
    printed = export.stdout + export.stderr
    assert "wrote MegatronBertForPreTraining" in printed
    for noise in ("Failed to load", "_C_mxfp8", "register_constant", "Writing model shards", "WARNING"):
        assert noise not in printed, printed


def test_evaluate_mlm_counts_as_an_independent_model_does(bert_data, tmp_path):
    """tools/evaluate_mlm.py's accuracy equals the accuracy transformers' own model (our export)
    reaches on the same samples, counted here from its logits."""
    import torch

    from megatron_ds.checkpoint.consolidate import load_consolidated
    from megatron_ds.cli.evaluate_mlm import _datasets
    from megatron_ds.data.tokenizer import build_tokenizer
    from megatron_ds.families.bert.bert_family import BERT, BertCollator
    from megatron_ds.families.bert.bert_hf import write_hf_bert
    from megatron_ds.families.bert.masked_lm import load_bert, masked_lm_accuracy

    transformers = pytest.importorskip("transformers")
    prefix, heldout, vocab = bert_data
    ckpt = str(tmp_path / "ckpt")
    run = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
           "--micro-batch-size 4 --global-batch-size 8 --lr 2e-3 --train-iters 4 --log-interval 1 "
           "--eval-interval 1000 --eval-iters 1 --num-workers 0 --tokenizer-type BertWordPieceLowerCase").split()
    run += ["--data-path", prefix, "--vocab-file", vocab, "--save", ckpt, "--data-cache-path", str(tmp_path / "c")]
    run_distributed(bert_losses, 1, run, timeout=900)
    weights = load_consolidated(ckpt, family=BERT, log=lambda *a: None)
    tokenizer = build_tokenizer("BertWordPieceLowerCase", vocab_file=vocab, log=lambda *a: None)
    args = argparse.Namespace(data_path=heldout, samples=64, seed=None)
    samples = [s for _, s in zip(range(64), _datasets(args, weights, tokenizer))]
    batches = [BertCollator(tokenizer.vocab_size, "heldout")(samples[i:i + 8]) for i in range(0, len(samples), 8)]
    ours = masked_lm_accuracy(load_bert(weights), batches, tokenizer.vocab_size)

    write_hf_bert(str(tmp_path / "hf"), weights.model, weights.state_dict, tokenizer.vocab_size, log=lambda *a: None)
    hf = transformers.AutoModelForPreTraining.from_pretrained(tmp_path / "hf").eval()
    correct = scored = order = 0
    with torch.no_grad():
        for (text, types, padding), (labels, loss_mask, is_random) in batches:
            out = hf(input_ids=text, token_type_ids=types, attention_mask=padding)
            picked = loss_mask > 0
            correct += int((out.prediction_logits.argmax(-1)[picked] == labels[picked]).sum())
            scored += int(picked.sum())
            order += int((out.seq_relationship_logits.argmax(-1) == is_random).sum())
    assert ours["masked_tokens"] == scored > 0
    assert ours["accuracy"] == correct / scored
    assert ours["sop_accuracy"] == order / len(samples)


def test_data_of_another_tokenizer_is_one_line(bert_data, tmp_path):
    """Data made with a bigger WordPiece vocabulary than the run's: one line naming the data set, not an
    IndexError from inside a loader worker (the masking looks every token up before anything else)."""
    prefix, _, vocab = bert_data
    with open(vocab, encoding="utf-8") as f:
        lines = f.readlines()
    small = tmp_path / "small_vocab.txt"
    small.write_text("".join(lines[:200]), encoding="utf-8")  # the specials and a few pieces
    argv = ("--num-layers 1 --hidden-size 32 --num-attention-heads 2 --seq-length 32 --max-position-embeddings 32 "
            "--micro-batch-size 2 --lr 1e-3 --train-iters 1 --num-workers 1 --split 949,50,1 "
            "--tokenizer-type BertWordPieceLowerCase").split()
    argv += ["--data-path", prefix, "--vocab-file", str(small), "--data-cache-path", str(tmp_path / "cache")]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    rc = subprocess.run([sys.executable, str(REPO / "pretrain_bert.py"), *argv], capture_output=True, text=True,
                        cwd=REPO, timeout=600, env=env)
    assert rc.returncode == 1, rc.stdout[-2000:] + rc.stderr[-2000:]
    # 202: the file's 200 lines, then [BOS] and [EOS], which Megatron's BERT tokenizer appends
    assert re.search(r"error: token id \d+ is outside the tokenizer's vocabulary \(202 ids\) in data set "
                     + re.escape(prefix), rc.stderr), rc.stderr[-2000:]
    assert "Traceback" not in rc.stderr
