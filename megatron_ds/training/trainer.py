"""Training one resolved ``Run`` on the processes a launcher started: the process group and start-up
checks, the engine, resuming from --load, the data, the loop, the final evaluation and the saves."""
from __future__ import annotations

import functools
import sys

import torch

from megatron_ds.checkpoint.async_save import AsyncSaver
from megatron_ds.checkpoint.background import PersistentWriter
from megatron_ds.checkpoint.checkpointing import load_checkpoint, save_checkpoint
from megatron_ds.checkpoint.format import carried_meta, layout_signature, step_dir
from megatron_ds.checkpoint.integrity import protect_newer, prune as prune_checkpoints
from megatron_ds.checkpoint.room import checkpoint_room
from megatron_ds.checkpoint.vocabulary import TOKENIZER, tokenizer_record
from megatron_ds.config.family import ModelFamily
from megatron_ds.config.run import Run
from megatron_ds.errors import TrainingStopped
from megatron_ds.parallel.groups import ParallelState
from megatron_ds.parallel.random import rng_state, set_rng_state
from megatron_ds.progress import print_rank0
from megatron_ds.training import log as mlog
from megatron_ds.training.collective_timeout import CollectiveWatch, is_collective_failure
from megatron_ds.training.data import build_loader, check_train_length, samples_per_split, stage_iterator
from megatron_ds.training.engine import build_engine, log_startup
from megatron_ds.training.initialize import init_distributed
from megatron_ds.training.loop import Loop, TrainState
from megatron_ds.training.manual_gc import ManualGC
from megatron_ds.training.profiler import step_profiler
from megatron_ds.training.progress_log import ProgressLog
from megatron_ds.training.signals import StopSignals
from megatron_ds.training.startup_checks import prepare_save_dir, startup_barrier
from megatron_ds.training.straggler import StragglerDetector
from megatron_ds.training.wandb_log import ScalarWriters, WandB


def train(run: Run, device, tokenizer, start_time: float, family: ModelFamily, *,
          after_validation=None) -> TrainState:
    """Join the process group, check --save, then build, resume and train ``family``'s model; the
    state at the end. A rank that never arrives at a collective ends the run in one line naming it.
    ``after_validation``: called after each validation line (``loop.Loop``)."""
    ckpt = run.checkpoint
    # forked before the process group and the model exist: it holds a copy of nothing they allocate
    writer = PersistentWriter() if ckpt.save and ckpt.async_save and ckpt.use_persistent_ckpt_worker else None
    try:
        init_distributed(run.distributed, device)
        save_lock, watch = _startup_checks(run)
        try:
            return _train(run, device, tokenizer, start_time, watch, family, after_validation, writer)
        except TrainingStopped:
            raise
        except RuntimeError as exc:  # a rank missing outside the loop (engine set-up, loading, validation)
            if not is_collective_failure(exc):
                raise
            raise TrainingStopped(watch.describe(exc, "set-up, checkpoint loading or validation")) from None
        finally:
            if writer is not None:  # before the lock goes: no writer of this job outlives it
                writer.close()
                writer = None
            if save_lock is not None:
                save_lock.release()
    finally:
        if writer is not None:
            writer.close()


def _startup_checks(run: Run):
    """Before any compute: every rank is there, --save is usable and ours (see startup_checks)."""
    timeout = run.distributed.distributed_timeout_minutes
    startup_barrier(timeout)
    watch = CollectiveWatch(timeout)
    save = run.checkpoint.save
    lock = prepare_save_dir(run.checkpoint, run.layout, timeout, log=print_rank0) if save else None
    return lock, watch


