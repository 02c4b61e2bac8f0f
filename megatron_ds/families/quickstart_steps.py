"""What every model family's quickstart (``tools/quickstart.py --model NAME``, ``ModelFamily.quickstart``)
is made of: the ``Quickstart`` a family registers (its presets and its steps: ``gpt/gpt_quickstart.py``;
BERT's and T5's share ``masked_quickstart.py``), and the steps they share -- the offline corpus with its
held-out modules, a tokenizer trained once, the launcher command, the training job and its resumed
continuation -- each printing the command it runs, and how long each step took (``timed_stages``).

The tools a quickstart runs (tools/preprocess_data.py, the evaluation, the export ...) are command lines
above this floor: ``cli/quickstart.py`` hands each family's steps a ``ToolRunner`` that runs a tools/
script's body in this process, by the script's path."""
from __future__ import annotations

import contextlib
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
from typing import Callable, Iterator

# The repository the package is installed from (pip install -e): the quickstarts run its
# pretrain_*.py with its ds_configs/ templates, and write their default workdir there.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# (tools/ script path, its arguments) -> None: runs the script's body, printing the command; a failure
# ends the quickstart (SystemExit). cli/quickstart.py's ``run_tool``.
ToolRunner = Callable[[str, list], None]


@dataclass(frozen=True)
class Quickstart:
    """A model family's quickstart (``ModelFamily.quickstart``)."""
    presets: dict  # --size -> the family's preset ("cpu", "gpu", "tiny")
    run: Callable  # (parsed tools/quickstart.py arguments, ToolRunner) -> exit status
    workdir: str  # the default --workdir, under the repository root
    steps: str  # one line per step, for tools/quickstart.py --help (``numbered_steps`` of its module's docstring)


def numbered_steps(doc: str) -> str:
    """The numbered list of steps in a quickstart module's docstring ("  1. ..." to the next blank line)."""
    match = re.search(r"^ +1\. .*?(?=\n\s*\n|\Z)", doc, re.S | re.M)
    if match is None:
        raise ValueError("a quickstart's docstring lists its steps: '  1. ...'")
    return match.group(0)


class StageClock:
    """The wall time of each ``=== N. title`` step of one quickstart run: ``start`` ends the running
    step, printing how long it took, and begins the next; ``stop`` ends the last one. ``clock``:
    seconds from a monotonic clock (a test passes its own)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self.began = clock()
        self.stages: list[tuple[str, float]] = []  # (short title, seconds), in order
        self._running: tuple[str, float] | None = None

    def start(self, title: str) -> None:
        self.stop()
        self._running = (short_title(title), self._clock())

    def stop(self) -> None:
        if self._running is None:
            return
        title, began = self._running
        self._running = None
        seconds = self._clock() - began
        self.stages.append((title, seconds))
        print(f"[{title}: {seconds:.1f} s]", flush=True)

    def table(self) -> str:
        """Every step's time and the total since the clock began (the time between steps included)."""
        width = max(len(title) for title, _ in self.stages + [("total", 0.0)])
        rows = [f"  {title:<{width}} {seconds:7.1f} s" for title, seconds in self.stages]
        return "\n".join(["time per step:", *rows, f"  {'total':<{width}} {self._clock() - self.began:7.1f} s"])


def short_title(title: str) -> str:
    """A step's number and first word ("4. train 280 iterations (...)" -> "4. train"): its row in the table."""
    m = re.match(r"\d+\.\s+\w+", title)
    return m.group(0) if m else title


_clock: StageClock | None = None  # the run's clock while a quickstart runs its steps, for step()


@contextlib.contextmanager
def timed_stages(clock: Callable[[], float] = time.monotonic) -> Iterator[StageClock]:
    """Time the steps that ``step`` begins inside the block; at its end, print the table of their
    times (only when the block finishes: a failed step's message stays the last thing printed)."""
    global _clock
    previous, _clock = _clock, StageClock(clock)
    try:
        yield _clock
        _clock.stop()
        print("\n" + _clock.table(), flush=True)
    finally:
        _clock = previous


def step(title: str) -> None:
    if _clock is not None:
        _clock.start(title)
    print(f"\n=== {title}", flush=True)


def make_corpus(workdir: str, preset) -> tuple[str, str, str]:
    """Training corpus and held-out files: (train JSONL, held-out JSONL, LAMBADA-style JSONL).
    Held-out modules never appear in the training corpus. ``preset``: any quickstart's preset (its
    corpus_mb and heldout_modules)."""
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


def train_tokenizer_once(run_tool: ToolRunner, corpus: str, kind: str, vocab_size: int, tok_dir: str, *,
                         made: str) -> None:
    """tools/train_tokenizer.py on the corpus into ``tok_dir``, unless ``made`` (a file it writes) exists."""
    if os.path.exists(made):
        print(f"reusing {tok_dir}")
        return
    run_tool("tools/train_tokenizer.py", ["--input", corpus, "--type", kind, "--vocab-size", str(vocab_size),
                                          "--output-dir", tok_dir])


def launcher_cmd(launcher: str, nproc: int) -> list[str]:
    if launcher == "deepspeed":
        return [os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--num_gpus", str(nproc)]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]


def parallel_layout() -> tuple[int, int, int]:
    """(processes, tensor parallel, pipeline parallel): 2 CPU processes as 2 pipeline stages; on
    GPUs, every local GPU with tensor parallel 2 (the rest data parallel), or 1 GPU alone."""
    import torch

    from megatron_ds.accelerator import on_cuda

    gpus = torch.cuda.device_count() if on_cuda() else 0
    if gpus == 0:
        return 2, 1, 2
    if gpus == 1:
        return 1, 1, 1
    return gpus - gpus % 2, 2, 1


def cpu_named_to_deepspeed() -> None:
    """Without a GPU, set DeepSpeed's own switch DS_ACCELERATOR=cpu for this process and the jobs it
    launches, before anything imports DeepSpeed. It would choose the CPU anyway, as megatron_ds does
    (megatron_ds.accelerator), but left to detect it, it logs "Setting accelerator to CPU. If you have
    GPU or other accelerator, we were unable to detect it." in the middle of the quickstart's output:
    a warning a new user reads as a failure, on a machine that has no GPU to find."""
    from megatron_ds.accelerator import CPU_SWITCH, on_cuda

    if not on_cuda():
        os.environ.setdefault(CPU_SWITCH, "cpu")


def begin(args, presets: dict):
    """What every quickstart does first: the preset of ``args.size`` (``--train-iters`` replacing its
    iterations, the resume point kept in the first half), the workdir made, and DeepSpeed told about a
    CPU (``cpu_named_to_deepspeed``)."""
    preset = presets[args.size]
    if args.train_iters:
        preset = dataclasses.replace(preset, iters=args.train_iters,
                                     resume_iters=min(preset.resume_iters, args.train_iters // 2))
    os.makedirs(args.workdir, exist_ok=True)
    cpu_named_to_deepspeed()
    return preset


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

