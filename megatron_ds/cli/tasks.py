"""Fine-tune a BERT checkpoint on GLUE MNLI / QQP or RACE: Megatron-LM's tasks/main.py (glue/finetune.py,
race/finetune.py, finetune_utils.py) on DeepSpeed's engine, at any TP / PP / DP as pretraining.

    torchrun --nproc_per_node 4 tasks/main.py --task MNLI \\
        --train-data MNLI/train.tsv --valid-data MNLI/dev_matched.tsv MNLI/dev_mismatched.tsv \\
        --pretrained-checkpoint bert_ckpt --epochs 3 --save mnli_ckpt --vocab-file bert-vocab.txt \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \\
        --num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 512 \\
        --max-position-embeddings 512 --micro-batch-size 8 --global-batch-size 32 --lr 1e-5 \\
        --lr-warmup-fraction 0.065 --weight-decay 1e-2

Every pretraining flag is taken (the model's must be the pretrained checkpoint's); the task's are
Megatron's: --task, --epochs (0: evaluate only, e.g. a fine-tuned --load), --pretrained-checkpoint
(weights only, loaded when --load holds no checkpoint), --train-data and --valid-data (GLUE TSV
files; RACE folders of article files). --task WIKITEXT103 / LAMBADA run tools/evaluate.py's zero-shot
evaluation, as Megatron's tasks/main.py runs tasks/zeroshot_gpt. An epoch is the training set's whole global batches in the
order of a fresh permutation (Megatron's DistributedSampler, reseeded with --seed + epoch); the
iterations are epochs x batches per epoch; at the end of each epoch the model is saved (--save) and
evaluated on the --valid-data samples in whole global batches, printed as Megatron's
`` >> |epoch: E| overall: correct / total = C / T = P %``. Details: docs/tasks.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import torch

from megatron_ds.checkpoint.format import TRACKER
from megatron_ds.config.arguments import build_parser, parse_args_with
from megatron_ds.config.validation import missing_flags
from megatron_ds.data.glue import ClassificationDataset, read_mnli, read_qqp
from megatron_ds.data.race import read_race
from megatron_ds.errors import ConfigError, DataError, TrainingStopped
from megatron_ds.families.bert.bert_family import BERT
from megatron_ds.families.bert.bert_pretrained import check_pretrained, load_pretrained
from megatron_ds.families.bert.bert_tasks import ACCURACY, TASKS, Task, task_family
from megatron_ds.launch.parent_watch import watch_launcher
from megatron_ds.progress import print_rank0
from megatron_ds.training import device as devices
from megatron_ds.training.initialize import discover_world
from megatron_ds.training.log import print_last_rank
from megatron_ds.training.pretrain import dry_run, prepare, with_family_defaults

PROG = "tasks/main.py"
ZERO_SHOT_TASKS = ("WIKITEXT103", "LAMBADA")
TASK_DESTS = ("task", "epochs", "pretrained_checkpoint", "train_data", "valid_data")


def add_task_args(parser: argparse.ArgumentParser) -> tuple[str, ...]:
    """Megatron's tasks/main.py ``get_tasks_args`` (the fine-tuning ones), with its meanings."""
    g = parser.add_argument_group("tasks (Megatron's tasks/main.py)")
    g.add_argument("--task", choices=tuple(TASKS), default=None, help="the task to fine-tune (required)")
    g.add_argument("--epochs", type=int, default=None, help="fine-tuning epochs; 0 evaluates only (required)")
    g.add_argument("--pretrained-checkpoint", default=None,
                   help="pretrain_bert.py checkpoint whose weights start the run (when --load holds none)")
    g.add_argument("--train-data", nargs="+", default=None, help="training files (GLUE .tsv, RACE folders)")
    g.add_argument("--valid-data", nargs="*", default=None, help="validation files (GLUE .tsv, RACE folders)")
    return TASK_DESTS


class RaceDataset(list):
    """RACE's samples, already tokenized (``data.race.read_race``), as a map-style dataset."""


def read_task_data(task: Task, paths: list[str], tokenizer, seq_length: int):
    """The samples of ``paths`` for ``task``, all paths together."""
    if task.name == "RACE":
        return RaceDataset(s for path in paths for s in read_race(path, tokenizer, seq_length))
    reader = read_mnli if task.name == "MNLI" else read_qqp
    return ClassificationDataset(task.name, [s for path in paths for s in reader(path)], tokenizer, seq_length)


