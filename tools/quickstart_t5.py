"""The T5 pipeline on one machine, CPU is enough (`make quickstart-t5`, or
`python tools/quickstart.py --model t5`):

  1. the quickstart's real-text corpus (Python standard library docstrings), held-out modules apart
  2. a WordPiece vocabulary trained on it                               tools/train_tokenizer.py
  3. sentence-split Megatron data (_text_sentence.bin/.idx)             tools/preprocess_data.py --split-sentences
  4. a small T5 trained on 2 processes (pipeline parallel 2, the encoder on stage 0 and the
     decoder on stage 1: --pipeline-model-parallel-split-rank 1)       pretrain_t5.py
  5. the run resumed from its checkpoint for the last iterations
  6. span-prediction loss and token accuracy on the held-out modules    tools/evaluate_t5.py
  7. the model exported to transformers' T5ForConditionalGeneration     tools/checkpoint/to_hf.py

The T5 here is the variant Hugging Face's T5 computes (no absolute positions, RMS norms, no
biases: megatron_ds/checkpoint/hf_t5.py), so step 7 can export it; drop those three flags for
Megatron's own T5 (learned positions, LayerNorm, biases), which trains the same way but does not export.
Every step prints the command it runs; a second run reuses what the first built.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass

from quickstart import ROOT, checkpoint_iteration, launcher_cmd, make_corpus, parallel_layout, run_tool, step

LOSS_RE = re.compile(r" iteration\s+(\d+)/\s*\d+ \|.*? lm loss: ([0-9.E+-]+) \|")
VALID_RE = re.compile(r" validation loss at .*?\| lm loss value: ([0-9.E+-]+) \|")
HF_VARIANT = ["--position-embedding-type", "none", "--normalization", "rmsnorm", "--disable-bias-linear"]


@dataclass(frozen=True)
class T5Preset:
    layers: int  # encoder layers, and as many decoder layers
    hidden: int
    heads: int
    seq: int  # --encoder-seq-length
    dec_seq: int  # --decoder-seq-length: fits the spans of 15% of seq (their tokens, sentinels, BOS)
    micro: int
    global_batch: int
    iters: int
    resume_iters: int
    lr: float
    corpus_mb: float
    vocab: int
    heldout_modules: int
    eval_samples: int


T5_PRESETS = {
    # a few minutes of training on 2 CPU cores (pipeline parallel 2, fp32)
    "cpu": T5Preset(layers=2, hidden=128, heads=4, seq=128, dec_seq=64, micro=8, global_batch=32, iters=200,
                    resume_iters=20, lr=1e-3, corpus_mb=2.0, vocab=4096, heldout_modules=40, eval_samples=256),
    "gpu": T5Preset(layers=12, hidden=768, heads=12, seq=512, dec_seq=128, micro=16, global_batch=128, iters=1000,
                    resume_iters=50, lr=1e-4, corpus_mb=20.0, vocab=8192, heldout_modules=40, eval_samples=1024),
    "tiny": T5Preset(layers=2, hidden=64, heads=4, seq=64, dec_seq=32, micro=4, global_batch=8, iters=8,
                     resume_iters=2, lr=2e-3, corpus_mb=0.3, vocab=512, heldout_modules=8, eval_samples=32),
}


def prepare_data(workdir: str, preset: T5Preset, workers: int) -> tuple[str, str, str]:
    """Steps 1-3: (training prefix, held-out prefix, vocab.txt)."""
    tok_dir, data_dir = os.path.join(workdir, "tokenizer"), os.path.join(workdir, "data")
    vocab = os.path.join(tok_dir, "vocab.txt")
    step("1. corpus")
    corpus, heldout, _ = make_corpus(workdir, preset)
    step("2. WordPiece vocabulary")
    if not os.path.exists(vocab):
        from train_tokenizer import main as train_tokenizer
        run_tool(train_tokenizer, ["--input", corpus, "--type", "wordpiece", "--vocab-size", str(preset.vocab),
                                   "--output-dir", tok_dir], "tools/train_tokenizer.py")
    else:
        print(f"reusing {vocab}")
    step("3. preprocess, one sequence per sentence")
    prefixes = []
    for source, name in ((corpus, "corpus"), (heldout, "heldout")):
        prefix = os.path.join(data_dir, name)
        if not os.path.exists(prefix + "_text_sentence.idx"):
            os.makedirs(data_dir, exist_ok=True)
            from preprocess_data import main as preprocess
            run_tool(preprocess, ["--input", source, "--output-prefix", prefix, "--json-keys", "text",
                                  "--split-sentences", "--tokenizer-type", "BertWordPieceLowerCase",
                                  "--vocab-file", vocab, "--workers", str(workers)], "tools/preprocess_data.py")
        else:
            print(f"reusing {prefix}_text_sentence.bin/.idx")
        prefixes.append(prefix + "_text_sentence")
    return prefixes[0], prefixes[1], vocab


def t5_layout() -> tuple[int, int, int]:
    """(processes, TP, PP): the quickstart's layout; at PP 2 the encoder and the decoder get a stage each."""
    return parallel_layout()


