"""The steps the masked-data quickstarts share (BERT: bert/bert_quickstart.py, T5: t5/t5_quickstart.py):
a WordPiece vocabulary, --split-sentences data, the training job and its resumed continuation, the
family's evaluation tool and the export to transformers. ``MaskedSteps`` holds what differs between
them: the training script, its model flags, its log's losses, its evaluation; ``quickstart`` makes
the family's ``Quickstart`` of them.
"""
from __future__ import annotations

import functools
import json
import os
import re
import time
from dataclasses import dataclass
from typing import Callable

from megatron_ds.families.quickstart_steps import (ROOT, Quickstart, ToolRunner, begin,
                                                   launcher_cmd, make_corpus, parallel_layout, run_job, step,
                                                   timed_stages, train_then_resume, train_tokenizer_once)

VALID_RE = re.compile(r" validation loss at .*?\| lm loss value: ([0-9.E+-]+) \|")
ECHO = (" iteration", " validation", "> megatron_ds", "saved", "loaded", "error")  # log lines shown live


@dataclass(frozen=True)
class MaskedPreset:
    layers: int  # T5: encoder layers, and as many decoder layers
    hidden: int
    heads: int
    seq: int  # T5: --encoder-seq-length
    micro: int
    global_batch: int
    iters: int
    resume_iters: int
    lr: float
    corpus_mb: float
    vocab: int
    heldout_modules: int
    eval_samples: int
    dec_seq: int = 0  # T5 only, --decoder-seq-length: fits the spans of 15% of seq (their tokens, sentinels, BOS)


@dataclass(frozen=True)
class MaskedSteps:
    name: str  # as the summary names it: "BERT"
    script: str  # the training script in the repository root
    presets: dict[str, MaskedPreset]
    model_flags: Callable[[MaskedPreset, int], list[str]]  # (preset, PP): the architecture's flags
    loss_re: re.Pattern  # a training log line: its iteration, then its losses
    evaluation: str  # the evaluation tool's path: tools/evaluate_mlm.py
    evaluation_title: str  # step 6's title
    summarize: Callable[[list, dict], list[str]]  # (training losses, evaluation JSON): the summary's lines


def prepare_data(run_tool: ToolRunner, workdir: str, preset: MaskedPreset, workers: int) -> tuple[str, str, str]:
    """Steps 1-3: (training prefix, held-out prefix, vocab.txt)."""
    tok_dir, data_dir = os.path.join(workdir, "tokenizer"), os.path.join(workdir, "data")
    vocab = os.path.join(tok_dir, "vocab.txt")
    step("1. corpus")
    corpus, heldout, _ = make_corpus(workdir, preset)
    step("2. WordPiece vocabulary")
    train_tokenizer_once(run_tool, corpus, "wordpiece", preset.vocab, tok_dir, made=vocab)
    step("3. preprocess, one sequence per sentence")
    prefixes = []
    for source, name in ((corpus, "corpus"), (heldout, "heldout")):
        prefix = os.path.join(data_dir, name)
        if not os.path.exists(prefix + "_text_sentence.idx"):
            os.makedirs(data_dir, exist_ok=True)
            run_tool("tools/preprocess_data.py", ["--input", source, "--output-prefix", prefix, "--json-keys", "text",
                                                  "--split-sentences", "--tokenizer-type", "BertWordPieceLowerCase",
                                                  "--vocab-file", vocab, "--workers", str(workers)])
        else:
            print(f"reusing {prefix}_text_sentence.bin/.idx")
        prefixes.append(prefix + "_text_sentence")
    return prefixes[0], prefixes[1], vocab


