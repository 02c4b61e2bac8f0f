"""The train / evaluate loop around a DeepSpeed engine (pipeline or plain).

``Loop`` holds what every iteration needs (the ``Run``, the engine, the loss, the writers, the
save function); ``Loop.train`` runs iterations until the run's end, a stop signal, the time limit
or --exit-interval, printing Megatron's iteration line every --log-interval iterations.
"""
from __future__ import annotations

import contextlib
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from megatron_ds import ds_compat
from megatron_ds.accelerator import cuda_runtime
from megatron_ds.checkpoint.health import NonFiniteState
from megatron_ds.config.moe_selection import is_mlm_moe
from megatron_ds.config.run import Run
from megatron_ds.errors import TrainingStopped
from megatron_ds.model.loss_report import EVAL, LossReport
from megatron_ds.model.mlm_moe import update_expert_bias
from megatron_ds.parallel.fp8_delayed import update_delayed_scaling
from megatron_ds.progress import print_rank0
from megatron_ds.training import log as mlog
from megatron_ds.training.lr_schedule import ConsumedLRSchedule
from megatron_ds.training.manual_gc import ManualGC
from megatron_ds.training.profiler import StepProfiler
from megatron_ds.training.progress_log import ProgressLog
from megatron_ds.training.seqlen_warmup import SeqlenWarmup
from megatron_ds.training.signals import StopSignals, agreed_stop
from megatron_ds.training.straggler import StragglerDetector


@dataclass
class TrainState:
    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_train_tokens: int = 0
    consumed_valid_samples: int = 0
    nan_iterations: int = 0
    consecutive_nans: int = 0
    # model FLOPs of every iteration trained so far, across resumes (upstream's num_floating_point_operations_so_far)
    floating_point_operations_so_far: float = 0.0
    last_loss: float | None = None  # the loss of the latest iteration (NaN/inf too), saved with a checkpoint
    last_checkpoint: str | None = None  # the checkpoint this run loaded or saved last
    finite_since_checkpoint: bool = False  # a finite loss came after last_checkpoint (its weights gave one)
    exited_early: bool = False  # stopped by --exit-interval / --exit-duration-in-mins / a signal
    stop_reason: str | None = None
    history: list = field(default_factory=list)  # (iteration, loss) of finite losses: tests read it


class TrainPlan:
    """The loop's per-iteration bookkeeping for ramp-up and token targets."""

    def __init__(self, layout):
        self.schedule, self.train_iters, self.curriculum = layout.schedule, layout.train_iters, layout.curriculum
        self.cp = layout.cp
        self.seqlen = layout.model.seq_length  # tokens per sample of the coming step

    def keep_going(self, state) -> bool:
        """megatron/training.py: while iteration < train_iters and consumed_train_tokens < train_tokens."""
        if state.iteration >= self.train_iters:
            return False
        return self.schedule.train_tokens is None or state.consumed_train_tokens < self.schedule.train_tokens

    def begin(self, engine, state) -> int:
        """Set the engine's global batch for the next step (ramp-up, as Megatron-DeepSpeed's train loop
        calls ``model[0].set_train_batch_size``); returns it."""
        batch = self.schedule.global_batch_at(state.consumed_train_samples)
        # DeepSpeed's data parallel ranks are DP x CP: its batch counts a sample once per CP rank (config/layout.py)
        if self.schedule.rampup is not None and engine.train_batch_size() != batch * self.cp:
            engine.set_train_batch_size(batch * self.cp)  # DeepSpeed keeps the micro batch, changes accumulation steps
        if isinstance(engine.lr_scheduler, ConsumedLRSchedule):
            engine.lr_scheduler.begin_iteration(batch, state.consumed_train_tokens)
        if self.curriculum is not None:  # megatron/training.py: update_difficulty(iteration + 1)
            self.seqlen = self.curriculum.seqlen_at(state.iteration + 1)
        return batch

    def end(self, state, batch: int) -> None:
        state.consumed_train_samples += batch
        state.consumed_train_tokens += batch * self.seqlen  # Megatron-DeepSpeed: samples x curriculum seqlen


