"""The entry points' body (pretrain_gpt.py, pretrain_bert.py, ...: each gives its registered model
family, ``megatron_ds.families``): parse -> resolve (one ``Run``) -> join the job -> train (``trainer``).

``--dry-run`` stops after the resolution and prints the ``Run``, the model built on the meta device
next to the memory estimate (``meta_build``); nothing distributed starts.
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time

import torch

from megatron_ds.accelerator import on_cuda
from megatron_ds.checkpoint.checkpointing import pretrained_start, saved_flags
from megatron_ds.config import Config, Run, memory, parse_args, resolve
from megatron_ds.config.arguments import build_parser, describe_ignored
from megatron_ds.config.deepspeed_json import validate_with_deepspeed
from megatron_ds.config import moe_selection
from megatron_ds.config.dialect import dialect
from megatron_ds.config.family import ModelFamily
from megatron_ds.config.fp8_flags import describe_fp8, fp8_format
from megatron_ds.config.megatron_overrides import apply_checkpoint_args
from megatron_ds.config.moe_params import is_moe
from megatron_ds.config.validation import missing_flags
from megatron_ds.data.tokenizer import build_tokenizer_for
from megatron_ds.ds_compat import check_deepspeed
from megatron_ds.errors import ConfigError, DataError, Interrupted, TrainingStopped
from megatron_ds.launch.parent_watch import watch_launcher
from megatron_ds.progress import print_rank0
from megatron_ds.training import device as devices
from megatron_ds.training.file_checks import check_load_vocabulary, check_run_files
from megatron_ds.training.initialize import discover_world
from megatron_ds.training.log import configure_logging
from megatron_ds.training.loop import TrainState
from megatron_ds.training.signals import exit_at_next_interrupt


def prepare(flags: Config, ignored: list[str], *, world_size: int, device_type: str, log,
            family: ModelFamily, gpu_memory: float | None = None) -> tuple[Run, object]:
    """The one resolution, for --dry-run and training alike: the tokenizer (its vocabulary sizes the
    model), the ``Run`` of ``family``'s model, and the checks only DeepSpeed can make (its version,
    its JSON parser). ``gpu_memory``: the training GPU's bytes (``resolve``'s)."""
    flags = dataclasses.replace(flags, checkpoint=pretrained_start(flags.checkpoint, log=log))
    saved = saved_flags(flags.checkpoint, log=log)  # --use-checkpoint-args
    # its tokenizer type may be the checkpoint's too (resolve takes the rest, with a note per value)
    flags_used = apply_checkpoint_args(flags, saved)[0]
    tokenizer = build_tokenizer_for(flags_used.data, log=log, vocab_extra_ids=flags_used.masked_lm.vocab_extra_ids)
    run = resolve(flags, world_size=world_size, vocab_size=tokenizer.vocab_size, device_type=device_type,
                  ignored=ignored, saved_flags=saved, family=family, gpu_memory=gpu_memory)
    check_deepspeed(interleaved=run.layout.own_schedule)  # once, before DeepSpeed is first used
    validate_with_deepspeed(run.layout.ds_config, run.deepspeed_source)
    return run, tokenizer


def dry_run(flags: Config, ignored: list[str], family: ModelFamily) -> int:
    """Validate and print the resolved run without starting anything distributed."""
    world = flags.world_size or int(os.environ.get("WORLD_SIZE", "1"))
    on = "cuda" if on_cuda() or flags.training.fp16 else "cpu"
    run, tokenizer = prepare(flags, ignored, world_size=world, device_type=on, log=lambda *a: None, family=family)
    check_run_files(run)  # data, --load, --save: found now rather than at start-up after the queue
    check_load_vocabulary(run, tokenizer, family)
    print(run.describe())
    read_as = dialect(flags)
    print("flags read as {}'s: {}".format(*read_as))
    moe = moe_selection.resolve(flags.model, flags.parallel, **moe_selection.line_context(flags))[2]
    if moe:
        print(moe)
    for note in run.notes:
        print(f"WARNING: {note}")
    print(f"micro-batches per step per data parallel rank: {run.layout.grad_accum_steps}")
    # The model code (and DeepSpeed) only here: --help and flag errors stay fast.
    from megatron_ds.config.layout import compiles_layers  # noqa: PLC0415
    from megatron_ds.model.liger import describe_liger  # noqa: PLC0415
    from megatron_ds.training.engine import describe_run_kernels  # noqa: PLC0415
    from megatron_ds.training.meta_build import report  # noqa: PLC0415
    from megatron_ds.training.optimizer import describe_cuda_optimizer  # noqa: PLC0415

    report(run, family.eod_token(tokenizer))
    # what a CUDA run of this configuration would run, known before the queue, even where this host has no GPU
    lay = run.layout
    on_gpu = dataclasses.replace(run, layout=dataclasses.replace(lay, model=dataclasses.replace(
        lay.model, compile_layers=compiles_layers(flags.model.compile_layers, "cuda", lay.zbh1))))
    print("kernels on CUDA: " + describe_run_kernels(on_gpu, describe_cuda_optimizer(run.optimizer), on_cuda=True,
                                                    skip=("output layer + loss",)))
    print(f"output layer + loss on CUDA: {describe_liger(lay.model, lay.tp, run.fused_loss_reason, on_cuda=True)}")
    print(describe_fp8(lay.fp8, lay.model, moe=is_moe(lay.model)))
    check_layout_memory(run.layout, flags.gpu_memory_gb)
    if run.ignored_flags:
        print(f"ignored flags (no effect here): {describe_ignored(run.ignored_flags)}")
    print("DeepSpeed config:")
    print(json.dumps(run.layout.ds_config, indent=2, sort_keys=True))
    return 0


def check_layout_memory(layout, gpu_memory_gb: str | None) -> None:
    """Print the per-GPU memory estimate; over --gpu-memory-gb it is a ConfigError, so a
    layout that cannot fit fails at submission instead of after the queue."""
    estimate = memory.estimate_memory(layout)
    budget = memory.gpu_memory_bytes(gpu_memory_gb)
    if layout.pp > 1:
        print(memory.describe_stages(layout))
    print(estimate.describe(budget))
    memory.check_memory(layout, estimate, budget)


def pretrain(flags: Config, ignored: list[str], family: ModelFamily) -> TrainState:
    """Train ``family``'s model as the flags say, on the processes a launcher started; returns the final state."""
    # DeepSpeed and the model are imported here, not at module level: --help and flag errors stay fast.
    from megatron_ds.training.trainer import train  # noqa: PLC0415

    start_time = time.time()
    configure_logging(flags.logging.logging_level)  # --logging-level, before the first record
    env = discover_world(use_mpi=flags.parallel.use_mpi, local_rank=flags.parallel.local_rank)
    watch_launcher(env.launcher)  # a worker whose launcher was killed stops instead of training on
    device = devices.select_device(env.local_rank, env.local_world_size)
    # before the resolution, which needs the device: whether FP8 is asked for at all (its recipe comes later)
    devices.check_fp8_device(fp8_format(flags.model) is not None, device)
    run, tokenizer = prepare(flags, ignored, world_size=env.world_size, device_type=device.type,
                             log=print_rank0 if env.rank == 0 else (lambda *a: None), family=family,
                             gpu_memory=devices.memory_bytes(device))
    return train(run, device, tokenizer, start_time, family)


