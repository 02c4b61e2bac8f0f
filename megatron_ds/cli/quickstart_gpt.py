#!/usr/bin/env python
"""The whole pipeline on one machine, CPU is enough (`make quickstart` runs this):

  1. a real-text JSONL corpus made offline (Python standard library docstrings), with some
     modules held out for evaluation
  2. a byte-level BPE tokenizer trained on it (GPT-2 file format)       tools/train_tokenizer.py
  3. Megatron .bin/.idx data                                            tools/preprocess_data.py
  4. a small GPT trained on 2 processes (pipeline parallel 2)           pretrain_gpt.py
  5. the run resumed from its checkpoint for the last iterations
  6. perplexity on the held-out modules and LAMBADA-style last-word accuracy   tools/evaluate.py
  7. text generated from a few prompts                                  tools/generate_samples_gpt.py

Every step prints the command it runs, so the same steps can be reused on a cluster. A second run
reuses what the first built (corpus, tokenizer, data, checkpoint) and redoes only steps 6-7.

Sizes (--size, or the QUICKSTART_SIZE environment variable):
  cpu   default without a GPU: the setting that reached the lowest validation loss in about five
        minutes of training on 2 CPU cores (see bench/RESULTS.md)
  gpu   default with a GPU: a larger model on all local GPUs (tensor parallel 2 when there are >= 2)
  tiny  a minute-long smoke run (the end-to-end test uses it)

    python tools/quickstart.py [--workdir quickstart] [--size cpu|gpu|tiny] [--launcher torchrun|deepspeed]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))  # the sibling CLIs, imported as modules

LOSS_RE = re.compile(r" iteration\s+(\d+)/\s*\d+ \|.*? lm loss: ([0-9.E+-]+) \|")
VALID_RE = re.compile(r" validation loss at .*?\| lm loss value: ([0-9.E+-]+) \| lm loss PPL: ([0-9.E+-]+)")
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
    # Chosen by measuring short runs of several shapes and precisions on the 2-core CI machine
    # (bench/RESULTS.md, "Quickstart"): fp32 is several times faster than bf16 on CPUs without
    # bf16 units, and this shape reached the lowest validation loss in the time budget.
    "cpu": Preset(layers=4, hidden=256, heads=4, seq=128, micro=4, global_batch=16, iters=300, resume_iters=20,
                  lr=2e-3, precision="fp32", corpus_mb=4.0, vocab=4096, heldout_modules=40, new_tokens=32,
                  eval_tokens=10000),
    "gpu": Preset(layers=8, hidden=512, heads=8, seq=512, micro=8, global_batch=64, iters=1000, resume_iters=50,
                  lr=1e-3, precision="bf16", corpus_mb=20.0, vocab=8192, heldout_modules=40, new_tokens=64,
                  eval_tokens=100000),
    "tiny": Preset(layers=2, hidden=64, heads=4, seq=64, micro=2, global_batch=4, iters=6, resume_iters=2, lr=2e-3,
                   precision="fp32", corpus_mb=0.3, vocab=512, heldout_modules=8, new_tokens=12, eval_tokens=2000),
}


def step(title: str) -> None:
    print(f"\n=== {title}", flush=True)


def run_tool(module_main, argv: list[str], name: str) -> None:
    print(f"$ python {name} {shlex.join(argv)}", flush=True)
    rc = module_main(argv)
    if rc not in (0, None):
        raise SystemExit(f"{name} failed with exit code {rc}")


def make_corpus(workdir: str, preset: Preset) -> tuple[str, str, str]:
    """Training corpus and held-out files: (train JSONL, held-out JSONL, LAMBADA-style JSONL).
    Held-out modules never appear in the training corpus."""
    from megatron_ds.data.sample_corpus import stdlib_documents, write_corpus

    corpus, heldout = os.path.join(workdir, "corpus.jsonl"), os.path.join(workdir, "heldout.jsonl")
    lambada = os.path.join(workdir, "lambada_heldout.jsonl")
    if os.path.exists(corpus) and os.path.exists(lambada):
        print(f"reusing {corpus}, {heldout}, {lambada}")
        return corpus, heldout, lambada
    docs = stdlib_documents()
    order = list(range(len(docs)))
    random.Random(0).shuffle(order)
    held = [docs[i] for i in order[:preset.heldout_modules]]
    docs_written, nbytes = write_corpus(corpus + ".tmp", preset.corpus_mb, base=[docs[i] for i in order[
        preset.heldout_modules:]])
    with open(heldout, "w", encoding="utf-8") as f:
        for text in held:
            f.write(json.dumps({"text": text}) + "\n")
    with open(lambada, "w", encoding="utf-8") as f:
        for text in lambada_style(held):
            f.write(json.dumps({"text": text}) + "\n")
    os.replace(corpus + ".tmp", corpus)
    print(f"wrote {docs_written} documents, {nbytes / 1e6:.1f} MB of text to {corpus}; "
          f"{len(held)} held-out modules to {heldout} and {lambada}")
    return corpus, heldout, lambada


def lambada_style(texts: list[str], max_samples: int = 300) -> list[str]:
    """Paragraphs of at least 12 words whose last word is alphabetic (punctuation after it dropped):
    the task is to predict that word from the rest, as in LAMBADA."""
    out = []
    for text in texts:
        for para in text.split("\n\n"):
            words = " ".join(para.split()).rstrip(".,;:!?)'\"").split(" ")
            if len(words) >= 12 and words[-1].isalpha() and len(words[-1]) >= 3:
                out.append(" ".join(words[-60:]))  # the context fits the model's positions
    return out[:max_samples]


def train_tokenizer_once(corpus: str, kind: str, vocab_size: int, tok_dir: str, *, made: str) -> None:
    """tools/train_tokenizer.py on the corpus into ``tok_dir``, unless ``made`` (a file it writes) exists."""
    if os.path.exists(made):
        print(f"reusing {tok_dir}")
        return
    from train_tokenizer import main as train_tokenizer
    run_tool(train_tokenizer, ["--input", corpus, "--type", kind, "--vocab-size", str(vocab_size),
                               "--output-dir", tok_dir], "tools/train_tokenizer.py")


def prepare_data(workdir: str, preset: Preset, workers: int) -> tuple[str, str, str, str, str]:
    """Steps 1-3. Returns (data prefix, vocab file, merge file, held-out JSONL, LAMBADA-style JSONL)."""
    tok_dir = os.path.join(workdir, "tokenizer")
    prefix = os.path.join(workdir, "data", "corpus")
    vocab, merges = os.path.join(tok_dir, "vocab.json"), os.path.join(tok_dir, "merges.txt")
    data_prefix = f"{prefix}_text_document"

    step("1. corpus")
    corpus, heldout, lambada = make_corpus(workdir, preset)

    step("2. tokenizer")
    train_tokenizer_once(corpus, "bpe", preset.vocab, tok_dir, made=merges)

    step("3. preprocess")
    if not os.path.exists(data_prefix + ".idx"):
        os.makedirs(os.path.dirname(prefix), exist_ok=True)
        from preprocess_data import main as preprocess
        run_tool(preprocess, ["--input", corpus, "--output-prefix", prefix, "--json-keys", "text",
                              "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges,
                              "--append-eod", "--workers", str(workers)], "tools/preprocess_data.py")
    else:
        print(f"reusing {data_prefix}.bin/.idx")
    return data_prefix, vocab, merges, heldout, lambada


def launcher_cmd(launcher: str, nproc: int) -> list[str]:
    if launcher == "deepspeed":
        return [os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--num_gpus", str(nproc)]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]


def parallel_layout() -> tuple[int, int, int]:
    """(processes, tensor parallel, pipeline parallel): 2 CPU processes as 2 pipeline stages; on
    GPUs, every local GPU with tensor parallel 2 (the rest data parallel), or 1 GPU alone."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0:
        return 2, 1, 2
    if gpus == 1:
        return 1, 1, 1
    return gpus - gpus % 2, 2, 1


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


