"""--async-save's pieces without a training run: the snapshot (what a background save copies while
training waits), the writer processes, and the flags. The training runs are in tests/training/
(test_kill_loop.py: kills and losses; test_signals.py: SIGTERM while a save is written)."""
import io
import mmap
import os
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_ds.checkpoint.background import NAME, ForkedWriter, Job, PersistentWriter
from megatron_ds.checkpoint.integrity import crc32_file
from megatron_ds.checkpoint.snapshot import Snapshot, restore
from tests.launch.helpers import REPO, clean_env


def _state():
    flat = torch.arange(12, dtype=torch.float32)
    param = torch.nn.Parameter(torch.randn(3, 4, dtype=torch.bfloat16))
    return {"weights": {"a": flat[:6], "b": flat[6:].view(2, 3), "t": flat[::2]},  # views of one storage
            "param": param, "tied": param, "moments": [torch.ones(5), torch.zeros(0)],
            "rng": (np.random.RandomState(3).get_state(), 7, "text"), "step": 4}


def _restored(snapshot: Snapshot):
    arena = mmap.mmap(snapshot.fd, snapshot.nbytes, access=mmap.ACCESS_COPY)
    return restore(snapshot.files, snapshot.storages, arena)


def test_snapshot_copies_tensors_off_training_and_keeps_their_aliasing():
    state = _state()
    snapshot = Snapshot()
    snapshot.add(state, "file.pt")
    expected = {"flat": torch.arange(12, dtype=torch.float32), "param": state["param"].detach().clone()}
    # training goes on: every buffer changes in place after the snapshot
    with torch.no_grad():
        state["weights"]["a"].add_(100)
        state["weights"]["b"].mul_(-1)
        state["param"].zero_()
        state["moments"][0].fill_(9)
    state["rng"] = None
    [(path, copy)] = _restored(snapshot)
    assert path == "file.pt"
    assert torch.equal(copy["weights"]["a"], expected["flat"][:6])
    assert torch.equal(copy["weights"]["b"], expected["flat"][6:].view(2, 3))
    assert torch.equal(copy["weights"]["t"], expected["flat"][::2]) and copy["weights"]["t"].stride() == (2,)
    # views share one copied storage, as they shared the original: torch.save writes it once, as before
    assert copy["weights"]["a"].untyped_storage().data_ptr() == copy["weights"]["b"].untyped_storage().data_ptr()
    assert isinstance(copy["param"], torch.nn.Parameter) and copy["param"].dtype == torch.bfloat16
    assert torch.equal(copy["param"], expected["param"]) and copy["tied"] is copy["param"]
    assert torch.equal(copy["moments"][0], torch.ones(5)) and copy["moments"][1].numel() == 0
    assert copy["rng"][0][0] == "MT19937" and copy["rng"][1:] == (7, "text") and copy["step"] == 4
    # what torch.save writes from the copy loads as what it would have written from the original
    saved = io.BytesIO()
    torch.save(copy, saved)
    loaded = torch.load(io.BytesIO(saved.getvalue()), weights_only=False)
    assert torch.equal(loaded["weights"]["b"], expected["flat"][6:].view(2, 3))
    assert loaded["weights"]["a"].untyped_storage().data_ptr() == loaded["weights"]["b"].untyped_storage().data_ptr()
    snapshot.close()


def _snapshot_of_two_files(folder: Path) -> tuple[Snapshot, dict]:
    snapshot = Snapshot()
    states = {folder / "model.pt": {"w": torch.randn(64, 64)}, folder / "optim.pt": {"m": torch.randn(1000), "n": 1}}
    for path, state in states.items():
        snapshot.add(state, str(path))
    return snapshot, states


