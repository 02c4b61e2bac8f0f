"""The generation and evaluation CLIs on real checkpoints: saved at TP = PP = 1, at PP = 2 and at
TP = 2 (fp32), each loaded through load_consolidated, generate the same tokens; TP = 2 generation
under a launcher does too; evaluation JSON is written.

The three training runs sum the same numbers in different orders, so their weights differ by ~1e-6
(tests/checkpoint/test_consolidate.py); the models are initialized with std 0.3 so that greedy
choices are separated by far more than that (the margin is asserted), making "same tokens" a
property of correct loading/sharding rather than luck.
"""
from __future__ import annotations

import json

import pytest

from tests.checkpoint.common import train
from tests.distributed import run_distributed
from tests.inference.common import reference_greedy
from megatron_ds.families.gpt.gpt_family import GPT

pytestmark = pytest.mark.timeout(900)
LAYOUTS = ((1, 1), (1, 2), (2, 1))  # (TP, PP)
NEW = 10
PROMPTS = ["5 17 33 9 100 7", "42", "300 301 302"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    dirs = {}
    for tp, pp in LAYOUTS:
        dirs[tp, pp] = str(root / f"tp{tp}pp{pp}")
        train("gpt2", tp, pp, 1, 2, ["--save", dirs[tp, pp], "--init-method-std", "0.3"])
    return dirs


def _generate_argv(load, out):
    return ["--load", load, "--tokenizer-type", "NullTokenizer", "--greedy", "--max-new-tokens", str(NEW),
            "--no-stop-at-eod", "--output", out, "--batch-size", "2"] + [a for p in PROMPTS for a in ("--prompt", p)]


def _read(path):
    return [json.loads(line) for line in open(path)]


def _cli_under_launcher(rank, world_size, argv):
    from megatron_ds.cli.generate_samples_gpt import main
    return main(argv)


def test_checkpoints_of_any_layout_generate_the_same_tokens(checkpoints, tmp_path):
    from megatron_ds.checkpoint import load_consolidated
    from megatron_ds.cli.generate_samples_gpt import main
    from megatron_ds.inference.model import ModelWeights

    outputs = {}
    for layout, load in checkpoints.items():
        out = str(tmp_path / f"gen_tp{layout[0]}pp{layout[1]}.jsonl")
        assert main(_generate_argv(load, out)) == 0
        outputs[layout] = _read(out)
    reference = outputs[1, 1]
    assert all(r["new_tokens"] == NEW for r in reference)
    for layout, got in outputs.items():
        assert got == reference, layout

    # TP = 2 under a launcher, from the PP = 2 checkpoint (resharded from 2 stages to 2 TP ranks).
    out = str(tmp_path / "gen_tp2_launch.jsonl")
    assert run_distributed(_cli_under_launcher, 2, _generate_argv(checkpoints[1, 2], out), timeout=300) == [0, 0]
    assert _read(out) == reference

    # The tokens are an independent greedy decode's, with choices far apart (see the docstring).
    c = load_consolidated(checkpoints[1, 1], log=lambda *a: None, family=GPT)
    weights = ModelWeights(c.model, c.padded_vocab_size, c.vocab_size, c.state_dict)
    for prompt, r in zip(PROMPTS, reference):
        tokens, margin = reference_greedy(weights, [int(t) for t in prompt.split()], NEW)
        assert margin > 1e-3
        assert r["generated"].split() == [str(t) for t in tokens]


def test_a_checkpoint_saved_with_fusions_on_cpu_is_read_without(checkpoints, tmp_path):
    """--fusions-on-cpu is the saving run's kernel choice: the tools that read the checkpoint on a
    CPU take the unfused path (no minutes of compiling) unless they ask otherwise."""
    import shutil

    from megatron_ds.checkpoint.files import open_checkpoint
    from megatron_ds.checkpoint.format import META
    load = shutil.copytree(checkpoints[1, 1], tmp_path / "ckpt")
    meta_path = next(load.glob(f"*/{META}"))
    meta = json.loads(meta_path.read_text())
    meta["config"]["model"]["fusions_on_cpu"] = True
    meta_path.write_text(json.dumps(meta))
    assert open_checkpoint(str(load), None, GPT).model.fusions_on_cpu is False


def test_evaluate_cli_on_a_pipeline_checkpoint(checkpoints, tmp_path):
    from megatron_ds.cli.evaluate import main

    text = tmp_path / "ids.txt"
    text.write_text(" ".join(str((i * 37) % 500) for i in range(300)))
    lam = tmp_path / "lambada.jsonl"
    lam.write_text("".join(json.dumps({"text": f"{i} {i + 1} {i + 2} {i + 3}"}) + "\n" for i in range(10)))
    results = {}
    for layout in ((1, 1), (1, 2)):
        out = tmp_path / f"eval{layout}.json"
        assert main(["--load", checkpoints[layout], "--tokenizer-type", "NullTokenizer", "--ppl-data", str(text),
                     "--window", "32", "--stride", "16", "--lambada", str(lam), "--output", str(out),
                     "--no-progress"]) == 0
        results[layout] = json.load(open(out))
    a, b = (next(iter(results[k]["perplexity"].values())) for k in ((1, 1), (1, 2)))
    assert a["scored_tokens"] == b["scored_tokens"] == 299
    # Same weights up to ~1e-6 (see the module docstring): perplexities agree to ~1e-5 relative.
    assert a["perplexity"] == pytest.approx(b["perplexity"], rel=1e-4)
    assert results[1, 1]["lambada"][str(lam)]["samples"] == 10


def _eval_under_launcher(rank, world_size, argv):
    from megatron_ds.cli.evaluate import main
    return main(argv)


class _Ids:
    """Space-separated ids, as NullTokenizer reads them (the pad id never matters: it is masked)."""
    eod = 0

    def tokenize(self, text):
        return [int(t) for t in text.split()]


def test_megatron_task_flags_on_a_pipeline_checkpoint(checkpoints, tmp_path):
    """tasks/main.py's command line: --task WIKITEXT103 with Megatron's defaults (windows of the
    model's sequence length every 32 tokens, the detokenizer picked by the file name) and --task
    LAMBADA; a wrong --valid-data is refused as Megatron's assertion would."""
    from megatron_ds.checkpoint import load_consolidated
    from megatron_ds.cli.evaluate import main
    from megatron_ds.inference.model import ModelWeights, build_inference_model
    from megatron_ds.inference.zeroshot import wikitext_detokenizer, wikitext_perplexity

    wiki = tmp_path / "wiki.test.tokens"  # 25 lines of 12 ids: 300 tokens, 276 " "-separated words
    wiki.write_text("".join(" ".join(str((i * 37) % 500) for i in range(j, j + 12)) + "\n" for j in range(0, 300, 12)))
    out = tmp_path / "wiki.json"
    assert main(["--load", checkpoints[1, 2], "--tokenizer-type", "NullTokenizer", "--task", "WIKITEXT103",
                 "--valid-data", str(wiki), "--micro-batch-size", "3", "--output", str(out), "--no-progress"]) == 0
    got = json.load(open(out))["task"]
    assert (got["num_original_tokens"], got["num_tokenized_tokens"]) == (276, 300)
    assert got["token_ratio"] == 299 / 275 and got["overlapping_eval"] == 32
    c = load_consolidated(checkpoints[1, 2], log=lambda *a: None, family=GPT)
    model = build_inference_model(ModelWeights(c.model, c.padded_vocab_size, c.vocab_size, c.state_dict), family=GPT)
    ref = wikitext_perplexity(model, wiki.read_text(), _Ids(), seq_len=c.model.seq_length, overlapping_eval=32,
                              detokenize=wikitext_detokenizer, show_progress=False)
    assert got["seq_length"] == c.model.seq_length and got["windows"] == ref["windows"]
    assert got["adjusted_ppl"] == pytest.approx(ref["adjusted_ppl"], rel=1e-6)
    # The same command under a launcher: TP = 2 from the PP = 2 checkpoint, vocab-parallel loss (~1e-6).
    argv = ["--load", checkpoints[1, 2], "--tokenizer-type", "NullTokenizer", "--task", "WIKITEXT103",
            "--valid-data", str(wiki), "--output", str(tmp_path / "tp2.json"), "--no-progress"]
    assert run_distributed(_eval_under_launcher, 2, argv, timeout=300) == [0, 0]
    assert json.load(open(tmp_path / "tp2.json"))["task"]["adjusted_ppl"] == pytest.approx(got["adjusted_ppl"],
                                                                                          rel=1e-5)

    lam = tmp_path / "lambada.jsonl"
    lam.write_text("".join(json.dumps({"text": f"{i} {i + 1} {i + 2} {i + 3}"}) + "\n" for i in range(10)))
    for strict in (False, True):
        assert main(["--load", checkpoints[1, 2], "--tokenizer-type", "NullTokenizer", "--task", "LAMBADA",
                     "--valid-data", str(lam), "--output", str(out), "--no-progress"]
                    + ["--strict-lambada"] * strict) == 0
        got = json.load(open(out))["task"]
        assert (got["task"], got["samples"], got["strict"]) == ("LAMBADA", 10, strict)
    # Refused before loading: no or two files (Megatron asserts one), a name that picks no detokenizer.
    for bad in (["LAMBADA"], ["LAMBADA", str(lam), str(lam)], ["WIKITEXT103", str(tmp_path / "test.txt")]):
        with pytest.raises(SystemExit) as exc:
            main(["--load", checkpoints[1, 2], "--task", bad[0], "--valid-data", *bad[1:]])
        assert exc.value.code == 2


def _hf_guide_nll(model, ids, window, stride):
    """Hugging Face's perplexity guide, transcribed: labels -100 but the last trg_len of each window,
    the model's own (shifted, mean) loss times the number of targets it scored."""
    import torch

    nll, count, prev_end = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + window, len(ids))
        trg_len = end - prev_end
        input_ids = torch.tensor(ids[begin:end])[None]
        target_ids = input_ids.clone()
        target_ids[:, :-trg_len] = -100
        with torch.no_grad():
            loss = model(input_ids, labels=target_ids).loss
        scored = int((target_ids[:, 1:] != -100).sum())
        nll += float(loss) * scored
        count += scored
        prev_end = end
        if end == len(ids):
            break
    return nll, count


