"""--manual-gc, --manual-gc-interval, --no-manual-gc-eval: the loop collects where Megatron-LM's train()
does, with the automatic collector off, and training ends with it as it was."""
import gc

import pytest
import torch

from megatron_ds.config import parse_args, resolve
from megatron_ds.families.gpt.gpt_family import GPT
from megatron_ds.training import log as mlog
from megatron_ds.training import manual_gc as manual_gc_module
from megatron_ds.training.loop import Loop, TrainState
from megatron_ds.training.manual_gc import ManualGC

ARGS = ("--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 16 --micro-batch-size 1 "
        "--global-batch-size 2 --lr 1e-3 --log-interval 2 --mock-data --vocab-size 64").split()


class StubEngine:
    """DeepSpeed's pipeline engine as the loop sees it; records whether the collector ran automatically
    during each step."""

    def __init__(self, log):
        self.log, self.skipped_steps, self.lr_scheduler, self.optimizer = log, 0, None, None
        self.iteration = 0

    def train_batch(self, data_iter=None):
        self.iteration += 1
        self.log.append(("step", self.iteration, gc.isenabled()))
        return torch.tensor(1.0)

    def eval_batch(self, data_iter=None, **kwargs):
        self.log.append(("eval", self.iteration))
        return torch.tensor(1.0)

    def get_global_grad_norm(self):
        return 1.0


class CountingGC:
    """``gc`` as manual_gc.py sees it: collections recorded in the shared log, the rest the real module's."""

    def __init__(self, log):
        self.log = log

    def __getattr__(self, name):
        return getattr(gc, name)

    def collect(self, generation=2):
        self.log.append(("collect", generation))
        return 0  # no real collection: the record is what is tested


def _train(monkeypatch, iters: int, *extra):
    log = []
    monkeypatch.setattr(manual_gc_module, "gc", CountingGC(log))
    cfg, _ = parse_args(ARGS + ["--train-iters", str(iters), "--eval-iters", "1", *extra])
    run = resolve(cfg, world_size=1, vocab_size=64, device_type="cpu", family=GPT)
    t = run.training
    loop = Loop(run, StubEngine(log), loss_fn=None, dp_group=None, device=torch.device("cpu"),
                tb=mlog.TensorBoard(None, False), save=lambda st: None, start_time=0.0,
                manual_gc=ManualGC(t.manual_gc, t.manual_gc_interval, t.manual_gc_eval))
    was = gc.isenabled()
    try:
        loop.train(TrainState(), iter(()), valid_iter=iter(()))
        after_training = gc.isenabled()
    finally:
        loop.manual_gc.restore()  # the trainer's, after the final evaluation
        restored = gc.isenabled()
        gc.enable()
    return log, was, after_training, restored


def _megatron_lm(iters: int, interval: int, eval_interval: int, around_eval: bool) -> list:
    """megatron/training/training.py train() with --manual-gc, transcribed: gc.collect() before the loop;
    per iteration the step, then the evaluation wrapped in collect() / collect(generation=0), then
    post_training_step_callbacks' collect() every interval."""
    log = [("collect", 2)]
    for it in range(1, iters + 1):
        log.append(("step", it, False))
        if it % eval_interval == 0:
            log += [("collect", 2)] * around_eval + [("eval", it)] + [("collect", 0)] * around_eval
        if interval != 0 and it % interval == 0:
            log.append(("collect", 2))
    return log


@pytest.mark.parametrize("interval, around_eval", [(2, True), (0, True), (3, False)])
def test_collections_where_megatron_lm_collects(monkeypatch, interval, around_eval):
    extra = ["--manual-gc", "--manual-gc-interval", str(interval), "--eval-interval", "3"]
    log, was, after_training, restored = _train(monkeypatch, 6, *extra,
                                                *([] if around_eval else ["--no-manual-gc-eval"]))
    assert was, "the test process starts with automatic collection on"
    assert log == _megatron_lm(6, interval, 3, around_eval)
    assert not after_training and restored  # off through training, back on after it


def test_without_manual_gc_nothing_changes(monkeypatch):
    log, _, after_training, _ = _train(monkeypatch, 4, "--manual-gc-interval", "1", "--eval-interval", "2")
    assert ("collect", 2) not in log and ("collect", 0) not in log
    assert all(entry[2] for entry in log if entry[0] == "step")  # the automatic collector stayed on
    assert after_training


def test_disable_spelling_and_interval_range():
    assert parse_args(ARGS + ["--disable-manual-gc-eval"])[0].training.manual_gc_eval is False
    assert parse_args(ARGS)[0].training.manual_gc_eval is True
    cfg, _ = parse_args(ARGS + ["--train-iters", "1", "--manual-gc", "--manual-gc-interval", "-1"])
    with pytest.raises(Exception, match=r"--manual-gc-interval -1 is out of range: it must be >= 0"):
        resolve(cfg, world_size=1, vocab_size=64, device_type="cpu", family=GPT)
