"""--dry-run's look at the files a run will use, so that what start-up would find wrong is found
before the queue: the data sets (both ``.bin`` and ``.idx`` of every prefix, their headers and sizes,
blend weights, splits left without documents), the --load directory (a warning when it holds no
checkpoint: the run would start from scratch; its tokenizer against this run's) and the --save
directory (writable, not created; room for one checkpoint is a warning only: it may change before
the job starts). The tokenizer files are read by the dry run itself (``pretrain.prepare``).
"""
from __future__ import annotations

import os

from megatron_ds.checkpoint.format import (META, TRACKER, UNIVERSAL_TRACKER, list_steps, read_meta, step_dir,
                                           tracked_iteration)
from megatron_ds.checkpoint.vocabulary import VocabSettings, saved_tokenizer, tokenizer_record
from megatron_ds.config.run import Run
from megatron_ds.data.gpt_dataset import check_train_valid_test_data
from megatron_ds.errors import ConfigError, DataError
from megatron_ds.training.data import samples_per_split
from megatron_ds.training.startup_checks import check_save_dir


def check_run_files(run: Run, warn=print) -> None:
    """Raise ConfigError / DataError for a file the run cannot use; ``warn`` lines for doubtful ones."""
    _check_data(run, warn)
    _check_load(run.checkpoint.load, warn)
    if run.checkpoint.save:
        check_save_dir(run.checkpoint, run.layout, dry_run_warn=warn)


def check_load_vocabulary(run: Run, tokenizer, family, log=print) -> None:
    """The tokenizer against the one the --load checkpoint was trained with, refused (a ConfigError) or
    noted (--allow-vocab-change) as loading will. The checkpoint is the tracked one (--ckpt-step's),
    read without verifying its files, which start-up does; a universal one is compared at start-up."""
    ckpt = run.checkpoint
    if not ckpt.load or ckpt.universal_checkpoint:
        return
    step = ckpt.ckpt_step
    if step is None:
        try:
            step = tracked_iteration(ckpt.load)
        except ConfigError:  # a damaged tracker: start-up falls back to the newest step, as here
            step = None
        step = step if step is not None else next(iter(list_steps(ckpt.load)), None)
    path = step_dir(ckpt.load, step) if step is not None else None
    if path is None or not os.path.isfile(os.path.join(path, META)):
        return
    meta = read_meta(path)
    vocab = VocabSettings(tokenizer_record(tokenizer, run.data.tokenizer_type, family.eod_token(tokenizer)),
                          ckpt.allow_vocab_change)
    vocab.check(saved_tokenizer(meta), path=path, padded=run.layout.padded_vocab_size, meta=meta, log=log)


def _check_data(run: Run, warn) -> None:
    data = run.data
    if data.mock_data:
        return
    if not (data.data_path or data.train_data_path):
        warn("WARNING: no --data-path: the data is not checked (the run needs --data-path, --train-data-path "
             "or --mock-data)")
        return
    try:
        check_train_valid_test_data(
            data_path=data.data_path, split=data.split,
            train_valid_test_num_samples=samples_per_split(run.layout, run.training),
            train_data_path=data.train_data_path, valid_data_path=data.valid_data_path,
            test_data_path=data.test_data_path, warn=warn)
    except (ValueError, OSError) as exc:  # the data package's messages are written for the user
        raise DataError(str(exc)) from None


def _check_load(load: str | None, warn) -> None:
    if not load:
        return
    if not os.path.isdir(load):
        warn(f"WARNING: --load {load} does not exist: the run will start from scratch")
    elif not os.path.isfile(os.path.join(load, TRACKER)) and not list_steps(load) \
            and not os.path.isfile(os.path.join(load, UNIVERSAL_TRACKER)):
        warn(f"WARNING: --load {load} holds no checkpoint (no {TRACKER}, no global_step*): the run will start "
             f"from scratch")