def test_perplexity_equals_transformers_on_the_hf_export(checkpoints, tmp_path):
    import math

    import torch
    import transformers

    from megatron_ds.cli.evaluate import main as evaluate
    from megatron_ds.cli.generate_samples_gpt import main as generate_samples
    from megatron_ds.families.gpt.gpt_hf_export import export_hf

    export = str(tmp_path / "hf")
    export_hf(checkpoints[1, 2], export, dtype="fp32", log=lambda *a: None, family=GPT)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    ids = [(i * 37 + i // 7) % 500 for i in range(300)]
    text = tmp_path / "ids.txt"
    text.write_text(" ".join(map(str, ids)))
    nll, count = _hf_guide_nll(hf_model, ids, window=32, stride=12)

    for source in (["--load", checkpoints[1, 2]], ["--hf-model", export]):
        out = tmp_path / "eval.json"
        assert evaluate(source + ["--tokenizer-type", "NullTokenizer", "--ppl-data", str(text), "--window", "32",
                                  "--stride", "12", "--output", str(out), "--no-progress"]) == 0
        (got,) = json.load(open(out))["perplexity"].values()
        assert got["scored_tokens"] == count == len(ids) - 1
        # fp32 on both sides, the same weights; the kernels differ (fused QKV vs split, SDPA vs HF's
        # attention), which moves logits by ~1e-6 and the mean NLL over 299 tokens by less: 1e-5
        # relative on the perplexity is ~10x that, and a wrong window or shift changes it by >1%.
        assert got["perplexity"] == pytest.approx(math.exp(nll / count), rel=1e-5), source

    # Generation from the export (imported back) equals generation from the checkpoint itself.
    out = str(tmp_path / "gen_hf.jsonl")
    assert generate_samples(["--hf-model", export] + _generate_argv("", out)[2:]) == 0
    reference = str(tmp_path / "gen_ckpt.jsonl")
    assert generate_samples(_generate_argv(checkpoints[1, 2], reference)) == 0
    assert _read(out) == _read(reference)


def test_interactive_mode_and_help(checkpoints, monkeypatch, capsys):
    from megatron_ds.cli.generate_samples_gpt import main

    answers = iter(["5 17 33 9 100 7", ""])  # a prompt, then an empty line ends the session
    monkeypatch.setattr("builtins.input", lambda prompt="": next(answers))
    assert main(["--load", checkpoints[1, 1], "--tokenizer-type", "NullTokenizer", "--greedy",
                 "--max-new-tokens", str(NEW), "--no-stop-at-eod"]) == 0
    out = capsys.readouterr().out
    assert "tokens/s" in out
    printed = [line for line in out.splitlines() if line.startswith("5 17 33 9 100 7")]
    assert len(printed) == 1 and len(printed[0].split()) == 6 + NEW
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    help_text = capsys.readouterr().out
    for word in ("--load", "--hf-model", "--top-p", "--repetition-penalty", "interactively", "torchrun"):
        assert word in help_text
