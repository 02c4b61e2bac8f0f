"""The GPT quickstart (tools/quickstart.py's steps for --model gpt, the default; ``QUICKSTART``, the GPT
family's):

  1. a real-text JSONL corpus made offline (Python standard library docstrings), with some
     modules held out for evaluation
  2. a byte-level BPE tokenizer trained on it (GPT-2 file format)       tools/train_tokenizer.py
  3. Megatron .bin/.idx data                                            tools/preprocess_data.py
  4. a small GPT trained on 2 processes (pipeline parallel 2)           pretrain_gpt.py
  5. the run resumed from its checkpoint for the last iterations
  6. perplexity on the held-out modules and LAMBADA-style last-word accuracy   tools/evaluate.py
  7. text generated from a few prompts                                  tools/generate_samples_gpt.py

Sizes (--size): ``cpu`` the default without a GPU, the setting that reached the lowest validation loss
in the time budget on 2 CPU cores (bench/RESULTS.md); ``gpu`` the default with a GPU, a larger model
on all local GPUs (tensor parallel 2 when there are >= 2); ``tiny`` a minute-long smoke run (the
end-to-end test uses it)."""
from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass

from megatron_ds.families.quickstart_steps import (ROOT, Quickstart, ToolRunner, begin,
                                                   launcher_cmd, make_corpus, numbered_steps, parallel_layout, run_job,
                                                   step, timed_stages, train_then_resume, train_tokenizer_once)

LOSS_RE = re.compile(r" iteration\s+(\d+)/\s*\d+ \|.*? lm loss: ([0-9.E+-]+) \|")
VALID_RE = re.compile(r" validation loss at .*?\| lm loss value: ([0-9.E+-]+) \| lm loss PPL: ([0-9.E+-]+)")
EVALUATION = "tools/evaluate.py"  # ModelFamily.evaluation: what scores its checkpoints
PROMPTS = ["Return a new", "This module provides", "The default value of", "Raise ValueError if the"]


@dataclass(frozen=True)
class Preset:
    layers: int
    hidden: int
    heads: int
    seq: int
    micro: int
    global_batch: int
    iters: int
    resume_iters: int  # the last iterations, run as a resumed job
    lr: float
    precision: str  # fp32 | bf16
    corpus_mb: float
    vocab: int
    heldout_modules: int
    new_tokens: int
    eval_tokens: int  # held-out tokens scored for perplexity


PRESETS = {
    # Chosen by measuring runs of several shapes, batch splits and learning rates on the 2-core CI machine
    # (bench/RESULTS.md, "Quickstart"): fp32 is several times faster than bf16 on CPUs without bf16
    # units, and this shape reached the lowest validation loss of those that keep a fresh clone's
    # `make quickstart`, installing included, under 300 s on two cores (the time is mostly the
    # arithmetic: 2 layers x 128 take ~1/3 of 4 x 256's time per iteration and learn more in that time).
    "cpu": Preset(layers=2, hidden=128, heads=4, seq=128, micro=8, global_batch=16, iters=600, resume_iters=20,
                  lr=2e-3, precision="fp32", corpus_mb=4.0, vocab=4096, heldout_modules=40, new_tokens=32,
                  eval_tokens=10000),
    "gpu": Preset(layers=8, hidden=512, heads=8, seq=512, micro=8, global_batch=64, iters=1000, resume_iters=50,
                  lr=1e-3, precision="bf16", corpus_mb=20.0, vocab=8192, heldout_modules=40, new_tokens=64,
                  eval_tokens=100000),
    "tiny": Preset(layers=2, hidden=64, heads=4, seq=64, micro=2, global_batch=4, iters=6, resume_iters=2, lr=2e-3,
                   precision="fp32", corpus_mb=0.3, vocab=512, heldout_modules=8, new_tokens=12, eval_tokens=2000),
}


