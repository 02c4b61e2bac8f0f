"""A disk that fills up during a save, and the start-up check of the room --save has.

The disk is a real 2 MB tmpfs where a user namespace allows mounting one, else a stand-in that fails
file writes past the same budget (tests/training/small_disk.py says why and how). The 2-layer model
saves every iteration without --keep-last: four of its ~440 KB checkpoints fit, the fifth save finds
the disk full. Before, that save ended in a traceback ending "RuntimeError: [enforce fail at
inline_container.cc:672] . unexpected pos ..." that never said "No space left", and the start-up
check passed a disk 64 KB smaller than one checkpoint (its estimate left the files' overhead out)
printing "0.0 GB free, needs 0.0 GB" and suggesting --keep-last, which prunes only after a save.
"""
import errno
import os
import re

import pytest

from megatron_ds.checkpoint.format import TRACKER
from megatron_ds.checkpoint.room import human_bytes
from tests.distributed import run_distributed
from tests.training.cli import SMALL_GPT, cli_many, iterations
from tests.training.small_disk import fail_writes, run_story

UNITS = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9}


def _bytes(text):
    number, unit = text.split()
    return float(number) * UNITS[unit]


def _steps(listing):
    return [int(n[len("global_step"):]) for n in listing if n.startswith("global_step")]


def test_disk_full_during_a_save_then_resume(tmp_path):
    told, kind = run_story(tmp_path / "disk", tmp_path / "out", 2 << 20, SMALL_GPT + ["--save-interval", "1"],
                           timeout=1200)
    save = str(tmp_path / "disk" / "ckpt")
    rc, out, err = told["filled"]
    assert rc == 1 and "Traceback" not in err, (kind, err)
    warning = re.search(r"WARNING: --save (\S+) has room for (\d+) more checkpoints \((.+?) free, about (.+?) each\), "
                        r"but this run's 6 saves need room for 6 at once: a later save will fail with the disk "
                        r"full; pass --keep-last (\d+), or free space", out)
    assert warning and warning.group(1) == save and _bytes(warning.group(3)) > 2e6, out
    line = re.fullmatch(rf"error: saving checkpoint (\d+) to {save} failed: No space left on device writing "
                        rf"{save}/global_step\1/\S+\.pt \((.+) free, one checkpoint needs about (.+)\); removed the "
                        rf"partial {save}/global_step\1; the previous checkpoint {save}/global_step(\d+) is intact: "
                        rf"free space \(or choose another --save\) and resume with --load {save}", err.strip())
    assert line, (kind, err)
    failed, kept = int(line.group(1)), int(line.group(4))
    assert failed == kept + 1 and kept >= 3  # 2 MB holds three or four checkpoints
    assert _steps(told["after_filled"]) == list(range(1, failed)) and TRACKER in told["after_filled"]
    # what the disk had once the partial save was gone (less the run's lock file, removed at its exit)
    assert 0 <= told["free_after_filled"] - _bytes(line.group(2)) < 10_000
    assert told["newest_bytes"] < _bytes(line.group(3)) < 1.2 * told["newest_bytes"]  # about one checkpoint

    rc, out, err = told["short"]  # the disk now holds 64 KB less than one checkpoint
    assert told["free_short"] < told["newest_bytes"]
    short = re.fullmatch(rf"error: --save {save} has (.+) free, but one checkpoint needs about (.+) \(measured from "
                         rf"{save}/global_step{kept}\); free space or choose another --save", err.strip())
    assert rc == 1 and short and not iterations(out), err
    assert short.group(1) == human_bytes(told["free_short"]) and _bytes(short.group(2)) > told["newest_bytes"]

    rc, out, err = told["resumed"]  # room made: the previous checkpoint was intact
    assert rc == 0, err
    assert f"loaded checkpoint {save}/global_step{kept} (iteration {kept})" in out
    assert [it for it, _ in iterations(out)] == list(range(kept + 1, 7))
    assert _steps(told["after_resumed"]) == list(range(kept, 7))


def _cli_failing_on_rank1(rank, world_size, argvs, fragment):
    if rank == 1:
        fail_writes(fragment, errno.EIO)
    return cli_many(rank, world_size, argvs)


@pytest.mark.parametrize("background", [[], ["--async-save"]], ids=["synchronous", "async_save"])
def test_write_error_on_one_rank_stops_every_rank(tmp_path, background):
    """Two data parallel ranks under ZeRO-1 write their own optimizer shard; rank 1's disk fails (EIO)
    while writing its shard of global_step2. Rank 0 has nothing to fail on: it must not wait for rank 1
    forever, and both say the same line. With --async-save rank 1's background writer fails; both ranks
    stop with the same line once they find the save finished (after iteration 3, which trained meanwhile)."""
    save = str(tmp_path / "ckpt")
    argv = SMALL_GPT + ["--train-iters", "3", "--save", save, "--save-interval", "1", "--zero-stage", "1", *background]
    shard = "global_step2/zero_pp_rank_1_mp_rank_00_optim_states.pt"
    results = run_distributed(_cli_failing_on_rank1, 2, [argv], shard, timeout=900)
    [(rc0, _, err0)], [(rc1, out1, err1)] = results
    assert rc0 == rc1 == 1 and err0 == err1, (err0, err1)
    assert "Traceback" not in err0  # (its first lines: DeepSpeed's deprecation warning of ZeRO on gloo)
    assert re.fullmatch(rf"error: saving checkpoint 2 to {save} failed on rank 1: Input/output error writing "
                        rf"{save}/{shard} \(\S+ \S+ free, one checkpoint needs "
                        rf"about \S+ \S+\); removed the partial {save}/global_step2; the previous checkpoint "
                        rf"{save}/global_step1 is intact: check the filesystem \(or choose another --save\) and "
                        rf"resume with --load {save}", err0.strip().splitlines()[-1]), err0
    # the last rank prints the iteration lines
    assert [it for it, _ in iterations(out1)] == ([1, 2, 3] if background else [1, 2])


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs Linux's /dev/full")
def test_a_write_torch_only_calls_unexpected_pos_is_reported_as_the_disk_error(tmp_path, monkeypatch):
    """torch's zip writer reports a short write on a filling disk (tmpfs) as a RuntimeError "unexpected pos
    N vs M" without the file raising; the engine then asks the file itself (an append: /dev/full refuses it
    with ENOSPC, a healthy disk takes it, which leaves EIO) instead of letting the traceback through."""
    from megatron_ds.checkpoint import checkpointing

    def lost_bytes(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 152000 vs 151892")

    monkeypatch.setattr(checkpointing.torch, "save", lost_bytes)
    for path, code in (("/dev/full", errno.ENOSPC), (str(tmp_path / "model.pt"), errno.EIO)):
        engine = checkpointing.WeightsOnlyCheckpointEngine()
        engine.save({}, path)
        error = engine.take_write_error()
        assert (error.errno, error.filename) == (code, path)
