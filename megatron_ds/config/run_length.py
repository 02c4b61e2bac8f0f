"""How long a run lasts and how its batch size and learning rate progress, as pure functions.

Megatron-DeepSpeed semantics, transcribed from its sources:

* Batch-size ramp-up (``--rampup-batch-size START INCREMENT SAMPLES``, megatron/microbatches.py
  ``RampupBatchsizeNumMicroBatches``): over ``(GLOBAL - START) / INCREMENT`` equal intervals of
  ``SAMPLES / intervals`` samples the global batch grows from START by INCREMENT; after SAMPLES consumed
  samples it is ``--global-batch-size``. Only sample-based runs may ramp (megatron/arguments.py:
  "expected no batch-size rampup for iteration-based training").
* The number of iterations of a ramped ``--train-samples`` run is megatron/training.py
  ``update_train_iters``: iterate the ramp until more than SAMPLES samples are consumed, then whole
  global batches of what is left (a partial last batch is dropped).
* Megatron-LM's step-wise batch size (``--step-batch-size-schedule "0:768 250B:1536"``, megatron/core/
  num_microbatches_calculator.py ``StepBatchsizeNumMicroBatchesCalculator``, core_v0.19.0): thresholds in
  tokens (divided by --seq-length into samples, suffixes K M B T), sorted, the first 0, strictly increasing;
  the batch size is that of the last threshold at or below the consumed samples. A ``--train-samples`` run
  takes ``while consumed < train_samples`` steps of the scheduled sizes (megatron/training/training.py
  ``update_train_iters``); an iteration-based run keeps its --train-iters. It cannot be given with
  --global-batch-size (megatron/training/arguments.py validate_args), whose place its last size takes.
* Token-based training (``--train-tokens``): the loop runs ``while iteration < train_iters and
  consumed_train_tokens < train_tokens`` (megatron/training.py ``train``); ``--train-samples`` /
  ``--train-iters`` stay a cap. Tokens consumed per iteration are ``global batch x seq_length``.
* The learning rate is scheduled in samples (megatron/training.py ``get_optimizer_param_scheduler``:
  iteration spans are multiplied by the global batch size) unless ``--lr-warmup-tokens`` /
  ``--lr-decay-tokens`` switch warmup / decay to consumed tokens
  (megatron/optimizer_param_scheduler.py ``get_lr``).
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_ds.config.validation import require
from megatron_ds.errors import ConfigError


@dataclass(frozen=True)
class Rampup:
    start: int
    increment: int
    samples: int
    final: int  # --global-batch-size

    @property
    def samples_per_increment(self) -> float:
        return self.samples / ((self.final - self.start) // self.increment)

    def global_batch_at(self, consumed_samples: int) -> int:
        """RampupBatchsizeNumMicroBatches.update(consumed_samples)."""
        if consumed_samples > self.samples:
            return self.final
        steps = int(consumed_samples / self.samples_per_increment)
        return self.start + steps * self.increment


@dataclass(frozen=True)
class StepSchedule:
    """--step-batch-size-schedule: ((threshold in samples, global batch), ...), thresholds increasing from 0."""
    steps: tuple[tuple[int, int], ...]

    @property
    def final(self) -> int:
        return self.steps[-1][1]

    def global_batch_at(self, consumed_samples: int) -> int:
        """StepBatchsizeNumMicroBatchesCalculator._get_batch_size_for_samples."""
        return next(batch for threshold, batch in reversed(self.steps) if consumed_samples >= threshold)

    def describe(self, seq_length: int) -> str:
        return "batch size by step: " + ", ".join(f"{batch} from {threshold * seq_length:,} tokens"
                                                  for threshold, batch in self.steps)


_SUFFIXES = {"K": 10 ** 3, "M": 10 ** 6, "B": 10 ** 9, "T": 10 ** 12}


def _schedule_number(text: str) -> int:
    """StepBatchsizeNumMicroBatchesCalculator._parse_numeric_value: "2.4B" -> 2_400_000_000."""
    text = text.strip().upper()
    scale = _SUFFIXES.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def parse_step_schedule(words: list | None, seq_length: int, micro_dp: int) -> StepSchedule | None:
    """--step-batch-size-schedule's words (one quoted string or several) as upstream parses them, plus what
    would fail mid-run there: every batch size must split into micro-batches over the data parallel ranks."""
    if not words:
        return None
    text = " ".join(words)
    steps = []
    for entry in text.replace(",", " ").split():
        threshold, sep, batch = entry.strip("'\"").partition(":")
        try:
            if not sep:
                raise ValueError
            steps.append((_schedule_number(threshold) // seq_length, _schedule_number(batch)))
        except ValueError:
            raise ConfigError(f"--step-batch-size-schedule {text!r}: {entry!r} is not THRESHOLD:BATCH_SIZE "
                              f"(e.g. \"0:768 250B:1536\")") from None
    steps.sort()
    if steps[0][0] != 0 or any(a[0] >= b[0] for a, b in zip(steps, steps[1:])):
        raise ConfigError(f"--step-batch-size-schedule {text!r}: thresholds must start at 0 and increase strictly "
                          f"(in samples of --seq-length {seq_length} tokens)")
    bad = [batch for _, batch in steps if batch <= 0 or batch % micro_dp]
    if bad:
        raise ConfigError(f"--step-batch-size-schedule: batch sizes {', '.join(map(str, bad))} are not positive "
                          f"multiples of --micro-batch-size x DP = {micro_dp}")
    return StepSchedule(tuple(steps))


@dataclass(frozen=True)
class RunSchedule:
    """Ramp-up, the token target and the LR schedule's spans (in samples / tokens)."""
    seq_length: int
    global_batch_size: int  # after any ramp-up
    rampup: Rampup | StepSchedule | None  # the global batch changing with consumed samples
    train_tokens: int | None
    lr_warmup_samples: float
    lr_decay_samples: int
    lr_warmup_tokens: int | None
    lr_decay_tokens: int | None
    # the weight-decay increment's span (get_optimizer_param_scheduler's wd_incr_steps): training's length
    wd_incr_samples: int
    # --lr-decay-style WSD's decay phase (get_optimizer_param_scheduler's wsd_decay_steps); None otherwise.
    # A --train-samples run's counts samples, so its schedule counts them too (exactly upstream's, whole
    # global batches or not); an iteration-based run's is a whole number of global batches.
    lr_wsd_decay_samples: int | None = None
    wsd_in_samples: bool = False

    @property
    def counts_tokens(self) -> bool:
        """Token-based run: the iteration line shows consumed tokens (Megatron-DeepSpeed's field)."""
        return self.train_tokens is not None or self.lr_decay_tokens is not None \
            or self.lr_warmup_tokens is not None

    @property
    def needs_sample_lr(self) -> bool:
        """The LR schedule must count samples/tokens rather than iterations (ramp-up or token spans)."""
        return self.rampup is not None or self.lr_decay_tokens is not None or self.lr_warmup_tokens is not None \
            or self.wsd_in_samples

    def global_batch_at(self, consumed_samples: int) -> int:
        return self.rampup.global_batch_at(consumed_samples) if self.rampup else self.global_batch_size

    def train_iters_for_samples(self, train_samples: int) -> int:
        """megatron/training.py update_train_iters."""
        if self.rampup is None:
            return train_samples // self.global_batch_size
        iterations = consumed = 0
        if isinstance(self.rampup, StepSchedule):  # Megatron-LM's loop: every step of the schedule's sizes
            while consumed < train_samples:
                consumed += self.rampup.global_batch_at(consumed)
                iterations += 1
            return iterations
        while consumed <= self.rampup.samples:
            consumed += self.rampup.global_batch_at(consumed)
            iterations += 1
        return iterations + (train_samples - consumed) // self.global_batch_size