def prepare_data(run_tool: ToolRunner, workdir: str, preset: Preset, workers: int) -> tuple[str, str, str, str, str]:
    """Steps 1-3. Returns (data prefix, vocab file, merge file, held-out JSONL, LAMBADA-style JSONL)."""
    tok_dir = os.path.join(workdir, "tokenizer")
    prefix = os.path.join(workdir, "data", "corpus")
    vocab, merges = os.path.join(tok_dir, "vocab.json"), os.path.join(tok_dir, "merges.txt")
    data_prefix = f"{prefix}_text_document"

    step("1. corpus")
    corpus, heldout, lambada = make_corpus(workdir, preset)

    step("2. tokenizer")
    train_tokenizer_once(run_tool, corpus, "bpe", preset.vocab, tok_dir, made=merges)

    step("3. preprocess")
    if not os.path.exists(data_prefix + ".idx"):
        os.makedirs(os.path.dirname(prefix), exist_ok=True)
        run_tool("tools/preprocess_data.py", ["--input", corpus, "--output-prefix", prefix, "--json-keys", "text",
                                              "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab,
                                              "--merge-file", merges, "--append-eod", "--workers", str(workers)])
    else:
        print(f"reusing {data_prefix}.bin/.idx")
    return data_prefix, vocab, merges, heldout, lambada


