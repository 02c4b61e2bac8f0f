"""--async-save (Megatron-LM's flag): a checkpoint written by a background process while training goes on,
with the guarantees of a synchronous save (``checkpointing.save_checkpoint``).

A save has a synchronous half and a background half:

* in the training process, collectively, training waiting: the check that nothing saved is NaN/inf,
  DeepSpeed's ``save_checkpoint`` with its checkpoint engine redirected so that each file's state dict
  is copied (``snapshot.Snapshot``: tensors copied off the training's buffers into a memory file, the
  rest pickled), and the hand-over to a writer process (``background``);
* in the writer: serialisation (``torch.save``), CRC-32 and fsync of every file, rank 0's record of the run.

The training process asks at every iteration whether every rank's writer has answered (one small
all-reduce, only while a save is in flight, as Megatron-LM's ``maybe_finalize_async_save``); once they
all have, it finalises collectively: the manifest (from the writers' CRCs: nothing is read back), then
the trackers -- the same last two steps, in the same order, as a synchronous save. So a checkpoint is
complete exactly when its manifest exists, and a kill -9 at any moment leaves at worst an interrupted
save beside the previous complete checkpoint, which the trackers still name. The next save, and the end
of the run (a stop signal included), wait for a save in flight and finalise it first; one save is in
flight at most. A writer's error (a full disk) stops every rank as a synchronous save's does, in one
line, with the partial folder removed.
"""
from __future__ import annotations

import json
import os
import time
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_ds import ds_compat
from megatron_ds.checkpoint import integrity
from megatron_ds.checkpoint.background import ForkedWriter, Job, PersistentWriter
from megatron_ds.checkpoint.checkpointing import (WeightsOnlyCheckpointEngine, WriteFailure, prepare_save,
                                                  save_engine_files, track)
from megatron_ds.checkpoint.format import META, checkpoint_tag, step_dir
from megatron_ds.checkpoint.room import human_bytes
from megatron_ds.checkpoint.snapshot import Snapshot
from megatron_ds.config.family import ModelFamily
from megatron_ds.errors import ConfigError

RECENT = 10  # iterations before a save whose mean time the save's line compares with


@dataclass
class _InFlight:
    iteration: int
    writer: object  # ForkedWriter | PersistentWriter
    snapshot: Snapshot
    failure: WriteFailure
    on_complete: object
    started: float
    step_seconds: list = field(default_factory=list)  # the iterations trained while it was written