def parse_rampup(values: list | None, global_batch: int, micro_dp: int) -> Rampup | None:
    """Validate --rampup-batch-size as Megatron does, plus what would fail mid-run there: every batch
    size of the ramp must split into micro-batches over the data parallel ranks."""
    if values is None:
        return None
    if len(values) != 3:
        raise ConfigError(f"--rampup-batch-size takes 3 values: START INCREMENT SAMPLES (got {' '.join(values)})")
    try:
        start, increment, samples = (int(v) for v in values)
    except ValueError:
        raise ConfigError(f"--rampup-batch-size values must be integers (got {' '.join(values)})") from None
    if start <= 0 or increment <= 0 or samples < 0:
        raise ConfigError(f"--rampup-batch-size {start} {increment} {samples}: START and INCREMENT must be "
                          f"positive and SAMPLES non-negative")
    if start > global_batch or (global_batch - start) % increment:
        raise ConfigError(f"--rampup-batch-size: --global-batch-size {global_batch} minus START {start} must be "
                          f"a non-negative multiple of INCREMENT {increment}")
    if start == global_batch:
        return None  # nothing to ramp: Megatron would divide by zero intervals
    if start % micro_dp or increment % micro_dp:
        raise ConfigError(f"--rampup-batch-size: START {start} and INCREMENT {increment} must be multiples of "
                          f"--micro-batch-size x DP = {micro_dp} (every batch size of the ramp is split into "
                          f"micro-batches over the data parallel ranks)")
    return Rampup(start, increment, samples, global_batch)