def with_family_defaults(flags: Config, family: ModelFamily) -> Config:
    """--tokenizer-type defaults to the family's (Megatron-DeepSpeed's args_defaults of its pretrain
    script) where the command line names none and the run reads a tokenizer."""
    data = flags.data
    if family.default_tokenizer_type is None or data.tokenizer_type is not None or (data.mock_data and
                                                                                    not data.vocab_file):
        return flags
    return dataclasses.replace(flags, data=dataclasses.replace(data, tokenizer_type=family.default_tokenizer_type))


def _one_line(exc: Exception) -> str:
    """A DataLoader worker's error arrives wrapped in its traceback text; keep the message."""
    text = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
    prefix = f"{type(exc).__module__}.{type(exc).__name__}: "
    return text[len(prefix):] if text.startswith(prefix) else text


def main(argv=None, *, family: ModelFamily) -> int:
    """Exit status: 2 when the command line is refused as such (argparse's status: unknown or missing
    flags, malformed values), 1 when it parsed but the run cannot start or fails, 130 after Ctrl-C (saved
    first when it came during training: ``signals.StopSignals``), 0 otherwise; the same rule as every CLI
    in tools/. ``family``: the entry point's model (``families.get_family``)."""
    prog = f"pretrain_{family.name}.py"  # what the error lines name
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--plan" in argv:  # --dry-run --plan: the planner over these flags (planner/plan_cli.py)
        from megatron_ds.planner.plan_cli import main as plan_main  # noqa: PLC0415

        return plan_main(argv, family=family, prog=prog)
    flags, ignored = parse_args(argv, prog)
    flags = with_family_defaults(flags, family)
    missing = missing_flags(flags, with_data=not flags.dry_run)
    if missing:  # all of them at once, as argparse lists its required arguments
        build_parser(prog).error(f"missing required flags: {', '.join(missing)}")
    try:
        if flags.dry_run:
            return dry_run(flags, ignored, family)
        pretrain(flags, ignored, family)
        return 0
    except (ConfigError, DataError, TrainingStopped) as exc:
        print(f"error: {_one_line(exc)}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt as exc:  # Ctrl-C: 128 + SIGINT, as a shell reports it, and no traceback
        exit_at_next_interrupt()  # the tear-down below must not turn a second one into a traceback
        if not isinstance(exc, Interrupted):  # (an Interrupted stop said so and saved already)
            print("interrupted (SIGINT): stopping now, without saving", file=sys.stderr, flush=True)
        return 128 + signal.SIGINT
    finally:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
