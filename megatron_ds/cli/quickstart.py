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
  cpu   default without a GPU: the setting that reached the lowest validation loss while a fresh
        clone's `make quickstart` stays under 300 s on 2 CPU cores, installing included (bench/RESULTS.md)
  gpu   default with a GPU: a larger model on all local GPUs (tensor parallel 2 when there are >= 2)
  tiny  a minute-long smoke run (the end-to-end test uses it)

    python tools/quickstart.py [--workdir quickstart] [--size cpu|gpu|tiny] [--launcher torchrun|deepspeed]
"""
from __future__ import annotations

import argparse
import os

from megatron_ds.cli import quickstart_bert, quickstart_gpt, quickstart_t5
from megatron_ds.cli.quickstart_gpt import PRESETS
from megatron_ds.cli.quickstart_steps import ROOT


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
        from megatron_ds.accelerator import on_cuda  # noqa: PLC0415 - keep --help fast

        args.size = "gpu" if on_cuda() else "cpu"
    if args.workdir is None:
        args.workdir = os.path.join(ROOT, "quickstart" if args.model == "gpt" else f"quickstart-{args.model}")
    if args.model == "bert":
        return quickstart_bert.run(args)
    if args.model == "t5":
        return quickstart_t5.run(args)
    return quickstart_gpt.run(args)
