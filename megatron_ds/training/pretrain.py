"""pretrain_gpt.py's body: parse -> validate -> initialize -> build -> load -> train -> save."""
from __future__ import annotations

import functools
import json
import os
import sys
import time

import torch

from megatron_ds.config import Config, ConfigError, derive, load_ds_template, parse_args
from megatron_ds.config.compat import megatron_overrides
from megatron_ds.config.ds_validate import validate_with_deepspeed
from megatron_ds.ds_compat import check_deepspeed
from megatron_ds.training import log as mlog
from megatron_ds.training.data import (BatchCollator, DataError, build_datasets, build_loader,
                                       build_tokenizer_for, describe_source, stage_iterator)
from megatron_ds.training.collective_timeout import is_collective_failure
from megatron_ds.training.loop import TrainingStopped, TrainState, run_validation, train
from megatron_ds.training.wandb_log import ScalarWriters, WandB


def dry_run(cfg: Config, ignored: list[str]) -> int:
    """Validate and print the resolved layout without starting anything distributed."""
    from megatron_ds.training.device import device_type  # noqa: PLC0415

    world = cfg.world_size or int(os.environ.get("WORLD_SIZE", "1"))
    tokenizer = build_tokenizer_for(cfg.data, log=lambda *a: None)
    template = load_ds_template(cfg.deepspeed.deepspeed_config)
    notes = megatron_overrides(cfg, template)
    layout = derive(cfg, world, vocab_size=tokenizer.vocab_size, ds_template=template,
                    device_type="cuda" if device_type() == "cuda" or cfg.training.fp16 else "cpu")
    check_deepspeed(interleaved=layout.virtual_pp > 1)  # once, before DeepSpeed is first used
    validate_with_deepspeed(layout.ds_config, cfg.deepspeed.deepspeed_config or "the DeepSpeed config")
    print(layout.summary())
    for note in notes + list(layout.notes):
        print(f"WARNING: {note}")
    print(f"micro-batches per step per data parallel rank: {layout.grad_accum_steps}")
    check_layout_memory(cfg, layout)
    if ignored:
        print(f"ignored flags (no effect here): {' '.join(sorted(set(ignored)))}")
    print("DeepSpeed config:")
    print(json.dumps(layout.ds_config, indent=2, sort_keys=True))
    return 0


def check_layout_memory(cfg: Config, layout) -> None:
    """Print the per-GPU memory estimate; over --gpu-memory-gb it is a ConfigError (issue 13)."""
    from megatron_ds.config import memory  # noqa: PLC0415

    kw = dict(sequence_parallel=cfg.parallel.sequence_parallel,
              recompute_num_layers=cfg.training.recompute_num_layers)
    estimate = memory.estimate_memory(layout, **kw)
    budget = memory.gpu_memory_bytes(cfg.gpu_memory_gb)
    print(estimate.describe(budget))
    memory.check_memory(layout, estimate, budget, **kw)


