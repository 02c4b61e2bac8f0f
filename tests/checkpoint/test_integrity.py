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


def _kill_after(d, written_last: str):
    """The state a kill leaves when a save of this toolkit got as far as `written_last`: the files
    are written in order -- DeepSpeed's, then the config (META), then the manifest -- so the ones
    after the kill point are simply not there."""
    import json

    (d / ci_format.MANIFEST).unlink()
    meta = json.loads((d / ci_format.META).read_text())
    (d / ci_format.META).write_text(json.dumps({**meta, ci_format.COMPLETENESS[0]: ci_format.COMPLETENESS[1]}))
    if written_last == "deepspeed":
        (d / ci_format.META).unlink()


def test_only_the_manifest_makes_a_checkpoint_complete(tmp_path):
    """META without a manifest is an interrupted save, unless META predates manifests (no
    COMPLETENESS entry, no half-written manifest): such checkpoints still load unverified."""
    for step in (2, 4):
        _checkpoint(tmp_path, step)
    _kill_after(_checkpoint(tmp_path, 6), "meta")
    (tmp_path / ci_format.TRACKER).write_text("4")
    assert ci.interrupted(str(tmp_path / "global_step6"))
    assert "its save was interrupted" in ci.quick_status(str(tmp_path / "global_step6"))
    assert ci.choose_checkpoint(str(tmp_path), log=lambda m: None) == 4
    notes = []
    ci.protect_newer(str(tmp_path), 4, log=notes.append)  # not "a complete checkpoint newer than the start"
    assert sorted(os.listdir(tmp_path)) == ["global_step2", "global_step4", "global_step6.incomplete",
                                            ci_format.TRACKER]
    assert notes[0].startswith(f"WARNING: moved the interrupted save {tmp_path}/global_step6 aside to ")
    legacy = _checkpoint(tmp_path / "old", 8, manifest=False)  # from before manifests: META {} alone
    assert not ci.interrupted(str(legacy)) and ci.verify(str(legacy)) is None
    (legacy / f"{ci_format.MANIFEST}.tmp.123").write_text("{")  # but a manifest was being written
    assert ci.interrupted(str(legacy))


def test_a_kill_during_the_first_save_starts_from_scratch(tmp_path):
    _kill_after(_checkpoint(tmp_path, 1), "deepspeed")
    _kill_after(_checkpoint(tmp_path, 2), "meta")  # (two runs killed in their first save)
    notes = []
    assert ci.choose_checkpoint(str(tmp_path), log=notes.append) is None
    assert notes[-1] == f"WARNING: --load {tmp_path} holds only interrupted saves, no complete checkpoint; " \
                        f"starting from scratch"
    ci.protect_newer(str(tmp_path), 0, log=notes.append)
    assert sorted(os.listdir(tmp_path)) == ["global_step1.incomplete", "global_step2.incomplete"]
    # with a tracker, something complete existed: an error, never a silent restart
    _kill_after(_checkpoint(tmp_path / "t", 3), "meta")
    (tmp_path / "t" / ci_format.TRACKER).write_text("3")
    import pytest

    from megatron_ds.errors import ConfigError

    with pytest.raises(ConfigError, match="no complete checkpoint in --load"):
        ci.choose_checkpoint(str(tmp_path / "t"), log=lambda m: None)


def test_a_save_finished_before_its_tracker_update_is_loaded(tmp_path):
    """Killed between the manifest and the tracker: the newer checkpoint is complete and is loaded
    (refusing to overwrite it would block every restart). A tracker edited back by hand later than
    every manifest is a deliberate rollback and is followed."""
    import time

    for step in (2, 4):
        _checkpoint(tmp_path, step)
    (tmp_path / ci_format.TRACKER).write_text("4")
    past = time.time() - 100
    os.utime(tmp_path / ci_format.TRACKER, (past, past))
    _checkpoint(tmp_path, 6)  # its manifest is newer than the tracker
    notes = []
    assert ci.choose_checkpoint(str(tmp_path), log=notes.append) == 6
    assert notes == [f"WARNING: global_step6 was saved completely after {ci_format.TRACKER} (4) was last written "
                     f"(the job was killed before updating it): trying it first"]
    (tmp_path / ci_format.TRACKER).write_text("4")  # a person rolls back, after every manifest
    assert ci.choose_checkpoint(str(tmp_path), log=lambda m: None) == 4


def test_prune_interrupted_by_a_kill_leaves_no_damaged_checkpoint(tmp_path):
    for step in (2, 4, 6):
        _checkpoint(tmp_path, step)
    os.rename(tmp_path / "global_step2", tmp_path / f"global_step2{ci.DELETING}")  # a kill inside rmtree
    os.remove(tmp_path / f"global_step2{ci.DELETING}" / "sub" / "x.pt")
    ci.prune(str(tmp_path), 6, 1, log=lambda m: None)
    assert sorted(os.listdir(tmp_path)) == ["global_step6"]


def test_a_complete_save_deletes_the_interrupted_saves_moved_aside(tmp_path):
    """A job killed inside its saves again and again: each restart moves the interrupted save aside
    (global_stepN.incomplete, then .incomplete2 ...); the next complete save deletes them (nothing loads
    from them) and keeps a damaged checkpoint for a person to look at."""
    for step in (2, 4):
        _checkpoint(tmp_path, step)
    for _ in range(2):  # killed twice while saving iteration 6
        _kill_after(_checkpoint(tmp_path, 6), "meta")
        ci.protect_newer(str(tmp_path), 4, log=lambda m: None)
    damaged = _checkpoint(tmp_path, 8)
    os.remove(damaged / "sub" / "x.pt")
    ci.protect_newer(str(tmp_path), 4, log=lambda m: None)
    assert sorted(os.listdir(tmp_path)) == ["global_step2", "global_step4", "global_step6.incomplete",
                                            "global_step6.incomplete2", "global_step8.damaged"]
    _checkpoint(tmp_path, 6)  # the third attempt completes
    notes = []
    ci.prune(str(tmp_path), 6, None, log=notes.append)
    assert sorted(os.listdir(tmp_path)) == ["global_step2", "global_step4", "global_step6", "global_step8.damaged"]
    assert notes == [f"deleted the interrupted save {tmp_path}/global_step6.incomplete{n} (checkpoint 6 is complete)"
                     for n in ("", "2")]