def train_flags(preset: T5Preset, data_prefix: str, vocab: str, ckpt: str, train_iters: int, tp: int,
                pp: int) -> list[str]:
    dp_micro = preset.micro * (t5_layout()[0] // (tp * pp))
    global_batch = max(preset.global_batch // dp_micro, 1) * dp_micro
    first = preset.iters - preset.resume_iters
    split = ["--pipeline-model-parallel-split-rank", str(pp // 2)] if pp > 1 else []
    return [
        "--encoder-num-layers", str(preset.layers), "--decoder-num-layers", str(preset.layers),
        "--hidden-size", str(preset.hidden), "--num-attention-heads", str(preset.heads),
        "--encoder-seq-length", str(preset.seq), "--decoder-seq-length", str(preset.dec_seq),
        "--max-position-embeddings", str(preset.seq), "--micro-batch-size", str(preset.micro),
        "--global-batch-size", str(global_batch), "--tensor-model-parallel-size", str(tp),
        "--pipeline-model-parallel-size", str(pp), *split, "--train-iters", str(train_iters),
        "--lr", str(preset.lr), "--min-lr", str(preset.lr / 10), "--lr-decay-style", "linear",
        "--lr-warmup-fraction", "0.05", "--lr-decay-iters", str(preset.iters), "--weight-decay", "0.01",
        "--clip-grad", "1.0", "--hidden-dropout", "0.0", "--attention-dropout", "0.0", *HF_VARIANT,
        "--data-path", data_prefix, "--split", "98,2,0",
        "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", vocab, "--vocab-extra-ids", "100",
        "--make-vocab-size-divisible-by", "64", "--mask-prob", "0.15", "--short-seq-prob", "0.1",
        "--log-interval", str(max(preset.iters // 20, 1)), "--eval-interval", str(first), "--eval-iters", "4",
        "--save", ckpt, "--save-interval", str(first), "--num-workers", "1", "--deepspeed",
        "--deepspeed_config", os.path.join(ROOT, "ds_configs", "zero0_bf16.json"),
    ]


def train(args, flags: list[str], nproc: int, load: str | None, log_path: str) -> tuple[list, list]:
    """One pretrain_t5.py job; ((iteration, lm loss) ..., validation lm losses) from its log."""
    cmd = launcher_cmd(args.launcher, nproc) + [os.path.join(ROOT, "pretrain_t5.py")] + flags
    if load:
        cmd += ["--load", load]
    print(f"$ {shlex.join(cmd)}", flush=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("OMP_NUM_THREADS", "1")
    losses, valid = [], []
    with open(log_path, "w") as log, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                      text=True, env=env, cwd=ROOT) as proc:
        for line in proc.stdout:
            log.write(line)
            if line.startswith((" iteration", " validation", "> megatron_ds", "saved", "loaded", "error")) \
                    or "Error" in line:
                print(line, end="", flush=True)
            m = LOSS_RE.match(line)
            if m:
                losses.append((int(m.group(1)), float(m.group(2))))
            m = VALID_RE.match(line)
            if m:
                valid.append(float(m.group(1)))
    if proc.returncode != 0:
        raise SystemExit(f"training failed (exit code {proc.returncode}); full log in {log_path}")
    return losses, valid


def train_stages(args, preset: T5Preset, data_prefix: str, vocab: str) -> dict:
    """Steps 4-5, each skipped when the checkpoint already has its iterations."""
    ckpt = os.path.join(args.workdir, "checkpoints")
    nproc, tp, pp = t5_layout()
    first = preset.iters - preset.resume_iters
    summary = {"losses": [], "validation": [], "layout": f"{nproc} processes, TP {tp}, PP {pp}", "checkpoints": ckpt}
    step(f"4. train {first} iterations ({summary['layout']})")
    if checkpoint_iteration(ckpt) >= first:
        print(f"reusing the checkpoint in {ckpt} (iteration {checkpoint_iteration(ckpt)})")
    else:
        if os.path.isdir(ckpt):
            shutil.rmtree(ckpt)  # a partial earlier run: start over
        losses, valid = train(args, train_flags(preset, data_prefix, vocab, ckpt, first, tp, pp), nproc, None,
                              os.path.join(args.workdir, "train.log"))
        summary["losses"] += losses
        summary["validation"] += valid
    step(f"5. resume from the checkpoint for the last {preset.resume_iters} iterations")
    if checkpoint_iteration(ckpt) >= preset.iters:
        print(f"reusing the checkpoint in {ckpt} (iteration {checkpoint_iteration(ckpt)})")
    else:
        flags = train_flags(preset, data_prefix, vocab, ckpt, preset.iters, tp, pp)
        flags[flags.index("--save-interval") + 1] = str(preset.iters)
        losses, valid = train(args, flags, nproc, ckpt, os.path.join(args.workdir, "resume.log"))
        summary["losses"] += losses
        summary["validation"] += valid
    return summary


def evaluate_and_export(args, preset: T5Preset, heldout_prefix: str) -> dict:
    """Steps 6-7 on the final checkpoint, in this process."""
    from evaluate_t5 import main as evaluate_t5
    from checkpoint.to_hf import main as to_hf

    ckpt = os.path.join(args.workdir, "checkpoints")
    out = os.path.join(args.workdir, "evaluation.json")
    step("6. evaluate: span-prediction loss on the held-out modules")
    run_tool(evaluate_t5, ["--load", ckpt, "--data-path", heldout_prefix, "--samples", str(preset.eval_samples),
                           "--output", out], "tools/evaluate_t5.py")
    step("7. export to Hugging Face transformers")
    hf_dir = os.path.join(args.workdir, "hf")
    run_tool(to_hf, ["--load", ckpt, "--out", hf_dir], "tools/checkpoint/to_hf.py")
    return {"evaluation": out, "hf": hf_dir}


def run(args) -> int:
    """The T5 quickstart with tools/quickstart.py's parsed arguments (--size, --workdir, ...)."""
    preset = T5_PRESETS[args.size]
    if args.train_iters:
        preset = T5Preset(**{**preset.__dict__, "iters": args.train_iters,
                             "resume_iters": min(preset.resume_iters, args.train_iters // 2)})
    os.makedirs(args.workdir, exist_ok=True)
    t0 = time.time()
    data_prefix, heldout_prefix, vocab = prepare_data(args.workdir, preset, args.workers)
    trained = train_stages(args, preset, data_prefix, vocab)
    outputs = evaluate_and_export(args, preset, heldout_prefix)
    ev = json.load(open(outputs["evaluation"]))
    print(f"\nT5 quickstart done in {time.time() - t0:.0f} s ({trained['layout']})")
    if trained["losses"]:
        (i0, lm0), (i1, lm1) = trained["losses"][0], trained["losses"][-1]
        print(f"  training lm loss     {lm0:.3f} (iteration {i0}) -> {lm1:.3f} (iteration {i1})")
    print(f"  held-out modules     span-prediction loss {ev['span_loss']:.3f}, token accuracy {ev['accuracy']:.3f} "
          f"({ev['target_tokens']} target tokens)")
    print("where everything is:")
    for name, path in (("workdir", args.workdir), ("vocabulary", vocab), ("data", data_prefix + ".bin/.idx"),
                       ("checkpoints", trained["checkpoints"]), ("evaluation", outputs["evaluation"]),
                       ("transformers", outputs["hf"])):
        print(f"  {name:<15}{path}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from quickstart import main
    sys.exit(main(["--model", "t5", *sys.argv[1:]]))
