"""--kill-switch-file (Megatron-DeepSpeed's megatron/training.py and utils.found_kill_switch, commit
4efb479): when the file appears the run saves (with --save) and exits after that iteration; a run started
while it exists exits before its first. Two gloo ranks where only rank 0 writes the file, mid-iteration:
both must stop after the same iteration, having saved once."""
from __future__ import annotations

import os

import torch

from tests.distributed import run_distributed
from tests.training.test_loop import ARGS, StubEngine
from megatron_ds.families.gpt.gpt_family import GPT


class _Touching(StubEngine):
    """Rank 0 creates the kill switch file during iteration ``at``."""

    def __init__(self, losses, path, at, rank):
        super().__init__(losses)
        self.path, self.at, self.rank, self.calls = path, at, rank, 0

    def train_batch(self, data_iter=None):
        self.calls += 1
        if self.rank == 0 and self.calls == self.at:
            open(self.path, "w").close()
        return super().train_batch(data_iter)


def _train(rank, world_size, path, at):
    from megatron_ds.config import parse_args, resolve
    from megatron_ds.training import log as mlog
    from megatron_ds.training.loop import Loop, TrainState

    cfg, _ = parse_args(ARGS + ["--train-iters", "8", "--kill-switch-file", path, "--save", "unused"])
    run = resolve(cfg, world_size=1, vocab_size=64, device_type="cpu", family=GPT)
    saved = []
    loop = Loop(run, _Touching([1.0] * 8, path, at, rank), loss_fn=None, dp_group=None, device=torch.device("cpu"),
                tb=mlog.TensorBoard(None, False), save=lambda st: saved.append(st.iteration), start_time=0.0)
    state = loop.train(TrainState(), None, None)
    return state.iteration, saved, state.stop_reason


def test_kill_switch_saves_and_stops_every_rank_at_once(tmp_path):
    path = str(tmp_path / "STOP")
    results = run_distributed(_train, 2, path, 3)
    assert results == [(3, [3], f"kill switch {path} found")] * 2


def test_run_started_with_the_kill_switch_exits_at_once(tmp_path):
    path = tmp_path / "STOP"
    path.touch()
    results = run_distributed(_train, 2, str(path), 0)
    assert results == [(0, [], f"kill switch {path} found")] * 2
    assert os.path.exists(path)  # left for the user to remove, as Megatron does
