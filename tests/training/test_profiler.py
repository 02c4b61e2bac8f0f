"""--profile / --profile_steps / --profile-ranks (Megatron-DeepSpeed's megatron/profiler.py, commit
4efb479): a gzipped torch profiler trace of exactly the chosen steps in --tensorboard-dir, where
TensorBoard's profiler plugin looks (``*.pt.trace.json.gz``), on the chosen ranks only."""
from __future__ import annotations

import gzip
import json

import pytest
import torch

from megatron_ds.config import parse_args, resolve
from megatron_ds.errors import ConfigError
from megatron_ds.families.gpt.gpt_family import GPT
from megatron_ds.training import log as mlog
from megatron_ds.training.loop import Loop, TrainState
from megatron_ds.training.profiler import step_profiler
from tests.training.test_loop import ARGS, StubEngine


class _Working(StubEngine):
    """Does a recognisable op per step, so the trace shows which steps it covers."""

    def train_batch(self, data_iter=None):
        with torch.profiler.record_function(f"stub step {len(self.done) + 1}"):
            torch.ones(8, 8) @ torch.ones(8, 8)
        self.done.append(1)
        return super().train_batch(data_iter)


def _run(tmp_path, *extra):
    cfg, _ = parse_args(ARGS + ["--train-iters", "5", "--tensorboard-dir", str(tmp_path), *extra])
    return resolve(cfg, world_size=1, vocab_size=64, device_type="cpu", family=GPT)


def test_trace_holds_exactly_the_chosen_steps(tmp_path):
    run = _run(tmp_path, "--profile", "pt", "--profile_steps", "2,4")
    engine = _Working([1.0] * 5)
    engine.done = []
    Loop(run, engine, loss_fn=None, dp_group=None, device=torch.device("cpu"), tb=mlog.TensorBoard(None, False),
         save=lambda st: None, profiler=step_profiler(run.logging, 0, "cpu")).train(TrainState(), None, None)
    traces = list(tmp_path.glob("*.pt.trace.json.gz"))
    assert len(traces) == 1
    events = json.loads(gzip.decompress(traces[0].read_bytes()))["traceEvents"]
    names = {e.get("name") for e in events}
    assert {"stub step 2", "stub step 3", "stub step 4"} <= names
    assert not names & {"stub step 1", "stub step 5"}


def test_profile_ranks_and_defaults(tmp_path):
    lg = _run(tmp_path, "--profile", "pt-full", "--profile-ranks", "0", "2").logging
    assert step_profiler(lg, 1, "cpu") is None and step_profiler(lg, 2, "cpu") is not None
    assert step_profiler(lg, 0, "cpu").profiler.with_stack  # pt-full: Python stacks
    assert step_profiler(_run(tmp_path).logging, 0, "cpu") is None  # no --profile: nothing recorded
    assert (step_profiler(_run(tmp_path, "--profile", "pt").logging, 0, "cpu").first,
            step_profiler(_run(tmp_path, "--profile", "pt").logging, 0, "cpu").last) == (2, 3)  # upstream's "2,3"


def test_megatron_lm_switch_profiles_its_iteration_window(tmp_path):
    # megatron/training/training.py (Megatron-LM core_v0.19.0): the profiler starts at iteration == start and
    # stops once iteration == end, the iteration counting the steps already taken: steps start+1 .. end
    window = step_profiler(_run(tmp_path, "--profile", "--profile-step-start", "1", "--profile-step-end", "3").logging,
                           0, "cpu")
    assert (window.first, window.last) == (2, 3) and not window.profiler.with_stack
    default = step_profiler(_run(tmp_path, "--profile").logging, 0, "cpu")
    assert (default.first, default.last) == (11, 12)  # upstream's defaults 10 and 12


@pytest.mark.parametrize("argv,message", [
    (["--profile", "pt", "--profile_steps", "3,2"], "expected FIRST,LAST"),
    (["--profile", "--profile-step-start", "4", "--profile-step-end", "4"], "expected 0 <= start < end"),
    (["--profile", "pt", "--profile-ranks", "x"], "expected global rank numbers"),
])
def test_bad_profile_flags(tmp_path, argv, message):
    with pytest.raises(ConfigError, match=message):
        _run(tmp_path, *argv)


def test_profile_needs_a_tensorboard_dir():
    cfg, _ = parse_args(ARGS + ["--train-iters", "5", "--profile", "pt"])
    with pytest.raises(ConfigError, match="--tensorboard-dir"):
        resolve(cfg, world_size=1, vocab_size=64, device_type="cpu", family=GPT)
