"""Generation and evaluation CLIs on mixture-of-experts checkpoints (the MoE layers in eval mode).

- A Llama-style top-2 MoE (experts on every layer, no token dropping, no second-expert sampling;
  trained at EP 2 x DP 2, initialized with std 0.3 so that greedy choices are far apart): greedy
  generation from the checkpoint equals greedy decoding by transformers' MixtralForCausalLM on its
  export (its logits equal ours: tests/families/gpt/test_moe_hf.py; the smallest margin between the
  best and second-best token is asserted, so equality is not luck), as does generation at TP 2
  under a launcher (whole experts on both ranks), and tools/evaluate.py's
  perplexity equals Hugging Face's perplexity guide run on that Mixtral (fp32 both; the kernels
  differ, ~1e-6 on logits, less on a mean over 299 tokens: rel 1e-5 as in
  tests/inference/test_checkpoint_generation.py); the export imported back (``--hf-model``) gives
  that perplexity exactly.
- A GPT-2-style MoE with DeepSpeed's defaults in evaluation -- token dropping at
  --moe-eval-capacity-factor and Gumbel sampling of the second expert -- generates and evaluates
  too (its routing is random by DeepSpeed's design, so only the shape of the results is checked).
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from tests.checkpoint.common import train
from tests.families.gpt.test_moe_hf import MIXTRAL_MOE
from tests.distributed import run_distributed
from tests.inference.test_checkpoint_generation import _hf_guide_nll  # HF's perplexity guide, transcribed
from megatron_ds.families.gpt.gpt_family import GPT

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(1500)
NEW = 8
PROMPTS = ["5 17 33 9 100 7", "42 43"]


@pytest.fixture(scope="module")
def llama_moe(tmp_path_factory):
    from megatron_ds.families.gpt.gpt_hf_export import export_hf

    ckpt = str(tmp_path_factory.mktemp("llama-moe"))
    train("llama", 1, 1, 2, 2, ["--save", ckpt, *MIXTRAL_MOE, "--init-method-std", "0.3"])
    hf_dir = str(tmp_path_factory.mktemp("llama-moe-hf"))
    export_hf(ckpt, hf_dir, dtype="fp32", log=lambda *a: None, family=GPT)
    return ckpt, transformers.MixtralForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval(), hf_dir


def _read(path):
    return [json.loads(line) for line in open(path)]


def _greedy(model, prompt: list[int], n: int) -> tuple[list[int], float]:
    """Greedy decoding by full forwards; (new tokens, smallest best-vs-second logit margin)."""
    ids, margin = list(prompt), math.inf
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        top = torch.topk(logits, 2).values
        margin = min(margin, float(top[0] - top[1]))
        ids.append(int(logits.argmax()))
    return ids[len(prompt):], margin


def test_greedy_generation_equals_mixtral(llama_moe, tmp_path):
    from megatron_ds.cli.generate_samples_gpt import main

    ckpt, mixtral, _ = llama_moe
    out = str(tmp_path / "gen.jsonl")
    argv = ["--load", ckpt, "--tokenizer-type", "NullTokenizer", "--greedy", "--max-new-tokens", str(NEW),
            "--no-stop-at-eod", "--output", out, "--batch-size", "2"]
    assert main(argv + [a for p in PROMPTS for a in ("--prompt", p)]) == 0
    reference = _read(out)
    for prompt, result in zip(PROMPTS, reference):
        tokens, margin = _greedy(mixtral, [int(t) for t in prompt.split()], NEW)
        assert margin > 1e-3
        assert result["generated"].split() == [str(t) for t in tokens]
    # TP 2 under a launcher: every TP rank holds whole experts (EP 1), attention and dense parts split
    out2 = str(tmp_path / "gen_tp2.jsonl")
    argv2 = [a if a != out else out2 for a in argv] + [a for p in PROMPTS for a in ("--prompt", p)]
    assert run_distributed(_cli_under_launcher, 2, argv2, timeout=600) == [0, 0]
    assert _read(out2) == reference


def _cli_under_launcher(rank, world_size, argv):
    from megatron_ds.cli.generate_samples_gpt import main
    return main(argv)


def test_evaluate_perplexity_equals_mixtral(llama_moe, tmp_path):
    from megatron_ds.cli.evaluate import main

    ckpt, mixtral, _ = llama_moe
    ids = [(i * 37 + i // 7) % 500 for i in range(300)]
    text = tmp_path / "ids.txt"
    text.write_text(" ".join(map(str, ids)))
    nll, count = _hf_guide_nll(mixtral, ids, window=32, stride=12)
    out = tmp_path / "eval.json"
    assert main(["--load", ckpt, "--tokenizer-type", "NullTokenizer", "--ppl-data", str(text), "--window", "32",
                 "--stride", "12", "--output", str(out), "--no-progress"]) == 0
    (got,) = json.load(open(out))["perplexity"].values()
    assert got["scored_tokens"] == count == len(ids) - 1
    assert got["perplexity"] == pytest.approx(math.exp(nll / count), rel=1e-5)
    # The Mixtral export imported back (--hf-model: import_hf, the hub's block_sparse_moe names) is the
    # same model on Megatron-LM's MoE layer (families/gpt/moe_hf.py): the same fp32 routing and experts,
    # summed in another order (~1e-7 relative on the NLL sum), so rel 1e-6.
    hf_out = tmp_path / "eval_hf.json"
    assert main(["--hf-model", llama_moe[2], "--tokenizer-type", "NullTokenizer", "--ppl-data", str(text),
                 "--window", "32", "--stride", "12", "--output", str(hf_out), "--no-progress"]) == 0
    (imported,) = json.load(open(hf_out))["perplexity"].values()
    assert imported["scored_tokens"] == got["scored_tokens"]
    assert imported["perplexity"] == pytest.approx(got["perplexity"], rel=1e-6)


def test_deepspeed_default_routing_generates_and_evaluates(tmp_path):
    from megatron_ds.cli.evaluate import main as evaluate
    from megatron_ds.cli.generate_samples_gpt import main as generate

    ckpt = str(tmp_path / "gpt2-moe")
    train("gpt2", 1, 1, 1, 1, ["--save", ckpt, "--num-experts", "4", "--topk", "2", "--vocab-size", "500"])
    out = str(tmp_path / "gen.jsonl")
    assert generate(["--load", ckpt, "--tokenizer-type", "NullTokenizer", "--max-new-tokens", str(NEW),
                     "--no-stop-at-eod", "--output", out, "--prompt", PROMPTS[0]]) == 0
    (result,) = _read(out)
    assert result["new_tokens"] == NEW and all(0 <= int(t) < 500 for t in result["generated"].split())
    text = tmp_path / "ids.txt"
    text.write_text(" ".join(str((i * 37) % 500) for i in range(100)))
    report = tmp_path / "eval.json"
    assert evaluate(["--load", ckpt, "--tokenizer-type", "NullTokenizer", "--ppl-data", str(text), "--window", "32",
                     "--output", str(report), "--no-progress"]) == 0
    (got,) = json.load(open(report))["perplexity"].values()
    # a trained-for-one-step model over a 500-token vocabulary: near uniform, finite
    assert got["scored_tokens"] == 99 and 100 < got["perplexity"] < 2000
