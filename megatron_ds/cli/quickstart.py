"""A model family's whole pipeline on one machine, CPU is enough (`make quickstart` runs the GPT's):
a corpus made offline, a tokenizer trained on it, Megatron data, a small model trained on 2 processes
and resumed from its checkpoint, then evaluated (and more: generation, a transformers export). Every
step prints the command it runs, so the same steps can be reused on a cluster. A second run reuses
what the first built (corpus, tokenizer, data, checkpoint) and redoes only the steps after training.

    python tools/quickstart.py [--model NAME] [--workdir DIR] [--size cpu|gpu|tiny] [--launcher torchrun|deepspeed]

Sizes (--size, or the QUICKSTART_SIZE environment variable): cpu (the default without a GPU: the
setting that reached the lowest validation loss while a fresh clone's `make quickstart` stays under
300 s on 2 CPU cores, installing included; bench/RESULTS.md), gpu (the default with one: a larger model
on all local GPUs), tiny (a minute-long smoke run, the end-to-end tests'). Each model family registers
its steps (``ModelFamily.quickstart``, ``families/quickstart_steps.py``); --help lists them.
"""
from __future__ import annotations

import argparse
import importlib
import os
import shlex
from pathlib import Path

from megatron_ds.families import FAMILIES
from megatron_ds.families.quickstart_steps import ROOT


def run_tool(script: str, argv: list[str]) -> None:
    """The quickstarts' ``ToolRunner``: tools/X.py's body (``megatron_ds.cli.X.main``: every tools/ script
    calls the module of its name) in this process, printed as the command that does the same."""
    print(f"$ python {script} {shlex.join(argv)}", flush=True)
    rc = importlib.import_module(f"megatron_ds.cli.{Path(script).stem}").main(argv)
    if rc not in (0, None):
        raise SystemExit(f"{script} failed with exit code {rc}")


def _description() -> str:
    steps = "\n\n".join(f"--model {name}:\n{family.quickstart.steps}" for name, family in FAMILIES.items()
                        if family.quickstart is not None)
    return f"{__doc__}\n{steps}"


def build_parser() -> argparse.ArgumentParser:
    models = [name for name, family in FAMILIES.items() if family.quickstart is not None]
    sizes = sorted({size for name in models for size in FAMILIES[name].quickstart.presets})
    p = argparse.ArgumentParser(description=_description(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=models, default=models[0], help=f"model family (default {models[0]})")
    p.add_argument("--workdir", default=None,
                   help="default: the family's, under the repository root (" + ", ".join(
                       f"{FAMILIES[name].quickstart.workdir}/" for name in models) + ")")
    p.add_argument("--size", choices=sizes, default=os.environ.get("QUICKSTART_SIZE"),
                   help="model/data size (default: gpu when a GPU is present, else cpu)")
    p.add_argument("--launcher", choices=("torchrun", "deepspeed"), default="torchrun")
    p.add_argument("--workers", type=int, default=2, help="preprocessing processes")
    p.add_argument("--train-iters", type=int, default=None, help="override the size's iteration count")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    quickstart = FAMILIES[args.model].quickstart
    if args.size is None:
        from megatron_ds.accelerator import on_cuda  # noqa: PLC0415 - keep --help fast

        args.size = "gpu" if on_cuda() else "cpu"
    if args.workdir is None:
        args.workdir = os.path.join(ROOT, quickstart.workdir)
    return quickstart.run(args, run_tool)
