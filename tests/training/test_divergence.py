"""A diverged run never replaces its last good checkpoint, and a diverged checkpoint is not resumed.

The divergence is real: the 2-layer model trains 4 iterations at --lr 1e-3 and saves; the run that
continues from it at --lr 1e6 (as a bad restart flag would) blows the weights up at its first step,
and from iteration 7 every loss is NaN while the weights stay finite but huge (every later step has a
non-finite gradient and is skipped, so nothing brings them back). With --save-interval 1 and
--keep-last 2 the run used to save the NaN-loss iterations and prune global_step4 away; resumed, it
trained on NaN with exit status 0. The runs happen one after another in one process
(tests/training/cli.py) to pay for the imports once.
"""
import json
import math
import os
import re
import shutil

import pytest
import torch

from megatron_ds.checkpoint import integrity
from megatron_ds.checkpoint.format import META, TRACKER, step_dir
from tests.distributed import run_distributed
from tests.training.cli import SMALL_GPT, cli_many

DIVERGE = ["--lr", "1e6", "--override-lr-scheduler", "--train-iters", "40", "--save-interval", "1", "--keep-last", "2"]
REMEDY = "lower --lr, check the data, or use --bf16 instead of --fp16"
LINE = re.compile(r"^ iteration\s+(\d+)/.* number of nan iterations:\s+(\d+) \|", re.M)
LOSS = re.compile(r"\| lm loss: (\S+) \|")


def _losses(stdout):
    """{iteration: printed loss, or "nan" where the line counts a NaN iteration} (--log-interval 1:
    Megatron's line leaves the loss out when every iteration since the last line was NaN)."""
    out = {}
    for line in stdout.splitlines():
        if (m := LINE.match(line)):
            out[int(m.group(1))] = "nan" if int(m.group(2)) else LOSS.search(line).group(1)
    return out


def _runs(argvs):
    return run_distributed(cli_many, 1, argvs, timeout=900)[0]


def _steps(d):
    return sorted(n for n in os.listdir(d) if n.startswith("global_step"))


def _all_finite(path):
    """Every floating-point tensor of every file of a checkpoint, read back from disk."""
    def tensors(obj):
        if torch.is_tensor(obj):
            yield obj
        elif isinstance(obj, dict):
            for v in obj.values():
                yield from tensors(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                yield from tensors(v)
    return all(torch.isfinite(t).all() for f in os.listdir(path) if f.endswith(".pt")
               for t in tensors(torch.load(os.path.join(path, f), weights_only=False)) if t.is_floating_point())


@pytest.fixture(scope="module")
def diverged(tmp_path_factory):
    """(D, the diverging run's result, a copy of D as it was before the diverging run)."""
    d = str(tmp_path_factory.mktemp("div") / "ckpt")
    good = SMALL_GPT + ["--train-iters", "4", "--save", d, "--save-interval", "4"]
    [(rc, out, err)] = _runs([good])
    assert rc == 0, err
    before = d + ".before"
    shutil.copytree(d, before)
    [result] = _runs([SMALL_GPT + DIVERGE + ["--load", d, "--save", d]])
    return d, result, before


def test_diverging_run_stops_before_saving_nan_and_keeps_the_good_checkpoint(diverged):
    d, (rc, out, err), _ = diverged
    losses = _losses(out)
    assert sorted(losses) == [5, 6, 7] and float(losses[5]) < 10
    assert float(losses[6]) > 1e6 and all(losses[i] == "nan" for i in losses if i >= 7)  # it did diverge
    assert rc == 1 and "Traceback" not in err
    assert err.strip() == (f"error: training diverged: the loss of iteration 7 is nan; stopping without saving. "
                           f"The loss was NaN/inf at every iteration since {d}/global_step6 (its weights "
                           f"diverged): resume from an older checkpoint (--ckpt-step N) and {REMEDY}")
    # global_step4 (the last one trained at the sane --lr) survived --keep-last 2: pruning waits until
    # the newest checkpoint's weights gave a finite loss, which global_step6's never did
    assert _steps(d) == ["global_step4", "global_step5", "global_step6"]
    assert open(os.path.join(d, TRACKER)).read() == "6"
    for step in (4, 5, 6):
        path = step_dir(d, step)
        assert integrity.verify(path) is None and _all_finite(path)
        saved = json.load(open(os.path.join(path, META)))["health"]
        assert saved["finite"] is True and math.isfinite(saved["loss"])
    # the record is the loss printed for that iteration
    assert f"{json.load(open(os.path.join(step_dir(d, 6), META)))['health']['loss']:.6E}" == losses[6]


def _rewrite(path, *, nan_weights=False, health=None):
    """A checkpoint as another writer left it: NaN in the embedding (a run whose weights went NaN, saved
    before checkpoints recorded their loss) or the given health record; the manifest made to match."""
    meta_path = os.path.join(path, META)
    meta = json.load(open(meta_path))
    meta.pop("health")
    if health is not None:
        meta["health"] = health
    with open(meta_path, "w") as f:
        f.write(json.dumps(meta, indent=2))  # json writes NaN as NaN, as Python's json reads it
    if nan_weights:
        layer = os.path.join(path, "layer_00-model_00-model_states.pt")
        state = torch.load(layer, weights_only=True)
        state["word_embeddings.weight"][3, 5] = float("nan")
        torch.save(state, layer)
    os.remove(os.path.join(path, "megatron_ds_manifest.json"))
    integrity.write_manifest(path, int(os.path.basename(path)[len("global_step"):]))
    assert integrity.verify(path) is None


def test_diverged_checkpoints_are_not_resumed(diverged, tmp_path):
    """Three resumes at a sane --lr: from global_step6 (finite weights whose forward gives NaN: the run
    stops at its first save point, never trains on to exit status 0), from an older-format checkpoint
    with NaN weights and from one whose record says its loss was NaN (both refused at load)."""
    d, _, before = diverged
    again, nan_weights, recorded = (str(tmp_path / n) for n in ("again", "nan_weights", "recorded"))
    shutil.copytree(d, again)
    for copy in (nan_weights, recorded):
        shutil.copytree(before, copy)
    _rewrite(step_dir(nan_weights, 4), nan_weights=True)
    _rewrite(step_dir(recorded, 4), health={"loss": float("nan"), "finite": False})
    resume = SMALL_GPT + ["--train-iters", "12", "--save-interval", "3", "--override-lr-scheduler"]
    results = _runs([resume + ["--load", x, "--save", x] for x in (again, nan_weights, recorded)])

    (rc, out, err) = results[0]
    assert rc == 1 and _losses(out) == {7: "nan", 8: "nan", 9: "nan"}
    assert err.strip() == (f"error: training diverged: the loss of iteration 9 is nan; stopping without saving. "
                           f"The loss was NaN/inf at every iteration since {again}/global_step6 (its weights "
                           f"diverged): resume from an older checkpoint (--ckpt-step N) and {REMEDY}")
    assert _steps(again) == ["global_step4", "global_step5", "global_step6"]
    remedy = "load an older checkpoint (--ckpt-step N) or another --load, and lower --lr before going on from it"
    for (rc, out, err), x, why in ((results[1], nan_weights, "its weights or optimizer state hold NaN/inf"),
                                  (results[2], recorded, "its recorded loss is nan")):
        assert rc == 1 and not _losses(out), err
        assert err.strip() == (f"error: refusing to resume from {x}/global_step4: {why} (the run that saved it had "
                               f"diverged); {remedy}")
        assert _steps(x) == ["global_step4"]
