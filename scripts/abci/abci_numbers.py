#!/usr/bin/env python
"""The numbers quoted in the job scripts' headers and in docs/abci.md, computed by the estimator that
``pretrain_gpt.py --dry-run`` prints (megatron_ds/config/memory.py), for each script's own flags.

    python scripts/abci/abci_numbers.py           # rewrite them
    python scripts/abci/abci_numbers.py --check   # exit 1 naming what drifted (tests/launch/test_abci_scripts.py)

A script's flags are the ones its DRY_RUN passes: the script runs under bash with DRY_RUN=1 and an
entry point that only records its arguments -- no scheduler, no module loads, placeholder input
files -- at the node count of its own header. The vocabulary is GPT-2's (the scripts' tokenizer; Llama 3's
for the llama3 scripts).
Places: in a script, the lines after the one ending in MARKER; in the docs, the code block between
``<!-- abci_numbers.py: [VAR=value ...] SCRIPT -->`` and ``<!-- /abci_numbers.py -->``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

ABCI = os.path.join(ROOT, "scripts", "abci")
DOC = os.path.join(ROOT, "docs", "abci.md")
MARKER = "(python scripts/abci/abci_numbers.py writes these lines):"
DOC_BLOCK = re.compile(r"(<!-- abci_numbers\.py: (?P<case>[^>]*?) -->\n```\n)(?P<body>.*?)"
                       r"(```\n<!-- /abci_numbers\.py -->)", re.S)
# the inputs a job script checks before its DRY_RUN (their contents are never read here)
PLACEHOLDERS = ("data/gpt2/gpt2-vocab.json", "data/gpt2/gpt2-merges.txt",
                "data/tinystories/tinystories_train_text_document.bin",
                "data/tinystories/tinystories_train_text_document.idx",
                "data/bert/bert-large-uncased-vocab.txt", "data/bert/bert_text_sentence.bin",
                "data/bert/bert_text_sentence.idx", "hf/Llama-3.1-8B/tokenizer.json",
                "checkpoints/llama3.1_8b_hf/latest_checkpointed_iteration.txt",
                "data/llama3/corpus_text_document.bin", "data/llama3/corpus_text_document.idx")
BERT_VOCAB_SIZE = 30522  # bert-large-uncased's vocab.txt, the BERT scripts' default vocabulary
LLAMA3_VOCAB_SIZE = 128256  # Llama 3's tokenizer.json (128,000 BPE tokens + 256 special), the llama3 scripts'
RECORD_ARGV = "import json, os, sys\njson.dump(sys.argv[1:], open(os.environ['NUMBERS_ARGV'], 'w'))\n"
WIDTH = 100


def header_nodes(script: str) -> int:
    text = open(os.path.join(ABCI, script)).read()
    m = re.search(r"^#\$ -l rt_[A-Z]+=(\d+)$", text, re.M) or re.search(r"^#PBS -l select=(\d+)", text, re.M)
    return int(m.group(1))


def dry_run_argv(script: str, overrides: dict) -> list[str]:
    """The pretrain_gpt.py arguments of the script's DRY_RUN (``--dry-run --world-size N ...`` included)."""
    with tempfile.TemporaryDirectory() as tmp:
        for name in PLACEHOLDERS:
            os.makedirs(os.path.dirname(os.path.join(tmp, name)), exist_ok=True)
            open(os.path.join(tmp, name), "w").close()
        with open(os.path.join(tmp, "record.py"), "w") as f:
            f.write(RECORD_ARGV)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", tmp), "DRY_RUN": "1",
               "NUM_NODES": str(header_nodes(script)), "MEGATRON_DS_ENTRY": os.path.join(tmp, "record.py"),
               "PYTHON": sys.executable, "NUMBERS_ARGV": os.path.join(tmp, "argv.json"), "MEGATRON_DS_ROOT": ROOT,
               **{f"{k}_MODULE": "" for k in ("CUDA", "CUDNN", "NCCL", "HPCX")}, **overrides}
        proc = subprocess.run(["bash", os.path.join(ABCI, script)], env=env, cwd=tmp, capture_output=True, text=True,
                              timeout=300)
        if proc.returncode:
            raise SystemExit(f"{script}: its DRY_RUN failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
        with open(env["NUMBERS_ARGV"]) as f:
            return json.load(f)


def resolved(argv: list[str], script: str = ""):
    """(the Run, the GPU memory budget in bytes) of a DRY_RUN's arguments (a ``*bert*`` script's:
    pretrain_bert.py's model and a BERT vocabulary; a ``*_t5_*`` script's: pretrain_t5.py's)."""
    from megatron_ds.config import memory, parse_args, resolve
    from megatron_ds.data.tokenizer import GPT2_VOCAB_SIZE
    from megatron_ds.families import get_family

    flags, ignored = parse_args(argv)
    name = os.path.basename(script)
    bert, t5 = "bert" in name, "_t5_" in name
    # T5: the BERT vocabulary plus [BOS], [EOS] (which bert-large's vocab.txt lacks) and the sentinels
    vocab = BERT_VOCAB_SIZE + 2 + flags.masked_lm.vocab_extra_ids if t5 else BERT_VOCAB_SIZE if bert else \
        LLAMA3_VOCAB_SIZE if "llama3" in name else GPT2_VOCAB_SIZE
    run = resolve(flags, world_size=flags.world_size, vocab_size=vocab, ignored=ignored,
                  family=get_family("t5" if t5 else "bert" if bert else "gpt"))
    return run, memory.gpu_memory_bytes(flags.gpu_memory_gb)


def header_lines(script: str) -> list[str]:
    from megatron_ds.config import memory
    from megatron_ds.checkpoint.room import estimated_bytes

    run, budget = resolved(dry_run_argv(script, {}), script)
    est = memory.estimate_memory(run.layout)
    terms = dict(est.terms)
    states = terms["weights"] + terms["gradients"] + terms["optimizer states"]
    gb = memory.GB
    return [f"#   stage {est.stage}: weights + gradients + optimizer states {states / gb:.2f} GB, activations "
            f"{terms['activations'] / gb:.2f} GB;",
            f"#   total {est.total / gb:.2f} of {budget / gb:.0f} GB. One checkpoint (weights and optimizer states): "
            f"~{estimated_bytes(run.layout) / 1e9:.0f} GB"]


def doc_block(case: str) -> str:
    """The dry run's memory line for ``[VAR=value ...] SCRIPT``; the error and the FAILED line when
    the layout does not fit."""
    from megatron_ds.config import memory
    from megatron_ds.errors import ConfigError

    *assignments, script = case.split()
    overrides = dict(a.split("=", 1) for a in assignments)
    run, budget = resolved(dry_run_argv(script, overrides), script)
    est = memory.estimate_memory(run.layout)
    try:
        memory.check_memory(run.layout, est, budget)
    except ConfigError as exc:
        command = " ".join([*assignments, f"NUM_NODES={header_nodes(script)}", "DRY_RUN=1", "bash",
                            f"scripts/abci/{script}"])
        return "\n".join([f"$ {command}", "...", *_wrap(f"error: {exc}"),
                          "[abci] DRY_RUN: FAILED: fix the error above before submitting"]) + "\n"
    return "\n".join(_wrap(est.describe(budget))) + "\n"


def _wrap(text: str) -> list[str]:
    return textwrap.wrap(text, WIDTH, break_long_words=False, break_on_hyphens=False)


def regenerated(path: str, text: str) -> str:
    """``text`` (the file at ``path``) with its generated numbers recomputed."""
    if path == DOC:
        return DOC_BLOCK.sub(lambda m: m.group(1) + doc_block(m.group("case")) + m.group(4), text)
    lines = text.splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if line.rstrip().endswith(MARKER)) + 1
    end = at
    while end < len(lines) and lines[end].startswith("#   "):
        end += 1
    return "".join(lines[:at] + [line + "\n" for line in header_lines(os.path.basename(path))] + lines[end:])


def targets() -> list[str]:
    scripts = sorted(n for n in os.listdir(ABCI) if n.startswith("abci") and n.endswith(".sh"))
    return [os.path.join(ABCI, n) for n in scripts] + [DOC]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 naming the files that drifted")
    args = p.parse_args(argv)
    drifted = []
    for path in targets():
        with open(path) as f:
            old = f.read()
        new = regenerated(path, old)
        if new != old:
            drifted.append(os.path.relpath(path, ROOT))
            if not args.check:
                with open(path, "w") as f:
                    f.write(new)
    if drifted and args.check:
        print(f"error: the numbers in {', '.join(drifted)} differ from the estimator's: run python "
              f"scripts/abci/abci_numbers.py", file=sys.stderr)
        return 1
    print(f"{'rewrote' if drifted else 'up to date:'} {', '.join(drifted) or 'all'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