def _train(run: Run, device, tokenizer, start_time: float, watch, family: ModelFamily,
           after_validation=None, writer: PersistentWriter | None = None) -> TrainState:
    """Build, resume, train, and evaluate at the end (validation and test sets)."""
    layout = run.layout
    progress = _progress_log(run, start_time)
    ps = ParallelState(layout.tp, layout.pp, layout.dp, layout.sp, layout.cp)
    rt = build_engine(run, ps, device, family.eod_token(tokenizer), family=family)
    log_startup(run, rt)
    signature = layout_signature(layout)  # what checkpoints record of this run, compared on load
    state = _resume(run, rt.engine, ps, signature, family, _tokenizer_record(run, tokenizer, family))
    if progress is not None:
        progress.job_start_flops = state.floating_point_operations_so_far
    training = not run.training.skip_train and state.iteration < layout.train_iters
    train_iter, valid_iter, test_iter = _data_iterators(run, ps, tokenizer, state, family, training=training)
    tb = _scalar_writers(run)
    background = AsyncSaver(rt.engine, run.checkpoint.save, family=family, device=device, persistent=writer,
                            room=_room(run, signature), log=print_rank0) \
        if run.checkpoint.save and run.checkpoint.async_save else None
    t = run.training
    manual_gc = ManualGC(t.manual_gc, t.manual_gc_interval, t.manual_gc_eval)
    straggler = _straggler_detector(run, rt.engine, device) if training else None
    try:
        with StopSignals(run.training.exit_signal_handler) as stop_signals:
            save, prune = _saver(run, rt.engine, tokenizer, signature, ps.dp_group, family, background,
                                 carried=carried_meta(run.checkpoint.load, run.checkpoint.ckpt_step))
            loop = Loop(run, rt.engine, rt.loss_fn, ps.sp_dp_group, device, tb, save=save, prune=prune,
                        start_time=start_time,
                        stop_signals=stop_signals, loss_report=rt.loss_report,
                        after_validation=after_validation, progress=progress, manual_gc=manual_gc,
                        straggler=straggler,
                        profiler=step_profiler(run.logging, torch.distributed.get_rank(), device.type),
                        after_iteration=background.after_iteration if background is not None else None)
            if training:
                state = _train_loop(loop, state, train_iter, valid_iter, watch)
            if background is not None:  # the last save, and a stop's, complete before the run goes on or exits
                _finish_saves(background, state, watch)
                prune(state)  # --keep-last, now that the last checkpoint is complete (as after a synchronous one)
            # A job stopped early (walltime, --exit-interval) exits right after its save, as Megatron
            # does: the final passes would eat the margin left before the scheduler kills it.
            if not state.exited_early and run.training.eval_iters:
                for data_iter, split in ((valid_iter, "validation"), (test_iter, "test")):
                    if data_iter is not None:
                        loop.validate(state, data_iter, f"iteration {state.iteration} on {split} set")
        stop_signals.raise_if_interrupted()  # a Ctrl-C stop saved as above, then exits 130 (signals.py)
    finally:
        tb.close()
        if background is not None:
            background.close()
        manual_gc.restore()
        if straggler is not None:
            straggler.close()
    return state


def _finish_saves(background: AsyncSaver, state: TrainState, watch) -> None:
    why = "before exiting" if state.exited_early else "at the end of training"
    try:
        background.wait(why)
    except RuntimeError as exc:
        if not is_collective_failure(exc):
            raise
        raise TrainingStopped(watch.describe(exc, f"finishing the background save {why}")) from None


def _progress_log(run: Run, start_time: float) -> ProgressLog | None:
    """--log-progress with --save: progress.txt's "Starting job" line, written once the ranks have joined
    (upstream: pretrain, right after initialize_megatron)."""
    if not (run.logging.log_progress and run.checkpoint.save):
        return None
    progress = ProgressLog(run.checkpoint.save, run.layout.world_size, start_time)
    progress.start_job()
    return progress


def _straggler_detector(run: Run, engine, device) -> StragglerDetector | None:
    """--log-straggler: the timer on the engine's module (what every engine and executor calls per
    micro-batch), the controller on rank 0."""
    lg = run.logging
    if not lg.log_straggler:
        return None
    return StragglerDetector(engine.module, device, minmax_count=lg.straggler_minmax_count,
                             enabled=not lg.disable_straggler_on_startup, port=lg.straggler_ctrlr_port)


