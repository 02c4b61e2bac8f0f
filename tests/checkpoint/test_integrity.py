"""The manifest rules on hand-made checkpoint folders (one process, no training): what counts as
complete, what --keep-last may delete, and the order in which --load tries checkpoints."""
import os
import zlib

from megatron_ds.checkpoint import format as ci_format
from megatron_ds.checkpoint import integrity as ci


def _checkpoint(root, step, files=None, manifest=True):
    d = root / f"global_step{step}"
    d.mkdir(parents=True)
    for name, data in (files or {"mp_rank_00_model_states.pt": os.urandom(3000), "sub/x.pt": b"abc"}).items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_bytes(data)
    (d / ci_format.META).write_text("{}")
    if manifest:
        ci.write_manifest(str(d), step)
    return d


def test_manifest_records_sizes_and_crc32(tmp_path):
    data = os.urandom(5000)
    d = _checkpoint(tmp_path, 3, {"a.pt": data})
    import json
    manifest = json.loads((d / ci_format.MANIFEST).read_text())
    assert manifest["files"]["a.pt"] == {"size": 5000, "crc32": f"{zlib.crc32(data):08x}"}
    assert ci_format.META in manifest["files"] and manifest["iteration"] == 3
    assert ci.verify(str(d)) is None


def test_a_flipped_byte_is_found(tmp_path):
    d = _checkpoint(tmp_path, 3)
    path = d / "mp_rank_00_model_states.pt"
    raw = bytearray(path.read_bytes())
    raw[1500] ^= 0x01
    path.write_bytes(bytes(raw))
    assert ci.quick_status(str(d)) is None  # same size: only the checksum sees it
    assert ci.verify(str(d)) == f"{path} fails its CRC-32 check (contents changed since the save: damaged or zeroed)"


def test_keep_last_deletes_only_complete_older_checkpoints(tmp_path):
    for step in (2, 4, 6, 8):
        _checkpoint(tmp_path, step)
    os.remove(tmp_path / "global_step4" / "sub" / "x.pt")  # damaged: kept for a person to look at
    _checkpoint(tmp_path, 10, manifest=False)  # newer than the save being pruned after: untouched
    deleted = []
    ci.prune(str(tmp_path), 8, 2, log=deleted.append)
    assert sorted(os.listdir(tmp_path)) == ["global_step10", "global_step4", "global_step6", "global_step8"]
    assert deleted == [f"deleted checkpoint {tmp_path}/global_step2 (--keep-last 2)"]


def test_candidates_follow_tracker_then_older(tmp_path):
    for step in (2, 4, 6):
        _checkpoint(tmp_path, step)
    (tmp_path / ci_format.TRACKER).write_text("4")
    assert ci.choose_checkpoint(str(tmp_path), log=lambda m: None) == 4  # 6 is not trusted past the tracker
    (tmp_path / ci_format.TRACKER).write_text("banana")
    notes = []
    assert ci.choose_checkpoint(str(tmp_path), log=notes.append) == 6
    assert notes[0] == f"WARNING: {tmp_path}/{ci_format.TRACKER} should hold an iteration number, found 'banana'"
    legacy = _checkpoint(tmp_path / "old", 9, manifest=False)  # before manifests: loads unverified
    assert ci.verify(str(legacy)) is None
    os.remove(legacy / ci_format.META)  # neither manifest nor config: an interrupted save
    assert "is incomplete" in ci.verify(str(legacy))


def test_newer_checkpoints_are_never_overwritten(tmp_path):
    import pytest

    from megatron_ds.errors import ConfigError

    for step in (2, 4, 6):
        _checkpoint(tmp_path, step)
    os.truncate(tmp_path / "global_step6" / "mp_rank_00_model_states.pt", 10)
    notes = []
    # going back to 2 on purpose (e.g. the tracker edited after a loss spike): 4 is complete, so no
    with pytest.raises(ConfigError, match=r"complete checkpoint at iteration 4, newer than this run's start \(2\).*"
                                          r"to go back to iteration 2 on purpose, move .*global_step4"):
        ci.protect_newer(str(tmp_path), 2, log=notes.append)
    # the damaged 6 was moved aside on the way (a damaged checkpoint is not worth refusing for)
    assert os.path.isdir(tmp_path / "global_step6.damaged") and "moved the damaged checkpoint" in notes[0]
    ci.protect_newer(str(tmp_path), 4, log=notes.append)  # resuming from the newest: nothing to protect