class EpochDataset(torch.utils.data.Dataset):
    """``epochs`` passes over ``per_epoch`` samples of ``dataset``, each in its own order: the
    permutation Megatron's DistributedSampler draws for epoch e (``torch.randperm`` seeded seed + e)."""

    def __init__(self, dataset, epochs: int, per_epoch: int, seed: int):
        self.dataset, self.epochs, self.per_epoch, self.seed = dataset, epochs, per_epoch, seed
        self._order = {}

    def __len__(self):
        return self.epochs * self.per_epoch

    def __getitem__(self, idx):
        epoch, i = divmod(int(idx), self.per_epoch)
        if epoch not in self._order:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._order = {epoch: torch.randperm(len(self.dataset), generator=generator).tolist()}
        return self.dataset[self._order[epoch][i]]


@dataclasses.dataclass
class Result:
    state: object  # the final training.loop.TrainState
    accuracies: list = dataclasses.field(default_factory=list)  # (epoch, accuracy) per validation pass


def epoch_reporter(per_epoch: int | None, total: int, result: Result):
    """The loop's ``after_validation``: Megatron's per-epoch accuracy line (eval_utils.py), once per
    iteration (the final validation repeats the last epoch's); ``per_epoch`` None: evaluating only, epoch -1."""
    def report(state, label, reported):
        if result.accuracies and result.accuracies[-1][2] == state.iteration:
            return
        accuracy = reported.get(ACCURACY)
        epoch = state.iteration // per_epoch - 1 if per_epoch else -1
        result.accuracies.append((epoch, accuracy, state.iteration))
        # from the last rank, after its validation line (Megatron's print_rank_last)
        print_last_rank(f" >> |epoch: {epoch}| overall: correct / total = {round(accuracy * total)} / {total} = "
                    f"{100 * accuracy:.4f} %")
    return report


def _sizes(task_args, flags, train, valid, global_batch: int) -> dict:
    """The run's iterations, evaluation and save intervals from the data and --epochs."""
    epochs = task_args.epochs
    per_epoch = len(train) // global_batch if epochs else 1
    eval_iters = len(valid) // global_batch
    if not per_epoch or not eval_iters:
        small = "--train-data" if not per_epoch else "--valid-data"
        raise DataError(f"{small} holds fewer samples ({len(train) if not per_epoch else len(valid)}) than one global "
                        f"batch ({global_batch})")
    training = dataclasses.replace(flags.training, train_iters=max(1, epochs * per_epoch), eval_interval=per_epoch,
                                   eval_iters=eval_iters, skip_train=not epochs)
    checkpoint = dataclasses.replace(flags.checkpoint, save_interval=per_epoch if flags.checkpoint.save else None)
    if not epochs:  # evaluating a --load: its weights only (its LR schedule was another run length's)
        checkpoint = dataclasses.replace(checkpoint, load_optim=False, load_rng=False)
    return {"flags": dataclasses.replace(flags, training=training, checkpoint=checkpoint),
            "per_epoch": per_epoch, "valid": eval_iters * global_batch}


def _pretrained_loader(task_args, flags):
    """Megatron loads --pretrained-checkpoint only when the run starts at iteration 0 (--load holds none)."""
    path, load = task_args.pretrained_checkpoint, flags.checkpoint.load
    if path is None or (load and os.path.isfile(os.path.join(load, TRACKER))):
        return None
    check_pretrained(path)
    return lambda module, run, ps: load_pretrained(path, module, run, ps, log=print_rank0)


