"""docs/continual-pretraining.md end to end, with its real commands at a tiny size: a Llama 3.1-shaped
Hugging Face model (rope_scaling "llama3", GQA, untied) and a Llama 3-style tokenizer directory built
here; tools/checkpoint/from_hf.py; tools/preprocess_data.py with HuggingFaceTokenizer; the ABCI job
script scripts/abci/abci3_h200_llama3.1_8b_cpt.sh in a simulated PBS job (2 ranks, ZeRO-2 over DP 2),
submitted twice as a job chain; tools/checkpoint/to_hf.py; tools/evaluate.py.

What is compared with what the workflow's inputs are, not with what it printed: the exported model is
the imported one moved by a few small steps (so the first job started from it, not from random
weights), it loads in transformers as LlamaForCausalLM with the source's rope scaling, and its
tokenizer files encode as the source's."""
from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys

import pytest
import torch

from tests.launch.helpers import REPO, requires_mpirun
from tests.launch.test_abci_scripts import FakeJob

transformers = pytest.importorskip("transformers")

SCRIPT = "abci3_h200_llama3.1_8b_cpt.sh"
# the job script's model flags at a tiny size (its RoPE base, scaling, 131072 positions are kept)
TINY = dict(NUM_LAYERS=2, HIDDEN_SIZE=64, NUM_HEADS=4, NUM_KV_HEADS=2, FFN_HIDDEN_SIZE=128, SEQ_LENGTH=64,
            MICRO_BATCH=2, GLOBAL_BATCH=4, SAVE_INTERVAL=100, MEGATRON_DS_ENTRY="", PYTHON="")
CPU_ARGS = ["--distributed-backend", "gloo", "--log-interval", "1", "--eval-interval", "100", "--eval-iters", "1",
            "--num-workers", "0", "--split", "95,5,0"]
LLAMA31_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)


def _tool(*argv):
    result = subprocess.run([sys.executable, *map(str, argv)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@requires_mpirun
def test_import_train_as_a_job_chain_export_evaluate(tmp_path):
    from megatron_ds.data.sample_corpus import stdlib_documents
    from tests.data.test_modern_tokenizers import _hf_dir

    job = FakeJob(tmp_path, "pbs")
    hf_dir, imported = job.work / "hf" / "Llama-3.1-8B", job.work / "checkpoints" / "llama3.1_8b_hf"
    prefix = job.work / "data" / "llama3" / "corpus"
    for placeholder in (hf_dir, imported, prefix.parent):  # FakeJob's empty files: the real ones are made here
        shutil.rmtree(placeholder)
    _hf_dir(hf_dir, "llama3")
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_parameters=LLAMA31_ROPE,
        tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    source = transformers.LlamaForCausalLM(config)
    source.save_pretrained(hf_dir)

    # 1. import; 2. tokenize
    _tool("tools/checkpoint/from_hf.py", "--hf-dir", hf_dir, "--save", imported)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": doc[:2000]}) + "\n" for doc in stdlib_documents()[:150]))
    _tool("tools/preprocess_data.py", "--input", corpus, "--output-prefix", prefix, "--tokenizer-type",
          "HuggingFaceTokenizer", "--tokenizer-model", hf_dir, "--append-eod", "--workers", "1")

    # 4. train: the first job starts from the import and stops early (as at its walltime), the next resumes
    first = job.run(SCRIPT, *CPU_ARGS, "--exit-interval", "2", TRAIN_ITERS=4, timeout=600, **TINY)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "starting from --pretrained-checkpoint" in first.stdout
    assert "world size 2 = TP 1 x PP 1 x DP 2" in first.stdout
    assert [int(i) for i in re.findall(r"^ iteration\s+(\d+)/\s+4 \|", first.stdout, re.M)] == [1, 2]
    second = job.run(SCRIPT, *CPU_ARGS, TRAIN_ITERS=4, timeout=600, **TINY)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "starting from --pretrained-checkpoint" not in second.stdout
    assert [int(i) for i in re.findall(r"^ iteration\s+(\d+)/\s+4 \|", second.stdout, re.M)] == [3, 4]

    # 5. export: transformers' class and rope scaling, the source's tokenizer, the imported weights moved a little
    trained = job.work / "checkpoints" / "llama3.1_8b_cpt"
    exported = tmp_path / "exported"
    _tool("tools/checkpoint/to_hf.py", "--load", trained, "--out", exported)
    model = transformers.AutoModelForCausalLM.from_pretrained(exported)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.rope_parameters == source.config.rope_parameters
    text = "continual pretraining of an open model"
    assert transformers.AutoTokenizer.from_pretrained(exported)(text).input_ids == tokenizer(text).input_ids
    before, after = _state(source), _state(model)
    assert before.keys() == after.keys()
    moved = max((after[k] - before[k]).abs().max().item() for k in before)
    # four Adam steps at LR <= 3e-5 (~1.2e-4) and bf16 rounding (~1e-4 here); from random weights: ~0.1
    assert 0 < moved < 1e-3, moved

    # 6. evaluate the trained checkpoint on the tokenized corpus
    result = tmp_path / "evaluation.json"
    _tool("tools/evaluate.py", "--load", trained, "--ppl-data", f"{prefix}_text_document", "--max-tokens", "2000",
          "--no-progress", "--output", result)
    (scores,) = json.loads(result.read_text())["perplexity"].values()
    # the model is barely trained from random weights: about log(vocabulary) nats per token
    assert scores["scored_tokens"] == 1999 and abs(scores["nll"] - math.log(len(tokenizer))) < 0.5, scores
