"""Run lm-evaluation-harness (the ``lm_eval`` package) on a checkpoint directly, no export needed.

The model comes from a checkpoint directory (--load; saved at any tensor / pipeline parallel size)
or a Hugging Face export (--hf-model); under a launcher (torchrun, deepspeed) the processes are
tensor parallel ranks and all of them run lm-eval in lockstep (megatron_ds/inference/harness.py
says why). The scores equal lm-eval's own ``hf`` model on the checkpoint's Hugging Face export
(tools/checkpoint/to_hf.py).

Tasks: lm-eval's names (--tasks hellaswag,lambada_openai), or your own task YAMLs found under
--include-path. Offline: a task YAML whose dataset is a local file, e.g.

    task: my_choice
    dataset_path: json
    dataset_kwargs: {data_files: {test: /data/my_choice.jsonl}}
    test_split: test
    output_type: multiple_choice
    doc_to_text: "{{question}}"
    doc_to_choice: "{{choices}}"
    doc_to_target: "{{answer}}"
    metric_list: [{metric: acc}]

with --offline (no Hugging Face hub access; data_files paths relative to the working directory).
Megatron's model flags (--num-layers, --hidden-size, ..., --tensor-model-parallel-size) are checked
against the checkpoint, as in tools/evaluate.py; Megatron-DeepSpeed's tasks/eval_harness names
--task_list, --results_path, --eval_fp32 and --micro-batch-size mean --tasks, --output, --dtype fp32
and --batch-size.

Examples:
  python tools/eval_harness.py --load checkpoints --tasks lambada_openai,hellaswag --output lm_eval.json
  python tools/eval_harness.py --load checkpoints --include-path my_tasks --tasks my_choice --offline
  torchrun --nproc-per-node 2 tools/eval_harness.py --load checkpoints --tasks my_choice --include-path my_tasks
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from megatron_ds.inference.runtime import (add_megatron_model_args, add_model_args, close_session,
                                           open_session)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n",
                                                     1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    g = p.add_argument_group("lm-evaluation-harness")
    # --task_list, --results_path, --eval_fp32, --adaptive_seq_len: Megatron-DeepSpeed's
    # tasks/eval_harness/evaluate.py names (tasks_args) for the same things
    g.add_argument("--tasks", "--task_list", required=True, help="comma-separated task (or group) names")
    g.add_argument("--include-path", action="append", default=[],
                   help="a folder (or YAML file) of your own task configs (repeatable)")
    g.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples (default: the task's)")
    g.add_argument("--limit", type=float, default=None,
                   help="only the first N documents per task (a fraction when below 1; for testing)")
    g.add_argument("--batch-size", "--micro-batch-size", type=int, default=8, help="requests per forward")
    g.add_argument("--max-length", type=int, default=None,
                   help="longest input in tokens (default: the model's positions, as lm-eval reads the export)")
    g.add_argument("--max-gen-toks", type=int, default=256, help="default new tokens for generation tasks")
    g.add_argument("--prefix-token-id", type=int, default=None,
                   help="the token before a document or an empty context (default: the tokenizer's bos if it has "
                        "one, else end-of-document: lm-eval's hf rule)")
    g.add_argument("--seed", type=int, default=None,
                   help="one seed for lm-eval's python, numpy, torch and few-shot sampling (default: lm-eval's)")
    g.add_argument("--offline", action="store_true",
                   help="never reach the Hugging Face hub (HF_DATASETS_OFFLINE=1, HF_HUB_OFFLINE=1): local tasks")
    g.add_argument("--no-builtin-tasks", action="store_true",
                   help="index only --include-path (faster start when every task is your own)")
    g.add_argument("--eval_fp32", dest="dtype", action="store_const", const="fp32", help="as --dtype fp32")
    g.add_argument("--adaptive_seq_len", action="store_true",
                   help="accepted; a batch is always as long as its longest request here")
    add_megatron_model_args(p)
    g = p.add_argument_group("output")
    g.add_argument("--output", "--results_path", default="lm_eval.json", help="JSON file for the results")
    g.add_argument("--log-samples", action="store_true", help="also write every document's requests and scores")
    return p


def _seeds(seed: int | None) -> dict:
    if seed is None:
        return {}
    return dict(random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed)


def find_tasks(args):
    """(lm-eval's task manager, the task names), every name checked before the model is loaded."""
    from lm_eval.tasks import TaskManager  # noqa: PLC0415 - heavy; after --offline is applied

    manager = TaskManager(include_path=args.include_path or None, include_defaults=not args.no_builtin_tasks)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown or not tasks:
        raise ValueError(f"unknown task(s) {', '.join(unknown) or '(none given)'}: not lm-eval's, nor under "
                         f"--include-path {' '.join(args.include_path) or '(none given)'}")
    return manager, tasks


def run_harness(session, args, manager, tasks) -> dict | None:
    """lm-eval's ``simple_evaluate`` on the session's model; its results dict (None on the ranks
    whose LOCAL_RANK is not 0: lm-eval aggregates on one process per node)."""
    from lm_eval.evaluator import simple_evaluate  # noqa: PLC0415

    from megatron_ds.inference.harness import MegatronLM  # noqa: PLC0415 - needs lm_eval

    if not session.is_main:  # the other ranks compute the same: one copy of lm-eval's messages is enough
        logging.getLogger("lm_eval").setLevel(logging.ERROR)
    m = session.weights.model
    lm = MegatronLM(session.model, session.tokenizer, max_length=args.max_length or m.max_position_embeddings
                    or m.seq_length, batch_size=args.batch_size, max_gen_toks=args.max_gen_toks,
                    prefix_token_id=args.prefix_token_id)
    results = simple_evaluate(model=lm, tasks=tasks, num_fewshot=args.num_fewshot, limit=args.limit,
                              log_samples=args.log_samples, task_manager=manager, **_seeds(args.seed))
    if results is not None:
        results["model"] = session.describe
    return results


def _write(results: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=2, default=str)  # lm-eval's configs hold a few callables


def main(argv=None) -> int:
    """Exit status: 2 for a command line refused as such, 1 when the work fails (pretrain_gpt.py's rule)."""
    args = build_parser().parse_args(argv)
    if args.offline:
        os.environ["HF_DATASETS_OFFLINE"] = os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        from lm_eval.utils import make_table  # noqa: PLC0415
    except ImportError as exc:
        print(f"error: {exc}; install lm-evaluation-harness: pip install 'megatron_ds[eval]'", file=sys.stderr)
        return 1
    from megatron_ds.families import weights_family  # noqa: PLC0415 - the training stack, after --help

    try:
        manager, tasks = find_tasks(args)
        session = open_session(args, weights_family(args.load, args.iteration, args.hf_model))
    except (ValueError, OSError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    try:
        results = run_harness(session, args, manager, tasks)
        if session.is_main and results is not None:
            print(make_table(results), flush=True)
            if results.get("groups"):  # a group's aggregate scores, as lm-eval's own command prints them
                print(make_table(results, "groups"), flush=True)
            _write(results, args.output)
            print(f"> wrote {args.output}")
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        close_session()
    return 0
