"""The train / evaluate loop around a DeepSpeed engine (pipeline or plain)."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_ds import ds_compat
from megatron_ds.config import Config, Layout
from megatron_ds.training import log as mlog
from megatron_ds.training.batch_schedule import TrainPlan
from megatron_ds.training.signals import StopSignals, agreed_stop


class TrainingStopped(RuntimeError):
    """The run cannot go on (e.g. too many NaN losses in a row); the message says why."""


@dataclass
class TrainState:
    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_train_tokens: int = 0
    consumed_valid_samples: int = 0
    nan_iterations: int = 0
    consecutive_nans: int = 0
    exited_early: bool = False  # stopped by --exit-interval / --exit-duration-in-mins / a signal
    stop_reason: str | None = None
    history: list = field(default_factory=list)  # (iteration, loss) of finite losses: tests read it


def _plain_loss(engine, batch, loss_fn):
    inputs, labels = batch
    inputs = tuple(t.to(engine.device) for t in inputs)
    labels = tuple(t.to(engine.device) for t in labels)
    return loss_fn(engine(inputs), labels)


def train_step(engine, data_iter, layout: Layout, loss_fn, dp_group) -> float:
    """One optimizer step over layout.grad_accum_steps micro-batches; returns the mean loss (all DP)."""
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
    return float(total) / dist.get_world_size(dp_group)


@torch.no_grad()
def evaluate(engine, data_iter, layout: Layout, loss_fn, dp_group, eval_iters: int) -> float:
    """Mean loss over eval_iters global batches."""
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
    return float(acc) / (eval_iters * layout.grad_accum_steps * dist.get_world_size(dp_group))


def train(cfg: Config, layout: Layout, engine, state: TrainState, train_iter, valid_iter, *, loss_fn,
          dp_group, device, save_fn, tb: mlog.TensorBoard, start_time: float,
          stop_signals: StopSignals | None = None) -> TrainState:
    t, lg = cfg.training, cfg.logging
    m = layout.model
    flops = mlog.model_flops_per_iteration(m, layout.global_batch_size, layout.padded_vocab_size,
                                           layout.recompute == "full")
    window_start, window_iters, window_losses, window_nans = time.time(), 0, [], 0
    window_skipped = engine.skipped_steps
    last_saved = state.iteration
    plan = TrainPlan(layout)
    while plan.keep_going(state):
        batch = plan.begin(engine, state)
        loss = train_step(engine, train_iter, layout, loss_fn, dp_group)
        state.iteration += 1
        plan.end(state, batch)
        if t.empty_unused_memory_level >= 1 and device.type == "cuda":
            torch.cuda.empty_cache()
        window_iters += 1
        if not math.isfinite(loss):
            state.nan_iterations += 1
            state.consecutive_nans += 1
            window_nans += 1
            if state.consecutive_nans >= t.max_consecutive_nan_iters:
                raise TrainingStopped(f"loss was NaN/inf for {state.consecutive_nans} iterations in a row "
                                      f"(last at iteration {state.iteration}); stopping. Lower --lr, check "
                                      f"the data, or use --bf16 instead of --fp16")
        else:
            state.consecutive_nans = 0
            state.history.append((state.iteration, loss))
            window_losses.append(loss)

        if state.iteration % lg.log_interval == 0 or not plan.keep_going(state):
            if device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = (time.time() - window_start) / window_iters
            grad_norm = engine.get_global_grad_norm()
            grad_norm = float(grad_norm) if grad_norm is not None else None
            lr = engine.lr_scheduler.get_lr()[0] if engine.lr_scheduler is not None else cfg.optimizer.lr
            # Megatron prints the mean loss of the iterations since the last line (NaNs excluded)
            mean_loss = sum(window_losses) / len(window_losses) if window_losses else None
            line = mlog.iteration_line(
                iteration=state.iteration, train_iters=layout.train_iters,
                consumed_samples=state.consumed_train_samples, elapsed_ms=elapsed * 1000.0, lr=lr,
                consumed_tokens=state.consumed_train_tokens if layout.run.counts_tokens else None,
                global_batch_size=batch, loss=mean_loss, loss_scale=ds_compat.reported_loss_scale(engine),
                grad_norm=grad_norm, skipped=engine.skipped_steps - window_skipped, nans=window_nans,
                samples_per_s=batch / elapsed,
                tokens_per_s_per_gpu=batch * m.seq_length / elapsed / layout.world_size,
                tflops_per_gpu=flops * batch / layout.global_batch_size / elapsed / layout.world_size / 1e12,
                mem_gb=mlog.peak_memory_gb(device),
                eta_s=elapsed * (layout.train_iters - state.iteration))
            mlog.print_last_rank(line)
            tb.scalars(state.iteration, {
                "lm loss": mean_loss, "learning-rate": lr, "grad-norm": grad_norm,
                "iteration-time": elapsed if lg.log_timers_to_tensorboard else None,
                "batch-size": batch if lg.log_batch_size_to_tensorboard else None,
                "mem-peak-GB": mlog.peak_memory_gb(device) if lg.log_memory_to_tensorboard else None,
                "loss-scale": ds_compat.reported_loss_scale(engine),
            })
            window_start, window_iters, window_losses, window_nans = time.time(), 0, [], 0
            window_skipped = engine.skipped_steps

        # Validation and saving are kept out of the next log line's time per iteration.
        paused = time.time()
        if valid_iter is not None and t.eval_interval and state.iteration % t.eval_interval == 0:
            run_validation(cfg, layout, engine, state, valid_iter, loss_fn, dp_group, tb,
                           f"iteration {state.iteration}")

        saving_due = cfg.checkpoint.save and cfg.checkpoint.save_interval and \
            state.iteration % cfg.checkpoint.save_interval == 0
        # All ranks must agree, or some would save while others train on (signals.agreed_stop).
        stop = agreed_stop(stop_signals, start_time, t.exit_duration_in_mins, device)
        exit_now = (t.exit_interval and state.iteration % t.exit_interval == 0) or stop is not None
        if cfg.checkpoint.save and (saving_due or exit_now):
            save_fn(state)
            last_saved = state.iteration
        if exit_now:
            state.stop_reason = {"signal": "stop signal received",
                                 "time": "--exit-duration-in-mins"}.get(stop, "--exit-interval")
            mlog.print_rank0(f"exiting at iteration {state.iteration} ({state.stop_reason})")
            state.exited_early = True
            break
        window_start += time.time() - paused
    if cfg.checkpoint.save and last_saved != state.iteration:
        save_fn(state)
    return state


def run_validation(cfg, layout, engine, state, valid_iter, loss_fn, dp_group, tb, label: str) -> float:
    loss = evaluate(engine, valid_iter, layout, loss_fn, dp_group, cfg.training.eval_iters)
    if cfg.training.empty_unused_memory_level >= 2 and torch.cuda.is_available():
        torch.cuda.empty_cache()
    state.consumed_valid_samples += cfg.training.eval_iters * layout.global_batch_size
    mlog.print_last_rank(mlog.validation_lines(label, loss))
    values = {"lm loss validation": loss}
    if cfg.logging.log_validation_ppl_to_tensorboard:
        values["lm loss validation ppl"] = math.exp(min(20.0, loss))
    tb.scalars(state.iteration, values)
    return loss