def finetune(flags, ignored: list[str], task_args) -> Result:
    """Fine-tune (or evaluate) as the flags say, on the processes a launcher started."""
    from megatron_ds.training.trainer import train  # noqa: PLC0415 - DeepSpeed: not for --help

    start_time = time.time()
    flags = with_family_defaults(flags, BERT)  # --tokenizer-type BertWordPieceLowerCase, as pretrain_bert.py
    env = discover_world(use_mpi=flags.parallel.use_mpi, local_rank=flags.parallel.local_rank)
    watch_launcher(env.launcher)
    device = devices.select_device(env.local_rank, env.local_world_size)
    task, log = TASKS[task_args.task], (print_rank0 if env.rank == 0 else (lambda *a: None))
    pretrained = _pretrained_loader(task_args, flags)  # a GPT checkpoint is refused before the data is read
    common = dict(world_size=env.world_size, device_type=device.type, gpu_memory=devices.memory_bytes(device))
    once = dataclasses.replace(flags, training=dataclasses.replace(flags.training, train_iters=1))
    run, tokenizer = prepare(once, ignored, log=lambda *a: None, family=task_family(task, ()), **common)
    seq, batch = run.layout.model.seq_length, run.layout.global_batch_size
    train_set = read_task_data(task, task_args.train_data, tokenizer, seq) if task_args.epochs else ()
    valid_set = read_task_data(task, task_args.valid_data, tokenizer, seq)
    sizes = _sizes(task_args, flags, train_set, valid_set, batch)
    log(f"{task.name}: {len(train_set)} training samples ({sizes['per_epoch']} iterations per epoch, "
        f"{task_args.epochs} epochs), {sizes['valid']} of {len(valid_set)} validation samples (whole global batches)")
    datasets = (EpochDataset(train_set, task_args.epochs, sizes["per_epoch"] * batch, flags.training.seed)
                if task_args.epochs else None, torch.utils.data.Subset(valid_set, range(sizes["valid"])), None)
    family = task_family(task, datasets, pretrained)
    run, tokenizer = prepare(sizes["flags"], ignored, log=log, family=family, **common)
    result = Result(state=None)
    result.state = train(run, device, tokenizer, start_time, family,
                         after_validation=epoch_reporter(task_args.epochs and sizes["per_epoch"], sizes["valid"],
                                                         result))
    return result


def _task_errors(args) -> str | None:
    missing = [f for f, v in (("--task", args.task), ("--epochs", args.epochs), ("--valid-data", args.valid_data))
               if v is None or v == []]
    if missing:
        return f"missing required flags: {', '.join(missing)}"
    if args.epochs < 0:
        return f"--epochs must be 0 (evaluate only) or more (got {args.epochs})"
    if args.epochs and not args.train_data:
        return f"--epochs {args.epochs} needs --train-data"
    return None


def zero_shot_task(argv: list[str]) -> bool:
    """Megatron's tasks/main.py also runs the zero-shot GPT tasks: here tools/evaluate.py's (``cli/evaluate.py``)."""
    for i, arg in enumerate(argv):
        value = arg.split("=", 1)[1] if arg.startswith("--task=") else (
            argv[i + 1] if arg == "--task" and i + 1 < len(argv) else None)
        if value is not None:
            return value in ZERO_SHOT_TASKS
    return False


def main(argv=None) -> int:
    """Exit status as every entry point's: 2 for a refused command line, 1 for a run that cannot start
    or fails (one line), 0 otherwise."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if zero_shot_task(argv):
        from megatron_ds.cli.evaluate import main as evaluate  # noqa: PLC0415

        return evaluate(argv)
    def provider(parser):
        parser.description = "Fine-tune a BERT checkpoint on MNLI, QQP or RACE (Megatron-LM's tasks/main.py)."
        return add_task_args(parser)

    flags, ignored, task_args = parse_args_with(argv, PROG, provider)
    flags = with_family_defaults(flags, BERT)  # (finetune applies it too: for callers in-process)
    # --epochs sets the iterations; the data is the task's
    sized = dataclasses.replace(flags, training=dataclasses.replace(flags.training, train_iters=1))
    missing = missing_flags(sized, with_data=False)
    problem = _task_errors(task_args) or (f"missing required flags: {', '.join(missing)}" if missing else None)
    if problem:
        build_parser(PROG).error(problem)
    try:
        if flags.dry_run:  # the layout, memory and DeepSpeed JSON of the task model (iterations: the data's)
            return dry_run(sized, ignored, task_family(TASKS[task_args.task], ()))
        finetune(flags, ignored, task_args)
        return 0
    except (ConfigError, DataError, TrainingStopped) as exc:
        print(f"error: {str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__}",
              file=sys.stderr, flush=True)
        return 1
    finally:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