def build_run_schedule(t, o, *, seq_length: int, global_batch: int, micro_dp: int) -> RunSchedule:
    """The RunSchedule of TrainingConfig ``t`` and OptimizerConfig ``o`` (spans as in Megatron's
    get_optimizer_param_scheduler: iteration counts times the global batch size)."""
    steps = parse_step_schedule(t.step_batch_size_schedule, seq_length, micro_dp)
    if steps is not None and t.rampup_batch_size:
        raise ConfigError("--step-batch-size-schedule and --rampup-batch-size both set the batch size; choose one")
    rampup = steps or parse_rampup(t.rampup_batch_size, global_batch, micro_dp)
    if isinstance(rampup, Rampup) and t.train_samples is None:
        raise ConfigError("--rampup-batch-size needs --train-samples (Megatron: no batch-size ramp-up for "
                          "iteration-based training)")
    for flag, value, least in (("--train-tokens", t.train_tokens, 1), ("--lr-warmup-tokens", o.lr_warmup_tokens, 0),
                               ("--lr-decay-tokens", o.lr_decay_tokens, 1)):
        if value is not None and value < least:
            raise ConfigError(f"{flag} must be {'positive' if least else 'non-negative'} (got {value})")
    if t.train_samples is not None:
        decay = o.lr_decay_samples or t.train_samples
        warmup = o.lr_warmup_fraction * decay if o.lr_warmup_fraction is not None else o.lr_warmup_samples
    else:
        decay = (o.lr_decay_iters or t.train_iters or 0) * global_batch
        warmup = o.lr_warmup_fraction * decay if o.lr_warmup_fraction is not None \
            else o.lr_warmup_iters * global_batch
    return RunSchedule(seq_length=seq_length, global_batch_size=global_batch, rampup=rampup,
                       train_tokens=t.train_tokens, lr_warmup_samples=warmup, lr_decay_samples=decay,
                       lr_warmup_tokens=o.lr_warmup_tokens, lr_decay_tokens=o.lr_decay_tokens,
                       wd_incr_samples=t.train_samples if t.train_samples is not None
                       else (t.train_iters or 0) * global_batch,
                       lr_wsd_decay_samples=_wsd_decay_samples(t, o, global_batch),
                       wsd_in_samples=o.lr_decay_style == "WSD" and t.train_samples is not None)


