#!/usr/bin/env python
"""The whole pipeline on one machine, CPU is enough (`make quickstart` runs this):

  1. a real-text JSONL corpus made offline (Python standard library docstrings)
  2. a byte-level BPE tokenizer trained on it (GPT-2 file format)       tools/train_tokenizer.py
  3. Megatron .bin/.idx data                                            tools/preprocess_data.py
  4. a small GPT trained with 2 pipeline stages under a launcher        pretrain_gpt.py
  5. the run resumed from its checkpoint for a few more iterations

Every step prints the command it runs, so the same steps can be reused on a cluster.

    python tools/quickstart.py [--workdir quickstart] [--launcher torchrun|deepspeed] [--train-iters 60]
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))  # the sibling CLIs, imported as modules

LOSS_RE = re.compile(r" iteration\s+(\d+)/\s*\d+ \|.*? lm loss: ([0-9.E+-]+) \|")


def step(title: str) -> None:
    print(f"\n=== {title}", flush=True)


def run_tool(module_main, argv: list[str], name: str) -> None:
    print(f"$ python {name} {shlex.join(argv)}", flush=True)
    rc = module_main(argv)
    if rc not in (0, None):
        raise SystemExit(f"{name} failed with exit code {rc}")


def prepare_data(workdir: str, corpus_mb: float, vocab_size: int, workers: int) -> tuple[str, str, str]:
    """Steps 1-3. Returns (data prefix, vocab file, merge file); reuses what an earlier run made."""
    from megatron_ds.data.sample_corpus import write_corpus

    corpus = os.path.join(workdir, "corpus.jsonl")
    tok_dir = os.path.join(workdir, "tokenizer")
    prefix = os.path.join(workdir, "data", "corpus")
    vocab, merges = os.path.join(tok_dir, "vocab.json"), os.path.join(tok_dir, "merges.txt")
    data_prefix = f"{prefix}_text_document"

    step("1. corpus")
    if not os.path.exists(corpus):
        docs, nbytes = write_corpus(corpus + ".tmp", corpus_mb)
        os.replace(corpus + ".tmp", corpus)
        print(f"wrote {docs} documents, {nbytes / 1e6:.1f} MB of text to {corpus}")
    else:
        print(f"reusing {corpus}")

    step("2. tokenizer")
    if not os.path.exists(merges):
        from train_tokenizer import main as train_tokenizer
        run_tool(train_tokenizer, ["--input", corpus, "--type", "bpe", "--vocab-size", str(vocab_size),
                                   "--output-dir", tok_dir], "tools/train_tokenizer.py")
    else:
        print(f"reusing {tok_dir}")

    step("3. preprocess")
    if not os.path.exists(data_prefix + ".idx"):
        os.makedirs(os.path.dirname(prefix), exist_ok=True)
        from preprocess_data import main as preprocess
        run_tool(preprocess, ["--input", corpus, "--output-prefix", prefix, "--json-keys", "text",
                              "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges,
                              "--append-eod", "--workers", str(workers)], "tools/preprocess_data.py")
    else:
        print(f"reusing {data_prefix}.bin/.idx")
    return data_prefix, vocab, merges


def launcher_cmd(launcher: str, nproc: int) -> list[str]:
    if launcher == "deepspeed":
        return [os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--num_gpus", str(nproc)]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]


def train(args, data_prefix: str, vocab: str, merges: str, train_iters: int, load: bool, log_path: str) -> list:
    ckpt = os.path.join(args.workdir, "checkpoints")
    if not load and os.path.isdir(ckpt):
        # A rerun starts over: training refuses to overwrite the checkpoints of the previous run.
        print(f"   (removing the previous run's {ckpt})", flush=True)
        shutil.rmtree(ckpt)
    flags = [
        "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
        "--max-position-embeddings", "128", "--micro-batch-size", "4", "--global-batch-size", "16",
        "--pipeline-model-parallel-size", "2", "--train-iters", str(train_iters),
        "--lr", "2e-3", "--min-lr", "2e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "5",
        "--lr-decay-iters", str(args.train_iters + args.resume_iters),
        "--weight-decay", "0.1", "--clip-grad", "1.0", "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
        "--data-path", data_prefix, "--split", "98,2,0", "--tokenizer-type", "GPT2BPETokenizer",
        "--vocab-file", vocab, "--merge-file", merges, "--make-vocab-size-divisible-by", "64",
        "--log-interval", str(args.log_interval), "--eval-interval", str(args.train_iters), "--eval-iters", "2",
        "--save", ckpt, "--save-interval", str(args.train_iters), "--num-workers", "1",
        "--deepspeed", "--deepspeed_config", os.path.join(ROOT, "ds_configs", "zero0_bf16.json"), "--bf16",
    ]
    if load:
        flags += ["--load", ckpt]
    cmd = launcher_cmd(args.launcher, 2) + [os.path.join(ROOT, "pretrain_gpt.py")] + flags
    print(f"$ {shlex.join(cmd)}", flush=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    losses = []
    with open(log_path, "w") as log, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                      text=True, env=env, cwd=ROOT) as proc:
        for line in proc.stdout:
            log.write(line)
            if line.startswith((" iteration", " validation", "-" * 20, "> megatron_ds", "saved", "loaded",
                                "error", "WARNING: ignoring")) or "Error" in line:
                print(line, end="", flush=True)
            m = LOSS_RE.match(line)
            if m:
                losses.append((int(m.group(1)), float(m.group(2))))
    if proc.returncode != 0:
        raise SystemExit(f"training failed (exit code {proc.returncode}); full log in {log_path}")
    return losses


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default=os.path.join(ROOT, "quickstart"))
    p.add_argument("--launcher", choices=("torchrun", "deepspeed"), default="torchrun")
    p.add_argument("--corpus-mb", type=float, default=4.0)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--train-iters", type=int, default=60)
    p.add_argument("--resume-iters", type=int, default=10)
    p.add_argument("--log-interval", type=int, default=5)
    args = p.parse_args(argv)
    os.makedirs(args.workdir, exist_ok=True)
    t0 = time.time()
    data_prefix, vocab, merges = prepare_data(args.workdir, args.corpus_mb, args.vocab_size, args.workers)

    step(f"4. train {args.train_iters} iterations (2 processes, pipeline parallel 2, bf16)")
    first = train(args, data_prefix, vocab, merges, args.train_iters, load=False,
                  log_path=os.path.join(args.workdir, "train.log"))
    step(f"5. resume from the checkpoint for {args.resume_iters} more iterations")
    second = train(args, data_prefix, vocab, merges, args.train_iters + args.resume_iters, load=True,
                   log_path=os.path.join(args.workdir, "resume.log"))
    print(f"\nquickstart done in {time.time() - t0:.0f} s: lm loss {first[0][1]:.3f} (iteration {first[0][0]}) -> "
          f"{second[-1][1]:.3f} (iteration {second[-1][0]}); logs and checkpoints in {args.workdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
