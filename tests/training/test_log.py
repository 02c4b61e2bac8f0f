"""Megatron-LM's --log-throughput field in the iteration line, and --logging-level."""
import logging
import re
import types

import pytest
import torch

from megatron_ds.config import parse_args, resolve
from megatron_ds.errors import ConfigError
from megatron_ds.families.gpt.gpt_family import GPT
from megatron_ds.training import log as mlog
from megatron_ds.training import loop as loop_module
from megatron_ds.training.loop import Loop, TrainState

# GPT-2 shapes: learned positions, GeLU MLP of 4h, tied output layer (the closed form below holds)
ARGS = ("--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 16 --micro-batch-size 1 "
        "--global-batch-size 2 --lr 1e-3 --log-interval 2 --mock-data --vocab-size 64 --train-iters 4").split()


class ClockedEngine:
    """DeepSpeed's pipeline engine as the loop sees it; each step takes ``dt`` seconds of a fake clock."""

    def __init__(self, clock, dt):
        self.clock, self.dt = clock, dt
        self.skipped_steps, self.lr_scheduler, self.optimizer = 0, None, None

    def train_batch(self, data_iter=None):
        self.clock[0] += self.dt
        return torch.tensor(2.0)

    def get_global_grad_norm(self):
        return 1.0


def _lines(monkeypatch, capsys, dt, *extra):
    clock = [1000.0]
    monkeypatch.setattr(loop_module, "time", types.SimpleNamespace(time=lambda: clock[0]))
    cfg, _ = parse_args(ARGS + list(extra))
    run = resolve(cfg, world_size=1, vocab_size=64, device_type="cpu", family=GPT)
    loop = Loop(run, ClockedEngine(clock, dt), loss_fn=None, dp_group=None, device=torch.device("cpu"),
                tb=mlog.TensorBoard(None, False), save=lambda st: None, start_time=0.0)
    state = loop.train(TrainState(), None, None)
    return [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(" iteration")], state


def test_throughput_field_is_the_model_tflops_per_gpu(monkeypatch, capsys):
    # docs/flops.md's closed form for GPT-2 shapes, vocabulary 64 padded to 128 (--make-vocab-size-divisible-by)
    b, s, l, h, v = 2, 16, 2, 32, 128
    flops = 72 * b * s * l * h ** 2 * (1 + s / (6 * h) + v / (12 * l * h))
    dt = 1e-7  # a fake step time that makes the figure large enough to print: 59.0 TFLOP/s
    lines, state = _lines(monkeypatch, capsys, dt, "--log-throughput")
    assert len(lines) == 2
    for line in lines:
        # upstream's field, where upstream prints it: right after the time per iteration
        m = re.search(r"\| elapsed time per iteration \(ms\): ([0-9.]+) \| throughput per GPU \(TFLOP/s/GPU\): "
                      r"([0-9.]+) \| learning rate:", line)
        assert m, line
        assert m.group(2) == f"{flops / dt / 1e12:.1f}" == "59.0"
        assert f"| TFLOP/s per GPU: {flops / dt / 1e12:.2f} |" in line  # the same figure, Megatron-DeepSpeed's field
    # the FLOPs a checkpoint carries (upstream's num_floating_point_operations_so_far): 4 iterations
    assert state.floating_point_operations_so_far == pytest.approx(4 * flops, rel=1e-12)


def test_no_throughput_field_without_the_flag(monkeypatch, capsys):
    lines, _ = _lines(monkeypatch, capsys, 1e-3)
    assert lines and not any("throughput per GPU" in ln for ln in lines)
    assert all(re.search(r"elapsed time per iteration \(ms\): 1\.0 \| learning rate:", ln) for ln in lines)


@pytest.fixture
def fresh_logging():
    ours, root = logging.getLogger("megatron_ds"), logging.getLogger()
    saved = ours.level, list(ours.handlers), root.level
    yield
    ours.setLevel(saved[0])
    ours.handlers[:] = saved[1]
    root.setLevel(saved[2])


def test_logging_level_flag_env_and_default(fresh_logging, capsys):
    assert parse_args(["--logging-level", "30"])[0].logging.logging_level == 30
    assert mlog.configure_logging(None, environ={}) == logging.INFO  # upstream's default
    logging.getLogger("megatron_ds.training.straggler").info("shown")
    logging.getLogger("megatron_ds.launch").warning("warned")
    out, err = capsys.readouterr()
    assert out == "INFO:megatron_ds.training.straggler:shown\n" and err == "WARNING:megatron_ds.launch:warned\n"

    assert mlog.configure_logging(None, environ={"MEGATRON_LOGGING_LEVEL": "30"}) == 30
    assert logging.getLogger().level == 30  # the root logger too, as Megatron-LM's setup_logging
    logging.getLogger("megatron_ds.training.straggler").info("hidden")
    assert capsys.readouterr().out == ""
    assert mlog.configure_logging(10, environ={"MEGATRON_LOGGING_LEVEL": "30"}) == 10  # the flag wins
    assert sum(isinstance(h, mlog._ConsoleHandler) for h in logging.getLogger("megatron_ds").handlers) == 1
    with pytest.raises(ConfigError, match=r"^MEGATRON_LOGGING_LEVEL='info' is not an integer logging level"):
        mlog.configure_logging(None, environ={"MEGATRON_LOGGING_LEVEL": "info"})