def run_job(cmd: list[str], log_path: str, echo: tuple[str, ...], patterns: tuple) -> list[list[tuple]]:
    """One training job under the launcher, its output written to log_path; shows the lines that start
    with `echo` (and errors); for each regex of `patterns`, the groups of the lines it matches."""
    print(f"$ {shlex.join(cmd)}", flush=True)
    # One compute thread per process: two processes on two cores, no oversubscription.
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("OMP_NUM_THREADS", "1")
    found = [[] for _ in patterns]
    with open(log_path, "w") as log, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                      text=True, env=env, cwd=ROOT) as proc:
        for line in proc.stdout:
            log.write(line)
            if line.startswith(echo) or "Error" in line:
                print(line, end="", flush=True)
            for hits, pattern in zip(found, patterns):
                m = pattern.match(line)
                if m:
                    hits.append(m.groups())
    if proc.returncode != 0:
        raise SystemExit(f"training failed (exit code {proc.returncode}); full log in {log_path}")
    return found


def train(args, flags: list[str], nproc: int, load: str | None, log_path: str) -> tuple[list, list]:
    """One pretrain_gpt.py job under the launcher; (iteration losses, validation losses) from its log."""
    cmd = launcher_cmd(args.launcher, nproc) + [os.path.join(ROOT, "pretrain_gpt.py")] + flags
    if load:
        cmd += ["--load", load]
    echo = (" iteration", " validation", "-" * 20, "> megatron_ds", "saved", "loaded", "error", "WARNING: ignoring")
    losses, valid = run_job(cmd, log_path, echo, (LOSS_RE, VALID_RE))
    return [(int(it), float(loss)) for it, loss in losses], [(float(loss), float(ppl)) for loss, ppl in valid]


def checkpoint_iteration(ckpt: str) -> int:
    path = os.path.join(ckpt, "latest_checkpointed_iteration.txt")
    try:
        return int(open(path).read().strip())
    except (OSError, ValueError):
        return 0