def _num_samples(cfg: Config, layout) -> tuple[int, int, int]:
    t = cfg.training
    train = layout.train_iters * layout.global_batch_size
    evals = (layout.train_iters // t.eval_interval + 1) * t.eval_iters if t.eval_interval else 0
    return train, evals * layout.global_batch_size, t.eval_iters * layout.global_batch_size


def run(cfg: Config, ignored: list[str]) -> TrainState:
    # DeepSpeed and the model are imported here, not at module level: --dry-run and --help stay fast.
    from megatron_ds.training.setup import discover_world, init_distributed, select_device  # noqa: PLC0415

    start_time = time.time()
    env = discover_world(cfg)
    device = select_device(env.local_rank, env.local_world_size)
    tokenizer = build_tokenizer_for(cfg.data, log=mlog.print_rank0 if env.rank == 0 else (lambda *a: None))
    template = load_ds_template(cfg.deepspeed.deepspeed_config)
    notes = megatron_overrides(cfg, template)
    layout = derive(cfg, env.world_size, vocab_size=tokenizer.vocab_size, ds_template=template,
                    device_type=device.type)
    check_deepspeed(interleaved=layout.virtual_pp > 1)  # once, before DeepSpeed is first used
    validate_with_deepspeed(layout.ds_config, cfg.deepspeed.deepspeed_config or "the DeepSpeed config")
    init_distributed(cfg, device)
    save_lock, watch = _startup_checks(cfg, layout)
    try:
        return _run(cfg, ignored, notes, layout, device, tokenizer, start_time, watch)
    except TrainingStopped:
        raise
    except RuntimeError as exc:  # a rank missing outside the loop (engine set-up, loading, validation)
        if not is_collective_failure(exc):
            raise
        raise TrainingStopped(watch.describe(exc, "set-up, checkpoint loading or validation")) from None
    finally:
        if save_lock is not None:
            save_lock.release()


def _startup_checks(cfg: Config, layout):
    """Before any compute: every rank is there, --save is usable and ours (see startup_checks)."""
    from megatron_ds.training.collective_timeout import CollectiveWatch  # noqa: PLC0415
    from megatron_ds.training.startup_checks import prepare_save_dir, startup_barrier  # noqa: PLC0415

    startup_barrier(cfg.parallel.distributed_timeout_minutes)
    watch = CollectiveWatch(cfg.parallel.distributed_timeout_minutes)
    lock = prepare_save_dir(cfg.checkpoint.save, layout, log=mlog.print_rank0) if cfg.checkpoint.save else None
    return lock, watch


def _run(cfg: Config, ignored: list[str], notes: list[str], layout, device, tokenizer, start_time, watch) -> TrainState:
    from megatron_ds.training import checkpointing as ckpt  # noqa: PLC0415
    from megatron_ds.training.ckpt_integrity import protect_newer  # noqa: PLC0415
    from megatron_ds.training.setup import build_engine, log_startup  # noqa: PLC0415
    from megatron_ds.training.signals import StopSignals  # noqa: PLC0415
    from megatron_ds.parallel.groups import ParallelState  # noqa: PLC0415
    from megatron_ds.model.gpt import gpt_loss_fn  # noqa: PLC0415

    ps = ParallelState(layout.tp, layout.pp, layout.dp)
    rt = build_engine(cfg, layout, ps, device, tokenizer.eod)
    log_startup(cfg, layout, rt, ignored)
    for note in notes + list(layout.notes):
        mlog.print_rank0(f"WARNING: {note}")
    engine = rt.engine
    loss_fn = functools.partial(gpt_loss_fn, tp_group=ps.tp_group)

    state = TrainState()
    signature = ckpt.layout_signature(layout)
    if cfg.checkpoint.load:
        rt.scheduler.override = cfg.optimizer.override_lr_scheduler
        rt.scheduler.use_checkpoint = cfg.optimizer.use_checkpoint_lr_scheduler
        iteration, client = ckpt.load_checkpoint(engine, cfg.checkpoint.load, signature=signature,
                                                 load_optim=cfg.checkpoint.load_optim,
                                                 finetune=cfg.checkpoint.finetune,
                                                 load_lr_state=cfg.checkpoint.load_lr_state, ps=ps,
                                                 universal=cfg.checkpoint.universal_checkpoint,
                                                 exact_step=cfg.checkpoint.ckpt_step, log=mlog.print_rank0)
        if iteration:
            state.iteration = iteration
            state.consumed_train_samples = client.get("consumed_train_samples", iteration * layout.global_batch_size)
            state.consumed_train_tokens = client.get("consumed_train_tokens",
                                                     state.consumed_train_samples * layout.model.seq_length)
            state.consumed_valid_samples = client.get("consumed_valid_samples", 0)
            state.nan_iterations = client.get("nan_iterations", 0)
        if client.get("rng") is not None and cfg.checkpoint.load_rng and not cfg.checkpoint.finetune:
            ckpt.set_rng_state(client["rng"])
    if cfg.checkpoint.save:
        protect_newer(cfg.checkpoint.save, state.iteration, log=mlog.print_rank0)

    datasets = build_datasets(cfg.data, num_samples=_num_samples(cfg, layout), seq_length=layout.model.seq_length,
                              seed=cfg.training.seed, vocab_size=tokenizer.vocab_size, log=mlog.print_rank0)
    collator = BatchCollator(cfg.data, tokenizer.eod, tokenizer.vocab_size, describe_source(cfg.data))

    def iterator(dataset, consumed, repeat):
        make = functools.partial(build_loader, dataset, cfg.data, collator, micro_batch_size=layout.micro_batch_size,
                                 dp_rank=ps.dp_rank, dp_size=ps.dp_size)
        # Only the first stage (tokens) and the last stage (labels) read data.
        return stage_iterator(dataset, lambda c: make(consumed_samples=c), consumed,
                              reads_data=ps.is_first_stage or ps.is_last_stage, repeat=repeat)

    training = not cfg.training.skip_train and state.iteration < layout.train_iters
    train_iter = iterator(datasets[0], state.consumed_train_samples, False) if training else None
    valid_iter = iterator(datasets[1], state.consumed_valid_samples, True)
    test_iter = iterator(datasets[2], 0, True)

    last_rank = torch.distributed.get_rank() == torch.distributed.get_world_size() - 1
    lg = cfg.logging
    tb = ScalarWriters(mlog.TensorBoard(lg.tensorboard_dir, enabled_rank=last_rank),
                       WandB(project=lg.wandb_project, name=lg.wandb_exp_name, entity=lg.wandb_entity,
                             save_dir=lg.wandb_save_dir, checkpoint_dir=cfg.checkpoint.save, enabled_rank=last_rank,
                             config=cfg.to_dict()))
    # vocab_size: the real vocabulary, so conversions can drop the padding rows (issue 10)
    meta = {"signature": signature, "config": cfg.to_dict(), "argv": sys.argv[1:], "vocab_size": tokenizer.vocab_size}

    def save(st: TrainState) -> None:
        client = {"iteration": st.iteration, "consumed_train_samples": st.consumed_train_samples,
                  "consumed_train_tokens": st.consumed_train_tokens,
                  "consumed_valid_samples": st.consumed_valid_samples, "nan_iterations": st.nan_iterations}
        if cfg.checkpoint.save_rng:
            client["rng"] = ckpt.rng_state()
        ckpt.save_checkpoint(engine, cfg.checkpoint.save, st.iteration, client_state=client, meta=meta,
                             keep_last=cfg.checkpoint.keep_last, log=mlog.print_rank0)
        mlog.print_rank0(f"saved checkpoint at iteration {st.iteration} to {cfg.checkpoint.save}")

    stop_signals = StopSignals(cfg.training.exit_signal_handler).__enter__()
    try:
        if training:
            try:
                state = train(cfg, layout, engine, state, train_iter, valid_iter, loss_fn=loss_fn,
                              dp_group=ps.dp_group, device=device, save_fn=save, tb=tb, start_time=start_time,
                              stop_signals=stop_signals)
            except RuntimeError as exc:
                if not is_collective_failure(exc):
                    raise
                where = f"the training loop at iteration {state.iteration + 1}"
                raise TrainingStopped(watch.describe(exc, where)) from None
        # A job stopped early (walltime, --exit-interval) exits right after its save, as Megatron
        # does: the final passes would eat the margin left before the scheduler kills it.
        final_eval = not state.exited_early and cfg.training.eval_iters
        if valid_iter is not None and final_eval:
            run_validation(cfg, layout, engine, state, valid_iter, loss_fn, ps.dp_group, tb,
                           f"iteration {state.iteration} on validation set")
        if test_iter is not None and final_eval:
            run_validation(cfg, layout, engine, state, test_iter, loss_fn, ps.dp_group, tb,
                           f"iteration {state.iteration} on test set")
    finally:
        stop_signals.__exit__(None, None, None)
        tb.close()
    return state


def _one_line(exc: Exception) -> str:
    """A DataLoader worker's error arrives wrapped in its traceback text; keep the message."""
    text = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
    prefix = f"{type(exc).__module__}.{type(exc).__name__}: "
    return text[len(prefix):] if text.startswith(prefix) else text


def main(argv=None) -> int:
    cfg, ignored = parse_args(argv)
    try:
        if cfg.dry_run:
            return dry_run(cfg, ignored)
        run(cfg, ignored)
        return 0
    except (ConfigError, DataError, TrainingStopped) as exc:
        print(f"error: {_one_line(exc)}", file=sys.stderr, flush=True)
        return 1
    finally:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