def _train_loop(loop, state: TrainState, train_iter, valid_iter, watch) -> TrainState:
    try:
        return loop.train(state, train_iter, valid_iter)
    except RuntimeError as exc:
        if not is_collective_failure(exc):
            raise
        where = f"the training loop at iteration {state.iteration + 1}"
        raise TrainingStopped(watch.describe(exc, where)) from None


def _tokenizer_record(run: Run, tokenizer, family: ModelFamily) -> dict:
    """The tokenizer as checkpoints record it, and as --load compares it (``vocabulary``)."""
    return tokenizer_record(tokenizer, run.data.tokenizer_type, family.eod_token(tokenizer))


def _resume(run: Run, engine, ps, signature: dict, family: ModelFamily, vocab: dict) -> TrainState:
    """The state to start from: --load's checkpoint (any layout) or a fresh one; then --save must not
    hold a complete checkpoint newer than that start (it would be overwritten)."""
    ckpt, layout = run.checkpoint, run.layout
    state = TrainState()
    if ckpt.load:
        iteration, client = load_checkpoint(engine, ckpt, signature=signature, ps=ps, family=family, vocab=vocab,
                                            log=print_rank0)
        if iteration or client:  # what a diverged run names as the checkpoint to go back to
            state.last_checkpoint = ckpt.load if ckpt.universal_checkpoint else \
                step_dir(ckpt.load, client.get("iteration", iteration))
        if iteration:
            state.iteration = iteration
            state.consumed_train_samples = client.get("consumed_train_samples", iteration * layout.global_batch_size)
            state.consumed_train_tokens = client.get("consumed_train_tokens",
                                                     state.consumed_train_samples * layout.model.seq_length)
            state.consumed_valid_samples = client.get("consumed_valid_samples", 0)
            state.nan_iterations = client.get("nan_iterations", 0)
            # 0 for a checkpoint without the count, as upstream's load_checkpoint
            state.floating_point_operations_so_far = client.get("num_floating_point_operations_so_far", 0.0)
        if client.get("rng") is not None and ckpt.load_rng and not ckpt.finetune:
            set_rng_state(_own_rng_state(client["rng"], ps.dp_rank, run.training.data_parallel_random_init))
    if ckpt.save:
        protect_newer(ckpt.save, state.iteration, log=print_rank0)
    return state


def _data_iterators(run: Run, ps, tokenizer, state: TrainState, family: ModelFamily, *, training: bool):
    """(train, validation, test) micro-batch iterators of ``family``'s samples, each None where the
    split does not exist; train is None too when this run does not train."""
    layout, t, data = run.layout, run.training, run.data
    datasets = family.build_datasets(run, tokenizer, samples_per_split(layout, t), print_rank0)
    check_train_length(datasets[0], data, layout.train_iters * layout.global_batch_size)
    collator = family.make_collator(run, tokenizer)

    def iterator(dataset, consumed, repeat):
        make = functools.partial(build_loader, dataset, data, collator, micro_batch_size=layout.micro_batch_size,
                                 dp_rank=ps.loader_rank, dp_size=ps.loader_size)
        # Only the first stage (tokens) and the last stage (labels) read data.
        return stage_iterator(dataset, lambda c: make(consumed_samples=c), consumed,
                              reads_data=ps.is_first_stage or ps.is_last_stage, repeat=repeat,
                              endless=data.dataloader_type == "cyclic" or data.repeated_dataloader)

    return (iterator(datasets[0], state.consumed_train_samples, False) if training else None,
            iterator(datasets[1], state.consumed_valid_samples, True), iterator(datasets[2], 0, True))


def _scalar_writers(run: Run):
    """TensorBoard and W&B on the last rank (where the losses are)."""
    last_rank = torch.distributed.get_rank() == torch.distributed.get_world_size() - 1
    lg = run.logging
    return ScalarWriters(mlog.TensorBoard(lg.tensorboard_dir, enabled_rank=last_rank),
                         WandB(project=lg.wandb_project, name=lg.wandb_exp_name, entity=lg.wandb_entity,
                               save_dir=lg.wandb_save_dir, checkpoint_dir=run.checkpoint.save,
                               enabled_rank=last_rank, config=run.record))