def train_flags(family: MaskedSteps, preset: MaskedPreset, data_prefix: str, vocab: str, ckpt: str, train_iters: int,
                tp: int, pp: int) -> list[str]:
    dp_micro = preset.micro * (parallel_layout()[0] // (tp * pp))
    global_batch = max(preset.global_batch // dp_micro, 1) * dp_micro
    first = preset.iters - preset.resume_iters
    return family.model_flags(preset, pp) + [
        "--max-position-embeddings", str(preset.seq), "--micro-batch-size", str(preset.micro),
        "--global-batch-size", str(global_batch), "--tensor-model-parallel-size", str(tp),
        "--pipeline-model-parallel-size", str(pp), "--train-iters", str(train_iters),
        "--lr", str(preset.lr), "--min-lr", str(preset.lr / 10), "--lr-decay-style", "linear",
        "--lr-warmup-fraction", "0.05", "--lr-decay-iters", str(preset.iters), "--weight-decay", "0.01",
        "--clip-grad", "1.0", "--data-path", data_prefix, "--split", "98,2,0",
        "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", vocab, "--make-vocab-size-divisible-by", "64",
        "--mask-prob", "0.15", "--short-seq-prob", "0.1", "--log-interval", str(max(preset.iters // 20, 1)),
        "--eval-interval", str(first), "--eval-iters", "4", "--save", ckpt, "--save-interval", str(first),
        "--num-workers", "1", "--deepspeed", "--deepspeed_config", os.path.join(ROOT, "ds_configs", "zero0_bf16.json"),
    ]


def train(args, family: MaskedSteps, flags: list[str], nproc: int, load: str | None, log_path: str) -> tuple[list,
                                                                                                             list]:
    """One training job; ((iteration, loss, ...) ..., validation lm losses) from its log."""
    cmd = launcher_cmd(args.launcher, nproc) + [os.path.join(ROOT, family.script)] + flags
    if load:
        cmd += ["--load", load]
    losses, valid = run_job(cmd, log_path, ECHO, (family.loss_re, VALID_RE))
    return [(int(it), *map(float, rest)) for it, *rest in losses], [float(loss) for loss, in valid]


def train_stages(args, family: MaskedSteps, preset: MaskedPreset, data_prefix: str, vocab: str) -> dict:
    """Steps 4-5, each skipped when the checkpoint already has its iterations."""
    ckpt = os.path.join(args.workdir, "checkpoints")
    nproc, tp, pp = parallel_layout()
    first = preset.iters - preset.resume_iters
    return train_then_resume(
        args.workdir, ckpt, first, preset.iters, f"{nproc} processes, TP {tp}, PP {pp}",
        lambda iters: train_flags(family, preset, data_prefix, vocab, ckpt, iters, tp, pp),
        lambda flags, load, log_path: train(args, family, flags, nproc, load, log_path))


def evaluate_and_export(args, run_tool: ToolRunner, family: MaskedSteps, preset: MaskedPreset,
                        heldout_prefix: str) -> dict:
    """Steps 6-7 on the final checkpoint, in this process."""
    ckpt = os.path.join(args.workdir, "checkpoints")
    out = os.path.join(args.workdir, "evaluation.json")
    step(f"6. evaluate: {family.evaluation_title}")
    run_tool(family.evaluation, ["--load", ckpt, "--data-path", heldout_prefix, "--samples", str(preset.eval_samples),
                                 "--output", out])
    step("7. export to Hugging Face transformers")
    hf_dir = os.path.join(args.workdir, "hf")
    run_tool("tools/checkpoint/to_hf.py", ["--load", ckpt, "--out", hf_dir])
    return {"evaluation": out, "hf": hf_dir}


def run(args, run_tool: ToolRunner, family: MaskedSteps) -> int:
    """One family's quickstart with tools/quickstart.py's parsed arguments (--size, --workdir, ...)."""
    preset = begin(args, family.presets)
    t0 = time.time()
    with timed_stages():
        data_prefix, heldout_prefix, vocab = prepare_data(run_tool, args.workdir, preset, args.workers)
        trained = train_stages(args, family, preset, data_prefix, vocab)
        outputs = evaluate_and_export(args, run_tool, family, preset, heldout_prefix)
    ev = json.load(open(outputs["evaluation"]))
    print(f"\n{family.name} quickstart done in {time.time() - t0:.0f} s ({trained['layout']})")
    for line in family.summarize(trained["losses"], ev):
        print(line)
    print("where everything is:")
    for name, path in (("workdir", args.workdir), ("vocabulary", vocab), ("data", data_prefix + ".bin/.idx"),
                       ("checkpoints", trained["checkpoints"]), ("evaluation", outputs["evaluation"]),
                       ("transformers", outputs["hf"])):
        print(f"  {name:<15}{path}")
    return 0


def quickstart(steps: MaskedSteps, workdir: str, listing: str) -> Quickstart:
    """The family's ``Quickstart`` of these steps (``listing``: its steps, for tools/quickstart.py --help)."""
    return Quickstart(presets=steps.presets, run=functools.partial(_run_steps, steps), workdir=workdir, steps=listing)


def _run_steps(steps: MaskedSteps, args, run_tool: ToolRunner) -> int:
    return run(args, run_tool, steps)