def _plain_loss(engine, batch, loss_fn):
    inputs, labels = batch
    inputs = tuple(t.to(engine.device) for t in inputs)
    labels = tuple(t.to(engine.device) for t in labels)
    return loss_fn(engine(inputs), labels)


def _global_tokens(micro_batches, group, sp: int, device) -> float:
    """Loss tokens of the global batch: this rank's micro-batches' loss masks (none on a middle pipeline
    stage, which reads no data) summed over ``group`` (data x sequence or context parallel ranks; each of a
    sample's ``sp`` sequence or context parallel ranks holds its whole mask, so it is counted ``sp`` times)."""
    local = sum(float(labels[1].float().sum()) for _, labels in micro_batches)
    total = torch.tensor(local, dtype=torch.float64, device=device)
    dist.all_reduce(total, group=group)
    return float(total) / sp


@contextlib.contextmanager
def _per_token(token_scale, engine, data_iter, layout, dp_group):
    """--calculate-per-token-loss (``model/token_loss.py``): the step's micro-batches read ahead, counted,
    and the loss scaled for them; yields the iterator to run the step on (the same one without the flag)."""
    if token_scale is None:
        yield data_iter
        return
    steps = engine.gradient_accumulation_steps()  # changes during a batch-size ramp-up
    batches = list(itertools.islice(data_iter, steps))
    tokens = _global_tokens(batches, dp_group, layout.sp * layout.cp, engine.device)
    with token_scale.scaled(layout.dp * steps, tokens):
        yield iter(batches)


def train_step(engine, data_iter, layout, loss_fn, dp_group, token_scale=None) -> float:
    """One optimizer step over layout.grad_accum_steps micro-batches; returns the mean loss (all DP).
    ``dp_group``: the data parallel ranks, with their DeepSpeed-Ulysses sequence parallel ranks, whose
    losses are parts of one sequence's (``model/language_model.py`` ``language_model_loss``) and are summed, not averaged.
    ``token_scale``: --calculate-per-token-loss's (``model/token_loss.py``): the loss is then the global
    batch's token mean, in the gradients and the value returned. FP8 delayed scaling's amax histories and
    scales are updated after the step (``parallel/fp8_delayed.py``), and so are the expert biases of Megatron-LM's
    MoE routers (--moe-router-enable-expert-bias; Megatron-LM updates them in finalize_model_grads, before its
    optimizer step: the bias is no parameter, so the step's weights are the same either way)."""
    with _per_token(token_scale, engine, data_iter, layout, dp_group) as it:
        loss = _train_step(engine, it, layout, loss_fn, dp_group)
    if layout.fp8 is not None and layout.fp8.granularity == "delayed":
        update_delayed_scaling(engine.module, dp_group)
    if is_mlm_moe(layout.model) and layout.model.moe_router_enable_expert_bias:  # from the step's tokens per expert
        update_expert_bias(engine.module, layout.model.moe_router_bias_update_rate, dp_group)
    return loss


