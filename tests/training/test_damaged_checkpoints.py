"""Damaged and incomplete checkpoints through pretrain_gpt.py's main: each case either falls back
to the newest complete checkpoint (saying which file is wrong and how) or fails in one line.

One run writes global_step2/4/6; every case damages a copy of it and resumes to iteration 8.
The runs happen in one process after another (tests/training/cli.py) to pay for the imports once.
"""
import json
import os
import shutil
import zlib

import pytest

from megatron_ds.checkpoint.format import MANIFEST, TRACKER
from tests.distributed import run_distributed
from tests.training.cli import SMALL_GPT, cli_many, iterations

# A fixed decay span lets the resumed runs go further than the first without an LR-schedule mismatch.
ARGS = SMALL_GPT + ["--lr-decay-iters", "20", "--save-interval", "2"]


def _runs(argvs, world=1):
    return run_distributed(cli_many, world, argvs, timeout=900)[0]


def _crc(path):
    with open(path, "rb") as f:
        return zlib.crc32(f.read())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("base") / "ckpt")
    [(rc, out, err)] = _runs([ARGS + ["--train-iters", "6", "--save", ckpt]])
    assert rc == 0, err
    assert sorted(os.listdir(ckpt)) == ["global_step2", "global_step4", "global_step6", "latest", TRACKER]
    return ckpt