@pytest.mark.parametrize("kind", [ForkedWriter, PersistentWriter])
def test_a_writer_writes_the_files_and_answers_their_crcs(tmp_path, kind):
    snapshot, states = _snapshot_of_two_files(tmp_path)
    writer = kind()
    try:
        writer.submit(Job(str(tmp_path), True, (str(tmp_path / "record.json"), '{"a": 1}')), snapshot)
        deadline = time.time() + 60
        while not writer.done() and time.time() < deadline:
            time.sleep(0.01)
        answer = writer.result()
    finally:
        writer.close()
        snapshot.close()
    files = answer["files"]
    assert set(files) == {"model.pt", "optim.pt", "record.json"} and answer["seconds"] >= 0
    for name, (size, crc) in files.items():
        assert (size, crc) == (os.path.getsize(tmp_path / name), crc32_file(str(tmp_path / name)))
    for path, state in states.items():
        loaded = torch.load(path, weights_only=True)
        assert all(torch.equal(loaded[k], v) if isinstance(v, torch.Tensor) else loaded[k] == v for k, v in state.items())
    assert (tmp_path / "record.json").read_text() == '{"a": 1}' and zlib.crc32(b'{"a": 1}') == files["record.json"][1]


def test_a_persistent_writer_serves_several_saves_and_reports_a_write_error(tmp_path):
    writer = PersistentWriter()
    try:
        for n in range(2):
            folder = tmp_path / f"save{n}"
            folder.mkdir()
            snapshot, _ = _snapshot_of_two_files(folder)
            writer.submit(Job(str(folder), True, None), snapshot)
            assert set(writer.result()["files"]) == {"model.pt", "optim.pt"}
            snapshot.close()
        snapshot, _ = _snapshot_of_two_files(tmp_path / "gone")  # a folder that does not exist: an OSError
        writer.submit(Job(str(tmp_path / "gone"), True, None), snapshot)
        code, reason, filename = writer.result()["error"]
        assert reason == "No such file or directory" and filename == str(tmp_path / "gone" / "model.pt")
        snapshot.close()
    finally:
        writer.close()
    assert not writer.process.is_alive()


ORPHAN_PROBE = """
import time
from megatron_ds.checkpoint.background import PersistentWriter
writer = PersistentWriter()
print(writer.process.pid, flush=True)
time.sleep(600)
"""


def test_a_writer_dies_with_its_trainer_and_ignores_stop_signals(tmp_path):
    """kill -9 of the trainer (an OOM kill, a node's job killed) ends its writer at once: no writer of
    a dead job goes on writing into a folder the next run uses. Stop signals, which reach it with the
    trainer's process group, do not end it (the trainer waits for it before exiting)."""
    proc = subprocess.Popen([sys.executable, "-c", ORPHAN_PROBE], stdout=subprocess.PIPE, text=True, cwd=REPO,
                            env=clean_env(), start_new_session=True)
    try:
        pid = int(proc.stdout.readline())
        # the writer names itself once forked, after setting its signals (background._become_writer)
        deadline = time.time() + 10
        while Path(f"/proc/{pid}/comm").read_text().strip() != NAME and time.time() < deadline:
            time.sleep(0.02)
        assert Path(f"/proc/{pid}/comm").read_text().strip() == NAME
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            os.kill(pid, sig)
        time.sleep(0.3)
        assert _alive(pid)
        proc.kill()
        proc.wait()
        deadline = time.time() + 10
        while _alive(pid) and time.time() < deadline:
            time.sleep(0.05)
        assert not _alive(pid)
    finally:
        if proc.poll() is None:
            proc.kill()


def _alive(pid: int) -> bool:
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def test_the_flags_parse_and_resolve():
    from megatron_ds.config import parse_args
    from megatron_ds.config.validation import check_async_save

    flags, _ = parse_args(["--async-save", "--use-persistent-ckpt-worker"])
    assert flags.checkpoint.async_save and flags.checkpoint.use_persistent_ckpt_worker
    assert check_async_save(flags.checkpoint, None) == []
    alone, _ = parse_args(["--use-persistent-ckpt-worker"])
    assert check_async_save(alone.checkpoint, None) == [
        "--use-persistent-ckpt-worker has no effect without --async-save (as in Megatron-LM)"]
    from megatron_ds.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^--async-save .*\"datastates_ckpt\" block"):
        check_async_save(flags.checkpoint, {"datastates_ckpt": {}})