def _wsd_decay_samples(t, o, global_batch: int) -> int | None:
    """megatron/training/training.py get_optimizer_param_scheduler (Megatron-LM): --lr-wsd-decay-iters x the
    global batch in an iteration-based run, --lr-wsd-decay-samples in a --train-samples run. Upstream reads
    only the one of its kind and asserts the span is set (OptimizerParamScheduler.__init__); said here in one
    line. Without WSD both flags are ignored, as upstream."""
    if o.lr_decay_style != "WSD":
        return None
    if o.lr_warmup_tokens is not None or o.lr_decay_tokens is not None:
        raise ConfigError("--lr-decay-style WSD counts samples (Megatron-LM); it cannot be combined with "
                          "--lr-warmup-tokens / --lr-decay-tokens (Megatron-DeepSpeed's)")
    by_samples = t.train_samples is not None
    given, other = ("--lr-wsd-decay-samples", "--lr-wsd-decay-iters") if by_samples \
        else ("--lr-wsd-decay-iters", "--lr-wsd-decay-samples")
    span, stray = (o.lr_wsd_decay_samples, o.lr_wsd_decay_iters) if by_samples \
        else (o.lr_wsd_decay_iters, o.lr_wsd_decay_samples)
    kind = "a --train-samples" if by_samples else "an iteration-based"
    if stray is not None:
        raise ConfigError(f"{other} is not read in {kind} run (Megatron-LM); give {given}")
    if span is None:
        raise ConfigError(f"--lr-decay-style WSD needs {given} in {kind} run: the length of its final decay")
    return span if by_samples else span * global_batch


@dataclass(frozen=True)
class Iterations:
    train: int  # optimizer steps the run takes (at most, with --train-tokens)
    lr_decay: int  # the iteration-counted LR schedule's spans
    lr_warmup: int
    schedule: RunSchedule


def resolve_iterations(t, o, *, seq_length: int, global_batch: int, micro_dp: int,
                       interleaved: bool, zbh1: bool = False) -> Iterations:
    """Iterations to train and the LR schedule's spans from TrainingConfig ``t`` and OptimizerConfig
    ``o``: from --train-iters, or --train-samples in whole global batches (megatron/arguments.py)."""
    if t.train_iters is not None and t.train_samples is not None:
        raise ConfigError("--train-iters and --train-samples are both set; choose one")
    if t.train_samples is not None:
        train_iters = t.train_samples // global_batch
        decay = (o.lr_decay_samples or t.train_samples) // global_batch
        warmup_abs = o.lr_warmup_samples // global_batch
    else:
        train_iters = t.train_iters if t.train_iters is not None else (0 if t.skip_train else None)
        train_iters = require(train_iters, "--train-iters (or --train-samples)")
        decay = o.lr_decay_iters or train_iters
        warmup_abs = o.lr_warmup_iters
    if o.lr_warmup_fraction is not None and warmup_abs:
        raise ConfigError("--lr-warmup-fraction and --lr-warmup-iters/--lr-warmup-samples are both set; "
                          "choose one")
    warmup = int(o.lr_warmup_fraction * decay) if o.lr_warmup_fraction is not None else warmup_abs
    run = build_run_schedule(t, o, seq_length=seq_length, global_batch=global_batch, micro_dp=micro_dp)
    if run.rampup is not None:
        what = "--rampup-batch-size" if isinstance(run.rampup, Rampup) else "--step-batch-size-schedule"
        if interleaved:
            # The interleaved schedule needs micro-batches per step to be a multiple of PP at every
            # step (Megatron asserts the same); a ramp changes that count from step to step.
            raise ConfigError(f"{what} cannot be combined with the interleaved pipeline schedule "
                              f"(--num-layers-per-virtual-pipeline-stage); drop one of them")
        if zbh1:  # the executor's step list is built once, for one count of micro-batches
            raise ConfigError(f"{what} cannot be combined with --enable-zbh1-pipeline; drop one of them")
        if t.train_samples is not None:
            train_iters = run.train_iters_for_samples(t.train_samples)
    return Iterations(train=train_iters, lr_decay=decay, lr_warmup=warmup, schedule=run)