def _train_step(engine, data_iter, layout, loss_fn, dp_group) -> float:
    if layout.use_pipeline:
        return float(engine.train_batch(data_iter=data_iter))
    total = torch.zeros((), dtype=torch.float32, device=engine.device)
    steps = engine.gradient_accumulation_steps()  # changes during a batch-size ramp-up
    for i in range(steps):
        # explicit boundary: DeepSpeed's own count (micro_steps % steps) drifts when steps changes
        engine.set_gradient_accumulation_boundary(i == steps - 1)
        loss = _plain_loss(engine, next(data_iter), loss_fn)
        engine.backward(loss)
        engine.step()
        total += loss.detach().float()
    total /= steps
    dist.all_reduce(total, group=dp_group)
    return float(total) / (dist.get_world_size(dp_group) // layout.sp)


@torch.no_grad()
def evaluate(engine, data_iter, layout, loss_fn, dp_group, eval_iters: int, token_scale=None) -> float:
    """Mean loss over eval_iters global batches. --calculate-per-token-loss (``token_scale``): the mean over
    their loss tokens, as Megatron-LM's evaluate sums the losses and the tokens of every batch."""
    if token_scale is not None:
        total = tokens = 0.0
        for _ in range(eval_iters):
            batches = list(itertools.islice(data_iter, layout.grad_accum_steps))
            n = _global_tokens(batches, dp_group, layout.sp * layout.cp, engine.device)
            with token_scale.scaled(layout.dp * layout.grad_accum_steps, n):
                total += _evaluate(engine, iter(batches), layout, loss_fn, dp_group, 1) * n
            tokens += n
        return total / max(tokens, 1.0)
    return _evaluate(engine, data_iter, layout, loss_fn, dp_group, eval_iters)


def _evaluate(engine, data_iter, layout, loss_fn, dp_group, eval_iters: int) -> float:
    total = 0.0
    if layout.use_pipeline:
        for _ in range(eval_iters):
            # at the final global batch (also during a ramp-up), as consumed_valid_samples counts it
            total += float(engine.eval_batch(data_iter=data_iter, reduce_output="avg", bcast_loss=True,
                                             num_micro_batches=layout.grad_accum_steps))
        return total / eval_iters
    engine.eval()
    acc = torch.zeros((), dtype=torch.float32, device=engine.device)
    for _ in range(eval_iters * layout.grad_accum_steps):
        acc += _plain_loss(engine, next(data_iter), loss_fn).float()
    engine.train()
    dist.all_reduce(acc, group=dp_group)
    return float(acc) / (eval_iters * layout.grad_accum_steps * (dist.get_world_size(dp_group) // layout.sp))


def diverged(state: TrainState, what: str) -> str:
    """One line for a run that stops because its loss or state went NaN/inf: ``what`` happened, and
    which checkpoint to go back to -- the last one this run loaded or saved, unless the loss was
    NaN/inf at every iteration since (then its weights are what diverged: an older one)."""
    remedy = "lower --lr, check the data, or use --bf16 instead of --fp16"
    if state.last_checkpoint is None:
        return f"{what}; stopping (this run loaded and saved no checkpoint): {remedy}"
    if state.finite_since_checkpoint:
        return (f"{what}; stopping without saving. The last good checkpoint is {state.last_checkpoint}: resume "
                f"from it and {remedy}")
    return (f"{what}; stopping without saving. The loss was NaN/inf at every iteration since {state.last_checkpoint} "
            f"(its weights diverged): resume from an older checkpoint (--ckpt-step N) and {remedy}")


@dataclass
class _Window:
    """What the iteration line reports: the iterations since the last line."""
    start: float
    skipped_before: int
    iterations: int = 0
    losses: list = field(default_factory=list)
    nans: int = 0
    backward_scale: float = 1.0  # the fp16 loss scale of the last iteration's backward


@dataclass
class Loop:
    """The training loop of one ``Run`` on a DeepSpeed engine (see the module docstring)."""
    run: Run
    engine: object
    loss_fn: Callable
    dp_group: object  # data parallel x sequence parallel ranks: the losses to reduce (``train_step``)
    device: torch.device
    tb: object  # mlog.TensorBoard / wandb_log.ScalarWriters: .scalars(step, values)
    save: Callable[[TrainState], None]
    # --keep-last's deletions after the newest save: called after every iteration with a finite loss (the
    # newest checkpoint's weights, or their successors, gave one) and at the end of the run
    prune: Callable[[TrainState], None] | None = None
    start_time: float = 0.0
    stop_signals: StopSignals | None = None
    profiler: StepProfiler | None = None  # --profile (training/profiler.py)
    # the named scalars the model's loss function reports (model/loss_report.py): printed after lm loss
    loss_report: LossReport = field(default_factory=LossReport)
    # (state, label, reported means) after each validation line: fine-tuning's per-epoch accuracy (cli/tasks.py)
    after_validation: Callable | None = None
    # --async-save (checkpoint/async_save.py): called after every iteration with its time in seconds (collective
    # while a background save is in flight: it finalises the save once written)
    after_iteration: Callable[[float], None] | None = None
    progress: ProgressLog | None = None  # --log-progress: a progress.txt line after each save
    manual_gc: ManualGC = field(default_factory=lambda: ManualGC(False, 0, False))  # --manual-gc
    straggler: StragglerDetector | None = None  # --log-straggler: reported every --log-interval iterations
    flops: float = field(init=False)  # model FLOPs of one iteration at the final global batch
    warmup: SeqlenWarmup | None = field(init=False)  # the sequence-length warm-up, when the run has one
    flops_since_report: float = field(init=False, default=0.0)  # the straggler report's FLOPs

    def __post_init__(self):
        layout = self.run.layout
        self.flops = self._flops(layout.model.seq_length)
        self.warmup = SeqlenWarmup(self.engine, layout.use_pipeline) if layout.curriculum else None

    def _flops(self, seq_length: int) -> float:
        """Model FLOPs of one iteration at ``seq_length``: the model family's count (``ModelFamily.flops``)."""
        return self.run.layout.family.flops(self.run.layout, seq_length)

    def _iteration_flops(self, batch: int, seqlen: int) -> float:
        """Model FLOPs of an iteration of ``batch`` samples (a ramp-up's) of ``seqlen`` tokens (a warm-up's)."""
        flops = self.flops if seqlen == self.run.layout.model.seq_length else self._flops(seqlen)
        return flops * batch / self.run.layout.global_batch_size

    def train(self, state: TrainState, train_iter, valid_iter) -> TrainState:
        """Train from ``state`` until the run ends or is stopped early; saves where --save asks."""
        ckpt = self.run.checkpoint
        plan = TrainPlan(self.run.layout)
        window = _Window(time.time(), self.engine.skipped_steps)
        last_saved = state.iteration
        if self._killed_before_start(state):
            return state
        if self.warmup is not None:
            train_iter = self.warmup.cut(train_iter)
        self.manual_gc.start()
        while plan.keep_going(state):
            began = time.time()
            batch = plan.begin(self.engine, state)
            window.backward_scale = ds_compat.reported_loss_scale(self.engine)  # the step may change it
            if self.warmup is not None:
                self.warmup.set_length(plan.seqlen)
            if self.profiler is not None:
                self.profiler.begin()
            loss = train_step(self.engine, train_iter, self.run.layout, self.loss_fn, self.dp_group,
                              self.loss_report.token_scale)
            if self.profiler is not None:
                self.profiler.end()
            state.iteration += 1
            plan.end(state, batch)
            self._account(state, loss, window, self._iteration_flops(batch, plan.seqlen))
            if self.prune is not None and math.isfinite(loss):
                self.prune(state)
            if state.iteration % self.run.logging.log_interval == 0 or not plan.keep_going(state):
                self._log(state, window, batch, plan.seqlen)
                window = _Window(time.time(), self.engine.skipped_steps)
            # Validation and saving are kept out of the next log line's time per iteration.
            paused = time.time()
            if self.after_iteration is not None:
                self.after_iteration(paused - began)
            if self._between_iterations(state, valid_iter):
                last_saved = state.iteration
            self._after_step(state)
            if state.exited_early:
                break
            window.start += time.time() - paused
        if ckpt.save and last_saved != state.iteration:
            self._save(state)
        if self.prune is not None:  # no iteration follows the last save: its loss was finite, as it must be
            self.prune(state)
        return state

    def _killed_before_start(self, state: TrainState) -> bool:
        """megatron/training.py pretrain: a run that starts while --kill-switch-file exists exits at once."""
        path = self.run.training.kill_switch_file
        if path is None or agreed_stop(None, self.start_time, None, self.device, path) is None:
            return False
        state.stop_reason, state.exited_early = f"kill switch {path} found", True
        print_rank0(f"exiting before iteration {state.iteration + 1} ({state.stop_reason})")
        return True

    def _after_step(self, state: TrainState) -> None:
        """Megatron-LM's post_training_step_callbacks (megatron/training/training.py), in its order: the
        straggler report every --log-interval iterations, then the --manual-gc-interval collection."""
        if self.straggler is not None and state.iteration % self.run.logging.log_interval == 0:
            self.straggler.report(self.flops_since_report, self.run.logging.log_interval)
            self.flops_since_report = 0.0
        self.manual_gc.after_step(state.iteration)

    def _account(self, state: TrainState, loss: float, window: _Window, flops: float) -> None:
        """Count the iteration's loss and FLOPs; too many NaN/inf losses in a row stop the run."""
        if self.run.training.empty_unused_memory_level >= 1 and self.device.type == "cuda":
            torch.cuda.empty_cache()
        state.floating_point_operations_so_far += flops
        self.flops_since_report += flops
        window.iterations += 1
        state.last_loss = loss
        if math.isfinite(loss):
            state.consecutive_nans = 0
            state.finite_since_checkpoint = True
            state.history.append((state.iteration, loss))
            window.losses.append(loss)
            return
        state.nan_iterations += 1
        state.consecutive_nans += 1
        window.nans += 1
        if state.consecutive_nans >= self.run.training.max_consecutive_nan_iters:
            raise TrainingStopped(diverged(state, f"loss was NaN/inf for {state.consecutive_nans} iterations in a row "
                                                  f"(last at iteration {state.iteration})"))

    def _save(self, state: TrainState) -> None:
        """The save function, except that a diverged state (``NonFiniteState``: the checkpoint was not
        written) stops the run in one line naming the checkpoint to go back to."""
        try:
            self.save(state)
        except NonFiniteState as exc:
            raise TrainingStopped(diverged(state, f"training diverged: {exc}")) from None
        if self.progress is not None:  # upstream: save_checkpoint_and_time, after the save
            self.progress.saved(state.iteration, state.floating_point_operations_so_far, state.consumed_train_tokens)

    def _log(self, state: TrainState, window: _Window, batch: int, seqlen: int) -> None:
        """Megatron's iteration line for the window, and the same scalars to TensorBoard / W&B."""
        layout, engine, lg = self.run.layout, self.engine, self.run.logging
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = (time.time() - window.start) / window.iterations
        grad_norm = ds_compat.reported_grad_norm(engine, window.backward_scale)
        lr = engine.lr_scheduler.get_lr()[0] if engine.lr_scheduler is not None else self.run.optimizer.lr
        # Megatron prints the mean loss of the iterations since the last line (NaNs excluded)
        mean_loss = sum(window.losses) / len(window.losses) if window.losses else None
        reported, mean_loss = self._reported(mean_loss)
        # model TFLOP/s per GPU (upstream's "throughput", megatron/training/training.py training_log)
        tflops = self._iteration_flops(batch, seqlen) / elapsed / layout.world_size / 1e12
        mlog.print_last_rank(mlog.iteration_line(
            iteration=state.iteration, train_iters=layout.train_iters,
            consumed_samples=state.consumed_train_samples, elapsed_ms=elapsed * 1000.0, lr=lr,
            consumed_tokens=state.consumed_train_tokens if layout.schedule.counts_tokens else None,
            global_batch_size=batch, loss=mean_loss, loss_scale=ds_compat.reported_loss_scale(engine),
            grad_norm=grad_norm, skipped=engine.skipped_steps - window.skipped_before, nans=window.nans,
            samples_per_s=batch / elapsed,
            tokens_per_s_per_gpu=batch * seqlen / elapsed / layout.world_size,
            tflops_per_gpu=tflops, mem_gb=mlog.peak_memory_gb(self.device),
            eta_s=elapsed * (layout.train_iters - state.iteration),
            curriculum_seqlen=seqlen if layout.curriculum else None, reported=reported,
            throughput_tflops=tflops if lg.log_throughput else None))
        self.tb.scalars(state.iteration, {**reported,
            "lm loss": mean_loss, "learning-rate": lr if lg.log_learning_rate_to_tensorboard else None,
            "grad-norm": grad_norm,
            "iteration-time": elapsed if lg.log_timers_to_tensorboard else None,
            "throughput": tflops if lg.log_throughput and lg.log_timers_to_tensorboard else None,  # upstream's tag
            "batch-size": batch if lg.log_batch_size_to_tensorboard else None,
            "mem-peak-GB": mlog.peak_memory_gb(self.device) if lg.log_memory_to_tensorboard else None,
            "loss-scale": ds_compat.reported_loss_scale(engine),
            "seqlen/curriculum_seqlen": seqlen if layout.curriculum else None,  # Megatron-DeepSpeed's tag
        })

    def _reported(self, loss: float | None, phase: str = "train") -> tuple[dict, float | None]:
        """The loss report's means (collective: every rank is here) and the loss to print as lm loss:
        the reported "lm loss" where the loss function reports one (its loss holds more terms)."""
        reported = self.loss_report.reduce(self.device, phase=phase)
        lm = reported.pop("lm loss", None)
        return reported, lm if lm is not None else loss

    def _between_iterations(self, state: TrainState, valid_iter) -> bool:
        """Validation when due, the save when due or when stopping, and the stop decision (marked in
        ``state``). All ranks must agree on stopping, or some would save while others train on
        (signals.agreed_stop). Returns whether a checkpoint was saved."""
        t, ckpt = self.run.training, self.run.checkpoint
        if valid_iter is not None and t.eval_interval and state.iteration % t.eval_interval == 0:
            self.manual_gc.before_eval()
            self.validate(state, valid_iter, f"iteration {state.iteration}")
            self.manual_gc.after_eval()
        saving_due = ckpt.save and ckpt.save_interval and state.iteration % ckpt.save_interval == 0
        stop = agreed_stop(self.stop_signals, self.start_time, t.exit_duration_in_mins, self.device,
                           t.kill_switch_file)
        exit_now = (t.exit_interval and state.iteration % t.exit_interval == 0) or stop is not None
        saved = bool(ckpt.save and (saving_due or exit_now))
        if saved:
            self._save(state)
        if exit_now:
            state.stop_reason = {"signal": "stop signal received", "time": "--exit-duration-in-mins",
                                 "kill switch": f"kill switch {t.kill_switch_file} found"}.get(stop, "--exit-interval")
            print_rank0(f"exiting at iteration {state.iteration} ({state.stop_reason})")
            state.exited_early = True
        return saved

    def validate(self, state: TrainState, data_iter, label: str) -> float:
        """Validation loss over --eval-iters global batches, printed as Megatron prints it."""
        t = self.run.training
        layout = self.run.layout
        if self.warmup is not None:  # evaluation at the full length (megatron/training.py evaluate)
            self.warmup.set_length(layout.model.seq_length)
        with self.loss_report.phase(EVAL):
            loss = evaluate(self.engine, data_iter, layout, self.loss_fn, self.dp_group, t.eval_iters,
                            self.loss_report.token_scale)
        reported, loss = self._reported(loss, EVAL)
        if t.empty_unused_memory_level >= 2 and cuda_runtime():
            torch.cuda.empty_cache()
        state.consumed_valid_samples += t.eval_iters * layout.global_batch_size
        mlog.print_last_rank(mlog.validation_lines(label, loss, reported))
        if self.after_validation is not None:
            self.after_validation(state, label, reported)
        values = {"lm loss validation": loss, **{f"{name} validation": v for name, v in reported.items()}}
        if self.run.logging.log_validation_ppl_to_tensorboard:
            values["lm loss validation ppl"] = math.exp(min(20.0, loss))
        self.tb.scalars(state.iteration, values)
        return loss