def train_flags(preset: Preset, data_prefix: str, vocab: str, merges: str, ckpt: str, train_iters: int,
                log_interval: int, tp: int, pp: int) -> list[str]:
    total = preset.iters
    # Whole micro-batches per data parallel replica, whatever the GPU count.
    dp_micro = preset.micro * (parallel_layout()[0] // (tp * pp))
    global_batch = max(preset.global_batch // dp_micro, 1) * dp_micro
    flags = [
        "--num-layers", str(preset.layers), "--hidden-size", str(preset.hidden),
        "--num-attention-heads", str(preset.heads), "--seq-length", str(preset.seq),
        "--max-position-embeddings", str(preset.seq), "--micro-batch-size", str(preset.micro),
        "--global-batch-size", str(global_batch), "--tensor-model-parallel-size", str(tp),
        "--pipeline-model-parallel-size", str(pp), "--train-iters", str(train_iters),
        "--lr", str(preset.lr), "--min-lr", str(preset.lr / 10), "--lr-decay-style", "cosine",
        "--lr-warmup-iters", str(max(total // 20, 1)), "--lr-decay-iters", str(total),
        "--weight-decay", "0.1", "--clip-grad", "1.0", "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
        "--data-path", data_prefix, "--split", "98,2,0", "--tokenizer-type", "GPT2BPETokenizer",
        "--vocab-file", vocab, "--merge-file", merges, "--make-vocab-size-divisible-by", "64",
        "--log-interval", str(log_interval), "--eval-interval", str(total - preset.resume_iters),
        "--eval-iters", "4", "--save", ckpt, "--save-interval", str(total - preset.resume_iters),
        "--num-workers", "1", "--deepspeed",
    ]
    if preset.precision == "bf16":
        flags += ["--deepspeed_config", os.path.join(ROOT, "ds_configs", "zero1_bf16.json"), "--bf16"]
    else:  # the bf16 template's precision block is "auto": off without --bf16
        flags += ["--deepspeed_config", os.path.join(ROOT, "ds_configs", "zero0_bf16.json")]
    return flags


def train(args, flags: list[str], nproc: int, load: str | None, log_path: str) -> tuple[list, list]:
    """One pretrain_gpt.py job under the launcher; (iteration losses, validation losses) from its log."""
    cmd = launcher_cmd(args.launcher, nproc) + [os.path.join(ROOT, "pretrain_gpt.py")] + flags
    if load:
        cmd += ["--load", load]
    echo = (" iteration", " validation", "-" * 20, "> megatron_ds", "saved", "loaded", "error", "WARNING: ignoring")
    losses, valid = run_job(cmd, log_path, echo, (LOSS_RE, VALID_RE))
    return [(int(it), float(loss)) for it, loss in losses], [(float(loss), float(ppl)) for loss, ppl in valid]


def train_stages(args, preset: Preset, data: tuple) -> dict:
    """Steps 4-5, each skipped when the checkpoint already has its iterations."""
    data_prefix, vocab, merges = data[:3]
    ckpt = os.path.join(args.workdir, "checkpoints")
    nproc, tp, pp = parallel_layout()
    first_iters = preset.iters - preset.resume_iters
    log_interval = max(preset.iters // 20, 1)
    layout = f"{nproc} processes, tensor parallel {tp}, pipeline parallel {pp}, {preset.precision}"
    summary = train_then_resume(
        args.workdir, ckpt, first_iters, preset.iters, layout,
        lambda iters: train_flags(preset, data_prefix, vocab, merges, ckpt, iters, log_interval, tp, pp),
        lambda flags, load, log_path: train(args, flags, nproc, load, log_path))
    if not summary["validation"]:  # both stages reused: the last run's figures are in its logs
        for name in ("train.log", "resume.log"):
            path = os.path.join(args.workdir, name)
            if os.path.exists(path):
                summary["validation"] += [(float(m.group(1)), float(m.group(2)))
                                          for m in map(VALID_RE.match, open(path)) if m]
    return summary


def evaluate_and_generate(args, run_tool: ToolRunner, preset: Preset, heldout: str, lambada: str) -> dict:
    """Steps 6-7 on the final checkpoint, in this process (TP = PP = 1: the checkpoint's pipeline
    stages are consolidated into one model, which is what tools/evaluate.py does at any layout)."""
    ckpt = os.path.join(args.workdir, "checkpoints")
    eval_json = os.path.join(args.workdir, "evaluation.json")
    step("6. evaluate: held-out perplexity and LAMBADA-style last-word accuracy")
    run_tool(EVALUATION, ["--load", ckpt, "--ppl-data", heldout, "--max-tokens", str(preset.eval_tokens),
                          "--lambada", lambada, "--output", eval_json])

    step("7. generate")
    prompts = os.path.join(args.workdir, "prompts.jsonl")
    with open(prompts, "w") as f:
        for p in PROMPTS:
            f.write(json.dumps({"prompt": p}) + "\n")
    generated = os.path.join(args.workdir, "generated.jsonl")
    run_tool("tools/generate_samples_gpt.py", ["--load", ckpt, "--input", prompts, "--output", generated,
                                               "--max-new-tokens", str(preset.new_tokens), "--top-k", "20",
                                               "--temperature", "0.7", "--repetition-penalty", "1.2",
                                               "--no-stop-at-eod", "--seed", "1"])
    for line in open(generated):
        r = json.loads(line)
        print(f"--- {r['prompt']!r}\n{r['prompt']}{r['generated']}\n")
    return {"evaluation": eval_json, "generated": generated}


def report(args, preset: Preset, t0: float, trained: dict, outputs: dict, data: tuple) -> None:
    evaluation = json.load(open(outputs["evaluation"]))
    ppl = next(iter(evaluation["perplexity"].values()))["perplexity"]
    lam = next(iter(evaluation["lambada"].values()))
    print(f"\nquickstart done in {time.time() - t0:.0f} s ({trained['layout']})")
    if trained["losses"]:
        print(f"  training loss        {trained['losses'][0][1]:.3f} (iteration {trained['losses'][0][0]}) -> "
              f"{trained['losses'][-1][1]:.3f} (iteration {trained['losses'][-1][0]})")
    if trained["validation"]:
        loss, vppl = trained["validation"][-1]
        print(f"  validation           lm loss {loss:.3f}, PPL {vppl:.1f}")
    print(f"  held-out modules     perplexity {ppl:.1f}")
    print(f"  LAMBADA-style        last-word accuracy {lam['accuracy']:.3f} ({lam['correct']}/{lam['samples']})")
    print("where everything is:")
    for name, path in (("workdir", args.workdir), ("tokenizer", os.path.dirname(data[1])),
                       ("data", data[0] + ".bin/.idx"), ("checkpoints", trained["checkpoints"]),
                       ("training logs", os.path.join(args.workdir, "train.log") + ", resume.log"),
                       ("evaluation", outputs["evaluation"]), ("generated text", outputs["generated"])):
        print(f"  {name:<15}{path}")


def run(args, run_tool: ToolRunner) -> int:
    """The GPT quickstart with tools/quickstart.py's parsed arguments (--size, --workdir, ...)."""
    preset = begin(args, PRESETS)
    t0 = time.time()
    with timed_stages():
        data = prepare_data(run_tool, args.workdir, preset, args.workers)
        trained = train_stages(args, preset, data)
        outputs = evaluate_and_generate(args, run_tool, preset, data[3], data[4])
    report(args, preset, t0, trained, outputs, data)
    return 0


QUICKSTART = Quickstart(presets=PRESETS, run=run, workdir="quickstart", steps=numbered_steps(__doc__))