class AsyncSaver:
    """The background saves of one run into ``save_dir`` (see the module docstring). ``persistent``: the
    run's ``PersistentWriter`` (--use-persistent-ckpt-worker), else a process is forked per save.
    ``device``: where the all-reduce of "written yet?" runs (the engine's)."""

    def __init__(self, engine, save_dir: str, *, family: ModelFamily, device, persistent: PersistentWriter | None,
                 room=None, log=print):
        writer = ds_compat.checkpoint_engine(engine)
        if not isinstance(writer, WeightsOnlyCheckpointEngine):
            raise ConfigError(f"--async-save writes through megatron_ds's checkpoint engine; the DeepSpeed JSON's "
                              f"{type(writer).__name__} cannot be combined with it: drop one of them")
        self.engine, self.writer, self.save_dir, self.family = engine, writer, save_dir, family
        self.device, self.persistent, self.room, self.log = device, persistent, room, log
        self.in_flight: _InFlight | None = None
        self.recent = deque(maxlen=RECENT)  # seconds of the latest iterations trained with no save in flight

    def save(self, iteration: int, *, client_state: dict, meta: dict, loss: float | None, on_complete) -> None:
        """Collective: snapshot ``iteration``'s state and start writing it; ``on_complete(iteration)`` is
        called once it is complete (manifest and trackers written)."""
        self.wait(f"before saving iteration {iteration}")
        start = time.monotonic()
        client_state, meta = prepare_save(self.engine, iteration, client_state=client_state, meta=meta,
                                          family=self.family, loss=loss)
        failure = WriteFailure(self.save_dir, iteration, self.room)
        box = []
        failure.step(self._snapshot, iteration, client_state, meta, box)
        snapshot, job = box
        writer = self.persistent or ForkedWriter()
        writer.submit(job, snapshot)
        paused = time.monotonic() - start
        self.in_flight = _InFlight(iteration, writer, snapshot, failure, on_complete, time.monotonic())
        self.log(f"saving checkpoint at iteration {iteration} to {self.save_dir} in the background (training "
                 f"paused {paused * 1000:.1f} ms to copy {human_bytes(snapshot.nbytes)} of state)")

    def _snapshot(self, iteration: int, client_state: dict, meta: dict, box: list) -> None:
        """DeepSpeed's save, every file's state copied instead of written (its folders are made)."""
        tag = checkpoint_tag(iteration)
        os.makedirs(self.save_dir, exist_ok=True)
        snapshot = Snapshot()
        self.writer.redirect = snapshot.add
        try:
            save_engine_files(self.engine, self.save_dir, tag, client_state, meta)
        except BaseException:
            snapshot.close()
            raise
        finally:
            self.writer.redirect = None
        ckpt_dir = step_dir(self.save_dir, iteration)
        record = (os.path.join(ckpt_dir, META), _record_text(meta)) if dist.get_rank() == 0 else None
        box[:] = [snapshot, Job(ckpt_dir, self.writer.zipfile_serialization, record)]

    def after_iteration(self, seconds: float) -> None:
        """Collective (while a save is in flight): count the iteration that took ``seconds``; finalise the
        save once every rank's writer has answered."""
        if self.in_flight is None:
            self.recent.append(seconds)
            return
        self.in_flight.step_seconds.append(seconds)
        flag = torch.tensor([1 if self.in_flight.writer.done() else 0], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if flag.item():
            self._finalise()

    def wait(self, why: str) -> None:
        """Collective: finish the save in flight, if any (``why``: what waits, for the line saying so)."""
        if self.in_flight is None:
            return
        if not self.in_flight.writer.done():
            self.log(f"waiting for checkpoint {self.in_flight.iteration}, still being written in the background, "
                     f"{why}")
        self._finalise()

    def _finalise(self) -> None:
        """Collective: the writers' answers, then the manifest and the trackers (or every rank stops)."""
        fl, self.in_flight = self.in_flight, None
        answer = fl.writer.result()
        fl.snapshot.close()
        ckpt_dir = step_dir(self.save_dir, fl.iteration)
        fl.failure.step(_raise_error, answer)
        known = {}
        for files in _gather(answer["files"]):
            known.update(files)
        fl.failure.step(integrity.write_manifest, ckpt_dir, fl.iteration, known)
        fl.failure.step(track, self.save_dir, fl.iteration, self.log)
        complete = time.monotonic() - fl.started
        self.log(f"saved checkpoint at iteration {fl.iteration} to {self.save_dir} "
                 f"({self._timing(fl, answer['seconds'], complete)})")
        fl.on_complete(fl.iteration)

    def _timing(self, fl: _InFlight, writing: float, complete: float) -> str:
        """What the save cost: this rank's time writing in the background, and the iterations trained
        until it was found complete (``complete`` s after the snapshot)."""
        line = f"written in the background in {writing:.2f} s, complete {complete:.2f} s after the snapshot"
        steps = fl.step_seconds
        if steps:
            line += (f"; {len(steps)} iteration{'s' if len(steps) > 1 else ''} trained meanwhile at "
                     f"{sum(steps) / len(steps) * 1000:.1f} ms each")
            if self.recent:
                line += f" ({sum(self.recent) / len(self.recent) * 1000:.1f} ms each before the save)"
        return line

    def close(self) -> None:
        """At the end of the run: a save still in flight (an error ended the run) is abandoned, its writer
        killed; what it wrote is an interrupted save, which the next run moves aside."""
        if self.in_flight is not None:
            if self.in_flight.writer is not self.persistent:
                self.in_flight.writer.close()
            self.in_flight.snapshot.close()
            self.in_flight = None


def _record_text(meta: dict) -> str:
    """META's text, as ``checkpointing`` writes it."""
    return json.dumps(meta, indent=2, default=str)


def _raise_error(answer: dict) -> None:
    if "error" in answer:
        code, reason, filename = answer["error"]
        raise OSError(code, reason, filename)


def _gather(obj) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj if obj is not None else {})
    return out
