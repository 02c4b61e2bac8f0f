"""Data for the training loop: datasets, resumable loaders, micro-batches (the tokenizer is
``megatron_ds.data.tokenizer.build_tokenizer_for``).

Micro-batches have the shape DeepSpeed's pipeline engine expects, ``(inputs, labels)`` with
``inputs = (tokens, position_ids)`` for the first stage and ``labels = (labels, loss_mask)`` for
the loss on the last stage.
"""
from __future__ import annotations

import numpy as np
import torch

from megatron_ds.config.schema import DataConfig
from megatron_ds.data.batch import gpt_batch_from_samples
from megatron_ds.data.samplers import CyclicSampler, PretrainingSampler
from megatron_ds.errors import ConfigError, DataError
from megatron_ds.training.device import pin_memory
from megatron_ds.training.signals import end_loader_workers_at_exit, ignore_stop_signals, interrupt_deferred


class MockGPTDataset(torch.utils.data.Dataset):
    """Random tokens, a fixed function of (seed, index): identical on every rank and every run."""

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int):
        self.num_samples, self.seq_length, self.vocab_size, self.seed = num_samples, seq_length, vocab_size, seed

    def __len__(self):
        return self.num_samples

    def __getitem__(self, idx):
        rng = np.random.default_rng((self.seed, int(idx)))
        return {"text": rng.integers(0, self.vocab_size, self.seq_length + 1, dtype=np.int64)}


def build_datasets(data: DataConfig, *, num_samples: tuple[int, int, int], seq_length: int, seed: int,
                   vocab_size: int, log=print):
    if data.mock_data:
        return tuple(MockGPTDataset(n, seq_length, vocab_size, seed + i) if n else None
                     for i, n in enumerate(num_samples))
    if not (data.data_path or data.train_data_path):
        raise ConfigError("--data-path (or --train-data-path) is required; or pass --mock-data for synthetic data")
    from megatron_ds.data import build_train_valid_test_datasets  # noqa: PLC0415

    try:
        return build_train_valid_test_datasets(
            data_path=data.data_path, split=data.split, train_valid_test_num_samples=num_samples,
            seq_length=seq_length, seed=seed, train_data_path=data.train_data_path,
            valid_data_path=data.valid_data_path, test_data_path=data.test_data_path,
            data_cache_path=data.data_cache_path, log=log, train_num_epochs=data.train_data_exact_num_epochs)
    except (ValueError, OSError) as exc:
        # the data package reports bad paths, splits, blends and corrupt files with these types and
        # a message written for the user; a traceback would bury it
        raise DataError(str(exc)) from None


def check_train_length(dataset, data: DataConfig, needed: int) -> None:
    """--train-data-exact-num-epochs can give fewer samples than the run trains on; without a loader that
    starts again (--repeated-dataloader, --dataloader-type cyclic) it would run dry mid-run."""
    if dataset is None or len(dataset) >= needed or data.repeated_dataloader or data.dataloader_type == "cyclic":
        return
    raise DataError(f"--train-data-exact-num-epochs {data.train_data_exact_num_epochs} gives {len(dataset)} training "
                    f"samples but the run trains on {needed}; add --repeated-dataloader or train fewer iterations")


class BatchCollator:
    """Stacks samples into a micro-batch; checks token ids against the vocabulary first."""

    def __init__(self, data: DataConfig, eod: int, vocab_size: int, source: str):
        self.data, self.eod, self.vocab_size, self.source = data, eod, vocab_size, source

    def __call__(self, samples):
        text = np.stack([s["text"] for s in samples])
        low, high = text.min(initial=0), text.max(initial=0)
        if high >= self.vocab_size or low < 0:
            value = high if high >= self.vocab_size else low
            raise DataError(f"token id {value} is outside the model's vocabulary (size {self.vocab_size}) in "
                            f"data set {self.source}: was it preprocessed with another tokenizer?")
        # No attention mask: with --reset-attention-mask the model derives document ids from the
        # EOD tokens itself (a [b, s] tensor instead of a [b, 1, s, s] mask).
        b = gpt_batch_from_samples(text, self.eod, self.data.reset_position_ids, eod_mask_loss=self.data.eod_mask_loss,
                                   with_attention_mask=False)
        return (b.tokens, b.position_ids), (b.labels, b.loss_mask)