def _truncate(d):
    path = os.path.join(d, "global_step6", "mp_rank_00_model_states.pt")
    size = os.path.getsize(path)
    os.truncate(path, size // 2)
    return f"{path} has {size // 2} bytes, the manifest says {size} (truncated or rewritten)"


def _delete_layer(d):
    path = os.path.join(d, "global_step6", "layer_01-model_00-model_states.pt")
    os.remove(path)
    return f"{path} is missing"


def _zero(d):
    path = os.path.join(d, "global_step6", "layer_00-model_00-model_states.pt")
    with open(path, "r+b") as f:
        f.write(bytes(os.path.getsize(path)))
    return f"{path} fails its CRC-32 check"


DAMAGE = {"truncated": _truncate, "deleted_layer": _delete_layer, "zeroed": _zero}


def test_damaged_latest_falls_back_and_resumes(saved, tmp_path):
    """Three damaged copies of global_step6 and one that demands it with --ckpt-step: each run
    says what is wrong in one line, the first three resume from global_step4."""
    dirs, problems, argvs = {}, {}, []
    for name, damage in DAMAGE.items():
        dirs[name] = str(tmp_path / name)
        shutil.copytree(saved, dirs[name])
        problems[name] = damage(dirs[name])
        argvs.append(ARGS + ["--train-iters", "8", "--load", dirs[name], "--save", dirs[name]])
    exact = str(tmp_path / "exact")
    shutil.copytree(saved, exact)
    exact_problem = _truncate(exact)
    argvs.append(ARGS + ["--train-iters", "8", "--load", exact, "--save", exact, "--ckpt-step", "6"])

    results = _runs(argvs)
    for (name, d), (rc, out, err) in zip(dirs.items(), results):
        assert rc == 0, (name, err)
        assert f"WARNING: checkpoint damaged: {problems[name]}" in out, (name, out)
        assert "falling back to the newest complete checkpoint, iteration 4 (pass --ckpt-step 6" in out
        assert f"loaded checkpoint {d}/global_step4 (iteration 4)" in out
        assert [it for it, _ in iterations(out)] == [5, 6, 7, 8], name
        assert "Traceback" not in out + err
        # the damaged step was kept aside (not overwritten in place) and a fresh, complete one written
        assert os.path.isdir(os.path.join(d, "global_step6.damaged"))
        assert open(os.path.join(d, TRACKER)).read() == "8"
    rc, out, err = results[-1]
    assert rc == 1
    assert err.strip() == f"error: --ckpt-step 6: {exact_problem}"
    assert not iterations(out)


def test_tracker_damaged_or_deleted_uses_newest_complete_step(saved, tmp_path):
    """No usable tracker: the newest complete global_step* is loaded (never a restart from scratch
    that overwrites it); --keep-last then deletes only older complete checkpoints."""
    garbled, deleted, legacy = (str(tmp_path / n) for n in ("garbled", "deleted", "legacy"))
    for d in (garbled, deleted, legacy):
        shutil.copytree(saved, d)
    with open(os.path.join(garbled, TRACKER), "wb") as f:
        f.write(b"\xff\xfe6\x80")
    os.remove(os.path.join(deleted, TRACKER))
    os.remove(os.path.join(legacy, "global_step6", MANIFEST))  # as written before manifests existed:
    meta_path = os.path.join(legacy, "global_step6", "megatron_ds_config.json")  # no completeness entry either
    meta = json.load(open(meta_path))
    del meta["completeness"]
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    kept = {n: _crc(os.path.join(deleted, "global_step6", n)) for n in os.listdir(os.path.join(deleted, "global_step6"))}
    results = _runs([ARGS + ["--train-iters", "8", "--load", d, "--save", d] + extra
                     for d, extra in ((garbled, []), (deleted, ["--keep-last", "2"]), (legacy, []))])
    for (rc, out, err), d in zip(results, (garbled, deleted, legacy)):
        assert rc == 0, err
        assert f"loaded checkpoint {d}/global_step6 (iteration 6)" in out
        assert [it for it, _ in iterations(out)] == [7, 8]
    assert f"WARNING: {garbled}/{TRACKER} is not UTF-8 text (damaged)" in results[0][1]
    assert f"WARNING: no usable {TRACKER} in {deleted}: using the newest complete global_step*" in results[1][1]
    # --keep-last 2 after global_step8 completed: 6 and 8 stay, 2 and 4 are gone; 6 is untouched
    assert sorted(n for n in os.listdir(deleted) if n.startswith("global_step")) == ["global_step6", "global_step8"]
    assert {n: _crc(os.path.join(deleted, "global_step6", n)) for n in kept} == kept
    assert f"deleted checkpoint {deleted}/global_step2 (--keep-last 2)" in results[1][1]


def test_restart_from_scratch_never_overwrites(saved, tmp_path):
    """Forgetting --load on a directory with checkpoints is refused before iteration 1."""
    d = str(tmp_path / "ckpt")
    shutil.copytree(saved, d)
    before = json.load(open(os.path.join(d, "global_step2", MANIFEST)))
    [(rc, out, err)] = _runs([ARGS + ["--train-iters", "8", "--save", d]])
    assert rc == 1
    assert err.strip() == (f"error: --save {d} already holds a complete checkpoint at iteration 6, newer than "
                           f"this run's start (0), and would be overwritten: pass --load {d} to continue from "
                           f"it, or use another --save directory")
    assert not iterations(out)
    assert json.load(open(os.path.join(d, "global_step2", MANIFEST))) == before


def test_states_a_kill_during_a_save_leaves(saved, tmp_path):
    """What a kill -9 inside a save leaves (the files after the kill point missing: a save writes
    DeepSpeed's files, then the config, then the manifest, then the trackers), restarted with the
    same command (--load = --save): (a) killed in the very first save: start from scratch, the
    partial folder moved aside; (b) killed after the config, before the manifest: the tracker's
    checkpoint is loaded and the partial one moved aside, not mistaken for a complete newer one;
    (c) killed after the manifest, before the tracker: the finished checkpoint is loaded."""
    first, config_only, untracked = (str(tmp_path / n) for n in ("first", "config_only", "untracked"))
    os.makedirs(first)
    shutil.copytree(os.path.join(saved, "global_step2"), os.path.join(first, "global_step2"))
    os.remove(os.path.join(first, "global_step2", MANIFEST))
    shutil.copytree(saved, config_only)
    os.remove(os.path.join(config_only, "global_step6", MANIFEST))
    with open(os.path.join(config_only, TRACKER), "w") as f:
        f.write("4")
    shutil.copytree(saved, untracked)
    with open(os.path.join(untracked, TRACKER), "w") as f:
        f.write("4")
    past = os.path.getmtime(os.path.join(untracked, "global_step6", MANIFEST)) - 10
    os.utime(os.path.join(untracked, TRACKER), (past, past))
    (rc_a, out_a, err_a), (rc_b, out_b, err_b), (rc_c, out_c, err_c) = _runs(
        [ARGS + ["--train-iters", "8", "--load", d, "--save", d] for d in (first, config_only, untracked)])
    assert rc_a == 0, err_a
    assert f"WARNING: --load {first} holds only interrupted saves, no complete checkpoint; starting from scratch" \
           in out_a
    assert f"WARNING: moved the interrupted save {first}/global_step2 aside to {first}/global_step2.incomplete" \
           in out_a
    assert [it for it, _ in iterations(out_a)] == list(range(1, 9))
    assert rc_b == 0, err_b
    assert f"loaded checkpoint {config_only}/global_step4 (iteration 4)" in out_b
    assert f"WARNING: moved the interrupted save {config_only}/global_step6 aside" in out_b
    assert [it for it, _ in iterations(out_b)] == [5, 6, 7, 8]
    assert rc_c == 0, err_c
    assert f"loaded checkpoint {untracked}/global_step6 (iteration 6)" in out_c
    assert [it for it, _ in iterations(out_c)] == [7, 8]
    for d in (first, config_only, untracked):
        assert open(os.path.join(d, TRACKER)).read() == "8"
        # the next complete save deleted what was moved aside: repeated kills do not fill the disk
        assert not [name for name in os.listdir(d) if ".incomplete" in name], os.listdir(d)
    assert f"deleted the interrupted save {first}/global_step2.incomplete" in out_a
