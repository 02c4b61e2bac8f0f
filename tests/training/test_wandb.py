"""W&B logging, offline (compute nodes often have no internet): the run files written with
WANDB_MODE=offline hold the same scalars, at the same steps, as the TensorBoard event file.

The offline run file (``offline-run-*/run-ID.wandb``) is read here without W&B's reader: it is a
LevelDB-style log (W&B's datastore format: a 7-byte ``:W&B`` header, then 32 KiB blocks of records with
a 7-byte header crc32/length/type) of ``wandb_internal_pb2.Record`` protobufs.
"""
from __future__ import annotations

import glob
import json
import os
import struct

import pytest

from tests.distributed import run_distributed
from tests.training.common import TINY_GPT, train_losses

wandb = pytest.importorskip("wandb")

BLOCK, HEADER = 32768, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _records(path: str) -> list[bytes]:
    data = open(path, "rb").read()
    assert data[:4] == b":W&B", data[:8]
    records, pending, pos = [], b"", HEADER
    while pos + HEADER <= len(data):
        if BLOCK - pos % BLOCK < HEADER:  # block trailer too short for a header: padding
            pos += BLOCK - pos % BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        chunk = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind == FULL:
            records.append(chunk)
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            records.append(pending + chunk)
    return records


def wandb_history(run_dir: str) -> dict[str, dict[int, float]]:
    from wandb.proto import wandb_internal_pb2

    history: dict[str, dict[int, float]] = {}
    for raw in _records(glob.glob(os.path.join(run_dir, "*.wandb"))[0]):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") != "history":
            continue
        items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
        step = items.pop("_step")
        for key, value in items.items():
            if not key.startswith("_"):
                history.setdefault(key, {})[step] = value
    return history


def tensorboard_scalars(log_dir: str) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir)
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def test_wandb_offline_logs_the_tensorboard_scalars(tmp_path):
    argv = TINY_GPT + ["--train-iters", "4", "--global-batch-size", "4", "--eval-interval", "2",
                       "--log-validation-ppl-to-tensorboard", "--tensorboard-dir", str(tmp_path / "tb"),
                       "--wandb-project", "megatron-ds-test", "--wandb-name", "tiny", "--wandb-entity", "lab",
                       "--wandb-save-dir", str(tmp_path / "wb")]
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true"}
    run_distributed(train_losses, 1, argv, timeout=600, env=env)
    runs = glob.glob(str(tmp_path / "wb" / "wandb" / "offline-run-*"))
    assert len(runs) == 1, runs
    logged = wandb_history(runs[0])
    tb = tensorboard_scalars(str(tmp_path / "tb"))
    assert set(logged) == set(tb) and {"lm loss", "learning-rate", "lm loss validation"} <= set(tb)
    for key, series in tb.items():
        assert set(logged[key]) == set(series), key
        for step, value in series.items():
            # TensorBoard stores float32, W&B the float64 the loop computed
            assert logged[key][step] == pytest.approx(value, rel=1e-6), (key, step)
    assert sorted(tb["lm loss"]) == [1, 2, 3, 4]