def build_loader(dataset, data: DataConfig, collator: BatchCollator, *, consumed_samples: int,
                 micro_batch_size: int, dp_rank: int, dp_size: int):
    """A DataLoader over this data parallel rank's micro-batches, starting after consumed_samples."""
    # --dataloader-type: Megatron's sequential sampler, or its cyclic one (a permutation per epoch)
    kind = CyclicSampler if data.dataloader_type == "cyclic" else PretrainingSampler
    sampler = kind(total_samples=len(dataset), consumed_samples=consumed_samples, micro_batch_size=micro_batch_size,
                   data_parallel_rank=dp_rank, data_parallel_size=dp_size)
    # A private generator: creating an iterator would otherwise draw its worker seed from the
    # global torch RNG, which drives dropout, and a resumed run would draw at a different time.
    generator = torch.Generator().manual_seed(consumed_samples)
    if data.num_workers > 0:
        end_loader_workers_at_exit()  # they ignore SIGTERM, which multiprocessing's exit would wait on
    return _Loader(dataset, batch_sampler=sampler, num_workers=data.num_workers, collate_fn=collator,
                   pin_memory=pin_memory(), persistent_workers=data.num_workers > 0, generator=generator,
                   worker_init_fn=ignore_stop_signals)  # the trainer saves, then stops them


class _Loader(torch.utils.data.DataLoader):
    """A DataLoader whose worker processes start with a Ctrl-C held back until they are forked
    (``signals.interrupt_deferred``): one arriving during the fork would otherwise be lost."""

    def __iter__(self):
        with interrupt_deferred():
            return super().__iter__()


def stage_iterator(dataset, make_loader, consumed: int, *, reads_data: bool, repeat: bool = False,
                   endless: bool = False):
    """What this rank hands the engine for one split: None when the split does not exist (so no
    rank runs it); an empty iterator on middle pipeline stages, which read no data but must still
    join every train/eval schedule; else micro-batches from `make_loader(consumed_samples)`.
    Validation and test repeat from their first sample once exhausted (evaluations may outnumber
    the samples reserved for them, e.g. after a resume with other intervals); training never wraps.
    ``endless``: iterate one loader again and again, as Megatron-DeepSpeed's ``cyclic_iter``
    (--dataloader-type cyclic: its sampler goes on to the next epoch) and DeepSpeed's ``RepeatingLoader``
    (--repeated-dataloader: the sequential sampler starts again where the loader started)."""
    if dataset is None:
        return None
    if not reads_data:
        return iter(())
    if endless:  # validation and test start inside their samples, as when they wrap
        return _endless(make_loader(consumed % len(dataset) if repeat else consumed))
    if not repeat:
        return iter(make_loader(consumed))

    def forever():
        yield from make_loader(consumed % len(dataset))
        while True:
            yield from make_loader(0)
    return forever()


def _endless(loader):
    while True:
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:  # a pass with no micro-batch would loop forever
            raise DataError("the data loader yields no micro-batch: too few samples for one per data parallel rank")


def describe_source(data: DataConfig) -> str:
    if data.mock_data:
        return "--mock-data"
    paths = data.train_data_path or data.data_path or []
    return " ".join(paths)


def samples_per_split(layout, training) -> tuple[int, int, int]:
    """Samples a run asks of (train, valid, test), as Megatron's build_train_valid_test_data_iterators:
    every iteration's global batch; --eval-iters global batches per evaluation, one every
    --eval-interval plus the final one; --eval-iters global batches of the test set."""
    train_samples = layout.train_iters * layout.global_batch_size
    evals = (layout.train_iters // training.eval_interval + 1) * training.eval_iters if training.eval_interval else 0
    return (train_samples, evals * layout.global_batch_size, training.eval_iters * layout.global_batch_size)
