"""Saving and loading a live DeepSpeed engine: its checkpoint plus this toolkit's files around it.

``save_checkpoint`` writes DeepSpeed's files, then (``megatron_ds.checkpoint.format``) the saved
config, the manifest and the trackers. The trackers are written by rank 0 only after a barrier that
every rank reaches once its own files are written, and atomically (temp file + rename): a crash
during a save leaves the trackers pointing at the previous, complete checkpoint. The checkpoint is
complete once its manifest exists (``integrity``); a kill before that leaves an interrupted save,
which the next run moves aside.

Loading checks the saved layout against this run's before touching any tensor, so a different
model shape or TP/PP fails at once with the differing fields rather than with a size-mismatch
traceback. Files are read with ``torch.load(weights_only=True)`` and an allowlist of the few
DeepSpeed classes its optimizer states contain, instead of unpickling arbitrary objects.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import shutil

import torch
import torch.distributed as dist

from megatron_ds import ds_compat
from megatron_ds.checkpoint import health, integrity, stacked_experts
from megatron_ds.checkpoint.format import (COMPLETENESS, EXPERT_PARALLEL_SIZE, EXPERT_TENSOR_PARALLEL_SIZE, META,
                                           TRACKER, atomic_write, checkpoint_tag, read_meta, read_tracker, step_dir,
                                           write_trackers)
from megatron_ds.checkpoint.health import HEALTH
from megatron_ds.checkpoint.reshard import LAYOUT_FIELDS, load_resharded, needs_reshard, optimizer_param_names
from megatron_ds.checkpoint.room import human_bytes
from megatron_ds.checkpoint.universal import UC_INFO, checkpoint_info, load_universal
from megatron_ds.checkpoint.vocabulary import VocabSettings, saved_tokenizer
from megatron_ds.config.family import UNRECORDED_FAMILY, ModelFamily
from megatron_ds.ds_compat import TorchCheckpointEngine
from megatron_ds.errors import ConfigError, TrainingStopped


def check_compatible(saved: dict, current: dict, path: str, *, load_optim: bool) -> None:
    """Raise ConfigError naming every field that differs."""
    # The interleaved schedule orders and groups parameters differently: its optimizer state only
    # fits an interleaved run with the same chunks, but its weights load anywhere (same layer files).
    optim_fields = ("data_parallel_size", "zero_stage", "precision", "virtual_pipeline_model_parallel_size")
    saved = {"virtual_pipeline_model_parallel_size": 1, **saved}  # checkpoints from before interleaving
    fields = [k for k in current if k not in optim_fields]
    if load_optim:
        # ZeRO and DeepSpeed's bf16 optimizer shard optimizer state over data parallel ranks: the
        # shard files only fit the same DP size, stage and precision.
        fields += [k for k in optim_fields if k in current]
    diffs = [f"{k}: checkpoint {saved.get(k)!r} vs now {current[k]!r}" for k in fields if saved.get(k) != current[k]
             and k != "model_family"]
    family = (saved.get("model_family", UNRECORDED_FAMILY), current.get("model_family", UNRECORDED_FAMILY))
    if family[0] != family[1]:
        diffs.insert(0, f"model_family: checkpoint {family[0]} vs now {family[1]} (pretrain_{family[0]}.py wrote it)")
    if diffs:
        hint = ("; or pass --no-load-optim to load the weights only" if any(
            saved.get(k) != current[k] for k in optim_fields if k in fields and k in current) else "")
        raise ConfigError(f"checkpoint {path} does not match this run ({'; '.join(diffs)}); use the "
                          f"checkpoint's settings (or convert the checkpoint){hint}")


def _is_zip(path: str) -> bool:
    """torch.save writes zip archives; a zeroed or foreign file is not one (and must not be
    reported as a pickle with forbidden objects)."""
    with open(path, "rb") as f:
        return f.read(4) == b"PK\x03\x04"


def _lost_write_error(path: str) -> OSError:
    """The OSError behind torch's "unexpected pos N vs M": its zip writer noticed that the file took
    fewer bytes than it wrote (a short write as the disk filled, seen on tmpfs) without the file
    raising. Appending to the (partial, to be discarded) file again surfaces the error itself."""
    try:
        with open(path, "ab") as f:
            f.write(bytes(1 << 16))
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        return OSError(exc.errno, exc.strerror, path)
    return OSError(errno.EIO, "the file took fewer bytes than were written to it", path)


class WeightsOnlyCheckpointEngine(TorchCheckpointEngine):
    """DeepSpeed's torch checkpoint engine, but loading with weights_only=True, and writing through a
    Python file so that a full disk is reported as the OSError it is (ENOSPC, EDQUOT, EIO: torch's
    own writer says only "unexpected pos 14976 vs 14868"). A write error is kept, not raised, so this
    rank still reaches the collectives of DeepSpeed's save; ``save_checkpoint`` then stops every rank
    with it (``take_write_error``)."""

    write_error: OSError | None = None
    # --async-save (``async_save.AsyncSaver``): while set, ``save`` hands each file's state to this
    # function (which copies it for the background writer) instead of writing it
    redirect = None

    def save(self, state_dict, path: str):
        if self.redirect is not None:
            self.redirect(state_dict, path)
            return
        if self.write_error is not None:
            return  # the disk is full (or gone): the files after the first failed one would fail too
        try:
            with open(path, "wb") as f:
                torch.save(state_dict, f, _use_new_zipfile_serialization=self.zipfile_serialization)
        except OSError as exc:
            self.write_error = exc if exc.filename else OSError(exc.errno, exc.strerror, path)
        except RuntimeError as exc:
            if "unexpected pos" not in str(exc):
                raise
            self.write_error = _lost_write_error(path)

    def makedirs(self, path, exist_ok=False):
        if self.write_error is None:
            try:
                super().makedirs(path, exist_ok=exist_ok)
            except OSError as exc:
                self.write_error = exc

    def take_write_error(self) -> OSError | None:
        error, self.write_error = self.write_error, None
        return error

    def load(self, path: str, map_location=None):
        with torch.serialization.safe_globals(ds_compat.checkpoint_safe_globals()):
            try:
                return torch.load(path, map_location=map_location, weights_only=True)
            except Exception as exc:  # noqa: BLE001 - re-raised with the file and the remedy
                if not _is_zip(path) or ("weights_only" not in str(exc) and "Unsupported global" not in str(exc)):
                    # a damaged file in a checkpoint without a manifest (older than manifests)
                    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                    raise ConfigError(f"cannot read checkpoint file {path}: {first}") from None
                raise ConfigError(f"refusing to unpickle {path}: it holds objects outside the allowlist "
                                  f"({str(exc).splitlines()[0]}). Only load checkpoints you trust; "
                                  f"this file was not written by megatron_ds") from None


def install_safe_loading(engine, log=print) -> None:
    """Swap DeepSpeed's default torch checkpoint engine for the weights-only one. Another engine
    configured in the JSON (a fast or decoupled writer) is left alone, with a note."""
    if ds_compat.is_default_checkpoint_engine(engine):
        safe = WeightsOnlyCheckpointEngine(config_params=ds_compat.engine_config(engine))
        ds_compat.set_checkpoint_engine(engine, safe)
    else:
        log(f"NOTE: checkpoint engine {type(ds_compat.checkpoint_engine(engine)).__name__} from the DeepSpeed JSON is "
            f"used as is (its loads are not restricted to weights_only)")


def save_checkpoint(engine, save_dir: str, iteration: int, *, client_state: dict, meta: dict,
                    family: ModelFamily, loss: float | None = None, room=None, log=print) -> None:
    """Write ``engine``'s checkpoint of ``iteration`` with ``meta`` (the run's record) and its manifest,
    then the trackers; ``family``: the run's model family. ``loss``: the iteration's
    loss, recorded with it; a non-finite loss, weight or optimizer-state value is not saved
    (``health.NonFiniteState``). A write error on any rank (a full disk) stops every rank with one
    line (``WriteFailure``; ``room``: a function giving the bytes one checkpoint needs, for that line,
    called only then). --keep-last's
    pruning is the caller's (``integrity.prune``): it waits until these weights gave a finite loss.
    ``async_save.AsyncSaver`` takes the same steps, the files written in the background."""
    client_state, meta = prepare_save(engine, iteration, client_state=client_state, meta=meta, family=family,
                                      loss=loss)
    tag = checkpoint_tag(iteration)
    failure = WriteFailure(save_dir, iteration, room)
    # every step ends with every rank knowing whether all ranks' writes succeeded (no rank waits in
    # a collective for one that raised); the trackers come last, after the manifest marks it complete
    failure.step(_write_files, engine, save_dir, tag, client_state, meta)
    failure.step(integrity.write_manifest, os.path.join(save_dir, tag), iteration)
    failure.step(track, save_dir, iteration, log)


def prepare_save(engine, iteration: int, *, client_state: dict, meta: dict, family: ModelFamily,
                 loss: float | None) -> tuple[dict, dict]:
    """Collective: (client state, record) of a save of ``iteration``, after the check that nothing
    saved is NaN/inf (raises ``health.NonFiniteState``)."""
    meta = {**meta, HEALTH: health.check_before_save(engine, iteration, loss)}
    # A plain torch optimizer's state is keyed by position: name the positions, so the checkpoint
    # can be resharded to another layout (megatron_ds/checkpoint/reshard.py).
    client_state = {**client_state, "optimizer_param_names": optimizer_param_names(engine)}
    # what DeepSpeed's ds_to_universal needs (megatron_ds/checkpoint/universal.py); not with MoE layers:
    # the converter cannot read expert files, and DeepSpeed's MoE save refuses the key in client state
    # (nor for a family whose parameters the patterns do not name: ModelFamily.universal_checkpoints)
    sig = meta.get("signature")
    universal = family.universal_checkpoints
    if sig is not None and EXPERT_PARALLEL_SIZE not in sig and universal:
        client_state[UC_INFO] = checkpoint_info(meta["signature"], meta.get("vocab_size"))
    return client_state, {**meta, COMPLETENESS[0]: COMPLETENESS[1]}


def save_engine_files(engine, save_dir: str, tag: str, client_state: dict, meta: dict) -> None:
    """DeepSpeed's files of ``engine`` (``save_checkpoint``) and the stacked experts' (``stacked_experts.save``)."""
    sig = meta.get("signature") or {}
    # Megatron-LM's expert grid with ETP below TP: its expert data parallel groups cross tensor parallel ranks
    grid = 1 < sig.get(EXPERT_TENSOR_PARALLEL_SIZE, 1) < sig.get("tensor_model_parallel_size", 1)
    with (ds_compat.module_files_on_data_parallel_rank_0(engine.mpu.get_data_parallel_rank()) if grid
          else contextlib.nullcontext()):
        engine.save_checkpoint(save_dir, tag=tag, client_state=client_state, save_latest=False)
    stacked_experts.save(engine, save_dir, tag)


def _write_files(engine, save_dir: str, tag: str, client_state: dict, meta: dict) -> None:
    """Every rank's DeepSpeed files, then rank 0's record of the run (complete only once the manifest exists)."""
    os.makedirs(save_dir, exist_ok=True)
    save_engine_files(engine, save_dir, tag, client_state, meta)
    writer = ds_compat.checkpoint_engine(engine)
    error = writer.take_write_error() if isinstance(writer, WeightsOnlyCheckpointEngine) else None
    if error is not None:
        raise error
    if dist.get_rank() == 0:
        atomic_write(os.path.join(save_dir, tag, META), json.dumps(meta, indent=2, default=str))


def track(save_dir: str, iteration: int, log) -> None:
    """rank 0, once the manifest is written: the trackers, then the interrupted saves moved aside are deleted."""
    if dist.get_rank() == 0:
        write_trackers(save_dir, iteration)
        integrity.prune(save_dir, iteration, None, log=log)  # the interrupted saves moved aside


class WriteFailure:
    """A save's write errors (ENOSPC, EDQUOT, EIO, ...: any OSError), agreed on by every rank: the
    first failing rank's error becomes one line on every rank, naming the directory, the room one
    checkpoint needs and the room left, and the previous checkpoint, which the failed save never
    touched (the trackers still point at it). The partial save is removed first: nothing can load
    it, and it holds the space the next attempt needs."""

    def __init__(self, save_dir: str, iteration: int, room):
        self.save_dir, self.iteration, self.room = save_dir, iteration, room

    def step(self, write, *args) -> None:
        """Collective: ``write(*args)`` on every rank; raises TrainingStopped on every rank if it failed on any."""
        try:
            write(*args)
            mine = None
        except OSError as exc:
            mine = (dist.get_rank(), exc.errno, exc.strerror or type(exc).__name__, exc.filename)
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, mine)
        first = next((e for e in errors if e is not None), None)
        if first is None:
            return
        box = [self._report(*first) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        raise TrainingStopped(box[0])

    def _report(self, rank: int, code: int | None, reason: str, filename: str | None) -> str:
        """rank 0: remove the partial save, then the line every rank raises."""
        path = step_dir(self.save_dir, self.iteration)
        who = f" on rank {rank}" if dist.get_world_size() > 1 else ""
        removed = ""
        if integrity.interrupted(path):
            integrity.discard(path)
            removed = f"; removed the partial {path}"
        free = human_bytes(shutil.disk_usage(_existing(self.save_dir)).free)
        room = self.room() if self.room is not None else None
        need = f", one checkpoint needs about {human_bytes(room)}" if room else ""
        remedy = "free space" if code in (errno.ENOSPC, errno.EDQUOT) else "check the filesystem"
        previous = read_tracker(self.save_dir)[0]  # the failed save never reached the trackers
        if previous is not None and previous != self.iteration:
            kept = step_dir(self.save_dir, previous)
            state = "is intact" if integrity.quick_status(kept) is None else "was not touched by this save"
            after = f"the previous checkpoint {kept} {state}: {remedy} (or choose another --save) and resume with " \
                    f"--load {self.save_dir}"
        else:
            after = f"{self.save_dir} holds no earlier checkpoint: {remedy} or choose another --save"
        return (f"saving checkpoint {self.iteration} to {self.save_dir} failed{who}: {reason} writing "
                f"{filename or self.save_dir} ({free} free{need}){removed}; {after}")


def _existing(path: str) -> str:
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def load_checkpoint(engine, settings, *, signature: dict, family: ModelFamily, ps=None,
                    vocab: dict | None = None, log=print) -> tuple[int, dict]:
    """Load the checkpoint that ``settings`` (the run's ``CheckpointConfig``) asks for: the newest
    complete one in --load, exactly --ckpt-step, or a DeepSpeed universal one. Returns (iteration,
    client_state); (0, {}) if there is none, iteration 0 with --finetune. A checkpoint of another
    layout (or an imported one) is resharded when ``ps`` (this run's ``ParallelState``) is given.
    ``family``: this run's model family; ``vocab``: this run's tokenizer
    (``vocabulary.tokenizer_record``), compared with the checkpoint's before a tensor is read."""
    vocab = VocabSettings(vocab, settings.allow_vocab_change)
    load_dir = settings.load
    load_optim = settings.load_optim and not settings.finetune
    if settings.universal_checkpoint:
        client = load_universal(engine, load_dir, signature=signature, ps=ps, load_optim=load_optim,
                                load_lr_state=settings.load_lr_state, family=family, vocab=vocab, log=log)
        iteration = client["iteration"]
        health.check_state(engine, load_dir)
    else:
        iteration = integrity.choose_checkpoint(load_dir, exact_step=settings.ckpt_step, log=log)
        if iteration is None:
            if settings.exit_on_missing_checkpoint:
                # Megatron's load_checkpoint exits here rather than train from random weights (its
                # status is 0; a path typo is reported here as the error it is)
                raise ConfigError(f"no checkpoint in --load {load_dir} (no {TRACKER}) and "
                                  f"--exit-on-missing-checkpoint is set")
            log(f"WARNING: no {TRACKER} in --load {load_dir}; starting from scratch")
            return 0, {}
        path = step_dir(load_dir, iteration)
        recorded = health.check_record(path, read_meta(path) if os.path.isfile(os.path.join(path, META)) else None)
        iteration, client = _load_step(engine, load_dir, iteration, signature=signature, ps=ps, family=family,
                                       load_optim=load_optim, load_lr_state=settings.load_lr_state, vocab=vocab,
                                       log=log)
        if not recorded:
            health.check_state(engine, path)
    return (0 if settings.finetune else iteration), client


def pretrained_start(settings, log=print):
    """--pretrained-checkpoint: ``settings`` (the parsed CheckpointConfig) loading that checkpoint as
    --finetune when --load holds none, as Megatron-LM's load_checkpoint falls back to it (training/
    checkpointing.py: ``checkpoint_exists`` is the tracker file); else ``settings`` unchanged."""
    pretrained, load = settings.pretrained_checkpoint, settings.load
    if pretrained is None or (load and os.path.isfile(os.path.join(load, TRACKER))):
        return settings
    if not os.path.isfile(os.path.join(pretrained, TRACKER)):
        raise ConfigError(f"no checkpoint in --load {load} nor in --pretrained-checkpoint {pretrained} "
                          f"(neither has {TRACKER})")
    log(f"no checkpoint in --load {load}: starting from --pretrained-checkpoint {pretrained} (weights only, "
        f"iteration 0, as --finetune)")
    return dataclasses.replace(settings, load=pretrained, finetune=True)


def saved_flags(settings, log=print) -> dict | None:
    """--use-checkpoint-args: the flags record of the checkpoint --load would load (``settings``: the
    parsed CheckpointConfig), or None if it has none (an imported checkpoint) or there is no checkpoint."""
    if not (settings.use_checkpoint_args and settings.load):
        return None
    iteration = integrity.choose_checkpoint(settings.load, exact_step=settings.ckpt_step, log=log)
    if iteration is None:
        return None
    path = step_dir(settings.load, iteration)
    return read_meta(path).get("config") if os.path.isfile(os.path.join(path, META)) else None


def _load_step(engine, load_dir: str, iteration: int, *, signature: dict, ps, family: ModelFamily,
               load_optim: bool, load_lr_state: bool, vocab: VocabSettings, log) -> tuple[int, dict]:
    """One ``global_stepN`` of ours: by DeepSpeed's own loader when the layout allows, else resharded
    (also to resize the vocabulary rows under --allow-vocab-change)."""
    path = step_dir(load_dir, iteration)
    if not os.path.isfile(os.path.join(path, META)):
        raise ConfigError(f"{os.path.join(path, META)} is missing: {load_dir} has a tracker for iteration "
                          f"{iteration} but not the checkpoint it points to")
    saved = read_meta(path)
    change = vocab.check(saved_tokenizer(saved), path=path, padded=signature["padded_vocab_size"], meta=saved, log=log)
    resize = change is not None and change.resizes
    if ps is not None and (resize or needs_reshard(saved, signature, load_optim=load_optim)):
        shape = {k: v for k, v in signature.items() if k not in LAYOUT_FIELDS}
        check_compatible(saved["signature"], shape, path, load_optim=False)
        client = load_resharded(engine, load_dir, iteration, ps=ps, padded_vocab_size=signature["padded_vocab_size"],
                                load_optim=load_optim, load_lr_state=load_lr_state, family=family,
                                vocab_change=change, log=log)
        return client.get("iteration", iteration), client
    check_compatible(saved["signature"], signature, path, load_optim=load_optim)
    # DeepSpeed (0.19) saves the bf16 optimizer's state under ZeRO-0 in its bf16_zero_* files but
    # reads it back from the module file, where it is not: load those files ourselves.
    sharded_without_zero = ds_compat.is_bf16_optimizer(engine.optimizer) and not engine.zero_optimization()
    tag = checkpoint_tag(iteration)
    # no_grad: DeepSpeed re-broadcasts tied weights in place while loading, which autograd would
    # otherwise record (and warn about in the next backward).
    with torch.no_grad():
        loaded, client_state = engine.load_checkpoint(
            load_dir, tag=tag, load_optimizer_states=load_optim and not sharded_without_zero,
            load_lr_scheduler_states=load_optim and load_lr_state, load_module_strict=True)
    if loaded is None:
        raise ConfigError(f"DeepSpeed could not load {path}")
    if not load_optim:  # weights only (--finetune, --no-load-optim): the masters take them too
        ds_compat.refresh_masters(engine.optimizer)
    if sharded_without_zero and load_optim and not ds_compat.load_bf16_optimizer_files(engine, load_dir, tag):
        raise ConfigError(f"{path} has no bf16 optimizer state files; pass --no-load-optim to load the weights only")
    log(f"loaded checkpoint {path} (iteration {iteration})")
    return iteration, client_state or {}