def _rng_states(run: Run, dp_group):
    """What a checkpoint keeps of the RNG: this rank's state, or with --data-parallel-random-init every data
    parallel rank's (only DP rank 0 writes the client state), as Megatron's get_rng_state gathers them."""
    if not run.training.data_parallel_random_init or run.layout.dp == 1:
        return rng_state()
    states = [None] * run.layout.dp
    torch.distributed.all_gather_object(states, rng_state(), group=dp_group)
    return states


def _own_rng_state(saved, dp_rank: int, per_rank: bool) -> dict:
    """This rank's RNG state from a checkpoint's (a list with --data-parallel-random-init, as Megatron's
    load_checkpoint picks ``rng_state[dp_rank]``; the first one of a list otherwise)."""
    if not isinstance(saved, list):
        return saved
    return saved[dp_rank if per_rank and dp_rank < len(saved) else 0]


def _room(run: Run, signature: dict):
    """The room one checkpoint needs, named in the line of a failed save (rank 0)."""
    return lambda: checkpoint_room(run.layout, signature, (run.checkpoint.save, run.checkpoint.load))[0]


def _saver(run: Run, engine, tokenizer, signature: dict, dp_group, family: ModelFamily,
           background: AsyncSaver | None = None, carried: dict | None = None):
    """The loop's save and prune functions: DeepSpeed's checkpoint with the run's counters, RNG states
    and record (written by ``background`` under --async-save); --keep-last's deletions once the newest
    checkpoint's weights gave a finite loss. ``carried``: what the loaded checkpoint's record passes on
    (``format.carried_meta``)."""
    ckpt = run.checkpoint
    # vocab_size: the real vocabulary, so conversions can drop the padding rows;
    # model_family: which entry point's model the weights are (conversions and tools read it)
    meta = {"signature": signature, "config": run.record, "argv": sys.argv[1:],
            "vocab_size": tokenizer.vocab_size, "model_family": family.name,
            TOKENIZER: _tokenizer_record(run, tokenizer, family), **(carried or {})}  # tokenizer: compared when loaded
    rank0 = torch.distributed.get_rank() == 0
    unpruned = []  # the iteration saved last, until prune() has run for it

    def save(st: TrainState) -> None:
        client = {"iteration": st.iteration, "consumed_train_samples": st.consumed_train_samples,
                  "consumed_train_tokens": st.consumed_train_tokens,
                  "consumed_valid_samples": st.consumed_valid_samples, "nan_iterations": st.nan_iterations,
                  "num_floating_point_operations_so_far": st.floating_point_operations_so_far}
        if ckpt.save_rng:
            client["rng"] = _rng_states(run, dp_group)
        if background is not None:
            background.save(st.iteration, client_state=client, meta=meta, loss=st.last_loss,
                            on_complete=lambda iteration: complete(st, iteration))
            return
        save_checkpoint(engine, ckpt.save, st.iteration, client_state=client, meta=meta, loss=st.last_loss,
                        room=_room(run, signature), family=family, log=print_rank0)
        complete(st, st.iteration)
        print_rank0(f"saved checkpoint at iteration {st.iteration} to {ckpt.save}")

    def complete(st: TrainState, iteration: int) -> None:
        """Checkpoint ``iteration`` is complete (a background one: some iterations later)."""
        st.last_checkpoint = step_dir(ckpt.save, iteration)
        st.finite_since_checkpoint = bool(st.history) and st.history[-1][0] > iteration
        unpruned[:] = [iteration]

    def prune(st: TrainState) -> None:
        if unpruned and ckpt.keep_last and rank0:
            prune_checkpoints(ckpt.save, unpruned[0], ckpt.keep_last, log=print_rank0)
        unpruned.clear()

    return save, prune