def train_then_resume(workdir: str, ckpt: str, first: int, total: int, layout: str, make_flags: Callable,
                      run_training: Callable) -> dict:
    """Steps 4-5, each skipped when the checkpoint already has its iterations: train ``first`` iterations
    and save, then resume from that checkpoint up to ``total``. ``make_flags(iters)``: the training flags
    up to iteration iters; ``run_training(flags, load, log_path)``: (losses, validation) of one job."""
    summary = {"losses": [], "validation": [], "layout": layout, "checkpoints": ckpt}
    step(f"4. train {first} iterations ({layout})")
    if checkpoint_iteration(ckpt) >= first:
        print(f"reusing the checkpoint in {ckpt} (iteration {checkpoint_iteration(ckpt)})")
    else:
        if os.path.isdir(ckpt):
            # A partial earlier run: training refuses to overwrite its newer checkpoints, so start over.
            print(f"   (removing the previous run's {ckpt})", flush=True)
            shutil.rmtree(ckpt)
        losses, valid = run_training(make_flags(first), None, os.path.join(workdir, "train.log"))
        summary["losses"] += losses
        summary["validation"] += valid

    step(f"5. resume from the checkpoint for the last {total - first} iterations")
    if checkpoint_iteration(ckpt) >= total:
        print(f"reusing the checkpoint in {ckpt} (iteration {checkpoint_iteration(ckpt)})")
    else:
        flags = make_flags(total)
        flags[flags.index("--save-interval") + 1] = str(total)
        losses, valid = run_training(flags, ckpt, os.path.join(workdir, "resume.log"))
        summary["losses"] += losses
        summary["validation"] += valid
    return summary


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


def evaluate_and_generate(args, preset: Preset, heldout: str, lambada: str) -> dict:
    """Steps 6-7 on the final checkpoint, in this process (TP = PP = 1: the checkpoint's pipeline
    stages are consolidated into one model, which is what tools/evaluate.py does at any layout)."""
    from evaluate import main as evaluate
    from generate_samples_gpt import main as generate_samples

    ckpt = os.path.join(args.workdir, "checkpoints")
    eval_json = os.path.join(args.workdir, "evaluation.json")
    step("6. evaluate: held-out perplexity and LAMBADA-style last-word accuracy")
    run_tool(evaluate, ["--load", ckpt, "--ppl-data", heldout, "--max-tokens", str(preset.eval_tokens),
                        "--lambada", lambada, "--output", eval_json], "tools/evaluate.py")

    step("7. generate")
    prompts = os.path.join(args.workdir, "prompts.jsonl")
    with open(prompts, "w") as f:
        for p in PROMPTS:
            f.write(json.dumps({"prompt": p}) + "\n")
    generated = os.path.join(args.workdir, "generated.jsonl")
    run_tool(generate_samples, ["--load", ckpt, "--input", prompts, "--output", generated,
                                "--max-new-tokens", str(preset.new_tokens), "--top-k", "20", "--temperature", "0.7",
                                "--repetition-penalty", "1.2", "--no-stop-at-eod", "--seed", "1"],
             "tools/generate_samples_gpt.py")
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("gpt", "bert", "t5"), default="gpt",
                   help="model family: gpt (this script's steps), bert (tools/quickstart_bert.py) or t5 "
                        "(tools/quickstart_t5.py)")
    p.add_argument("--workdir", default=None, help="default: quickstart/ (gpt), quickstart-<model>/ (others)")
    p.add_argument("--size", choices=sorted(PRESETS), default=os.environ.get("QUICKSTART_SIZE"),
                   help="model/data size (default: gpu when a GPU is present, else cpu)")
    p.add_argument("--launcher", choices=("torchrun", "deepspeed"), default="torchrun")
    p.add_argument("--workers", type=int, default=2, help="preprocessing processes")
    p.add_argument("--train-iters", type=int, default=None, help="override the size's iteration count")
    args = p.parse_args(argv)
    if args.size is None:
        import torch
        args.size = "gpu" if torch.cuda.is_available() else "cpu"
    if args.workdir is None:
        args.workdir = os.path.join(ROOT, "quickstart" if args.model == "gpt" else f"quickstart-{args.model}")
    if args.model == "bert":
        from quickstart_bert import run
        return run(args)
    if args.model == "t5":
        from quickstart_t5 import run as run_t5
        return run_t5(args)
    preset = PRESETS[args.size]
    if args.train_iters:
        preset = dataclasses.replace(preset, iters=args.train_iters,
                                     resume_iters=min(preset.resume_iters, args.train_iters // 2))
    os.makedirs(args.workdir, exist_ok=True)
    t0 = time.time()
    data = prepare_data(args.workdir, preset, args.workers)
    trained = train_stages(args, preset, data)
    outputs = evaluate_and_generate(args, preset, data[3], data[4])
    report(args, preset, t0, trained, outputs, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
