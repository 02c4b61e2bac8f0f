"""The training loop's bookkeeping (NaN losses, logging, exits) and the NaN-skipping optimizer."""
import math
import re

import pytest
import torch

from megatron_ds.config import parse_args, resolve
from megatron_ds.errors import ConfigError, TrainingStopped
from megatron_ds.families.gpt.gpt_family import GPT
from megatron_ds.families.gpt.gpt_flops import model_flops_per_iteration
from megatron_ds.training import log as mlog
from megatron_ds.training.loop import Loop, TrainState
from tests.distributed import run_distributed

ARGS = ("--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 16 --micro-batch-size 1 "
        "--global-batch-size 2 --lr 1e-3 --log-interval 2 --mock-data --vocab-size 64").split()


class StubEngine:
    """Stands in for DeepSpeed's pipeline engine: returns scripted losses."""

    def __init__(self, losses):
        self.losses = list(losses)
        self.skipped_steps = 0
        self.lr_scheduler = None
        self.optimizer = None

    def train_batch(self, data_iter=None):
        loss = self.losses.pop(0)
        if not math.isfinite(loss):
            self.skipped_steps += 1  # what DeepSpeed's optimizers do with a non-finite gradient
        return torch.tensor(loss)

    def get_global_grad_norm(self):
        return 1.0


def _train(losses, *extra):
    cfg, _ = parse_args(ARGS + ["--train-iters", str(len(losses)), *extra])
    run = resolve(cfg, world_size=1, vocab_size=64, device_type="cpu", family=GPT)
    saved = []
    loop = Loop(run, StubEngine(losses), loss_fn=None, dp_group=None, device=torch.device("cpu"),
                tb=mlog.TensorBoard(None, False), save=lambda st: saved.append(st.iteration), start_time=0.0)
    return loop.train(TrainState(), None, None), saved


def test_nan_iterations_are_counted_and_logged(capsys):
    state, _ = _train([4.0, float("nan"), 3.0, 2.0])
    assert state.nan_iterations == 1
    assert state.history == [(1, 4.0), (3, 3.0), (4, 2.0)]
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith(" iteration")]
    # the mean over the logging window excludes the NaN: (4.0) at iteration 2, (3.0 + 2.0) / 2 at 4
    assert "lm loss: 4.000000E+00" in lines[0] and "number of nan iterations:   1" in lines[0]
    assert "number of skipped iterations:   1" in lines[0]
    # both counts are per logging window, as in Megatron
    assert "lm loss: 2.500000E+00" in lines[1] and "number of skipped iterations:   0" in lines[1]
    assert "number of nan iterations:   0" in lines[1]


def test_too_many_nans_in_a_row_stop_the_run():
    with pytest.raises(TrainingStopped, match=r"NaN/inf for 3 iterations in a row \(last at iteration 4\)"):
        _train([1.0, float("nan"), float("inf"), float("nan"), 1.0], "--max-consecutive-nan-iters", "3")


def test_exit_interval_saves_and_stops():
    state, saved = _train([1.0] * 6, "--exit-interval", "3", "--save", "unused", "--save-interval", "100")
    assert state.iteration == 3 and saved == [3] and state.exited_early


def test_final_save_when_interval_does_not_divide():
    state, saved = _train([1.0] * 5, "--save", "unused", "--save-interval", "2")
    assert saved == [2, 4, 5]


def test_model_flops_formula():
    # Megatron's closed form for GPT-2 shapes (docs/flops.md), evaluated by hand for GPT 345M: B=8,
    # s=1024, l=24, h=1024, V=50304; the general count is checked against measured matmuls in
    # tests/families/gpt/test_flops.py
    expected = 72 * 8 * 1024 * 24 * 1024 ** 2 * (1 + 1024 / (6 * 1024) + 50304 / (12 * 24 * 1024))
    cfg, _ = parse_args(("--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 "
                         "--max-position-embeddings 1024 --micro-batch-size 8 --mock-data --train-iters 1 --lr 1e-4").split())
    model = resolve(cfg, world_size=1, vocab_size=50257, device_type="cpu", family=GPT).layout.model
    assert model_flops_per_iteration(model, 8, 50304, False) == pytest.approx(expected, rel=1e-12)


def _guarded_skip(rank, world):
    """A real DeepSpeed engine (fp32, ZeRO 0) with our optimizer guard: a NaN gradient skips the step."""
    import deepspeed

    from megatron_ds.training.lr_schedule import LRSchedule
    from megatron_ds.training.optimizer import GuardedOptimizer

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = GuardedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.1), clip_grad=1.0)
    sched = LRSchedule(opt, max_lr=0.1, min_lr=0.0, warmup_steps=0, decay_steps=10, decay_style="linear")
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched,
                                      config={"train_batch_size": 1, "gradient_clipping": 0.0})
    opt.mpu = None
    poison = {"on": False}
    model.weight.register_hook(lambda g: torch.full_like(g, float("nan")) if poison["on"] else g)
    x = torch.randn(1, 4)
    results = []
    for on in (False, True, False):
        poison["on"] = on
        before = model.weight.detach().clone()
        loss = engine(x).pow(2).sum()
        engine.backward(loss)
        engine.step()
        results.append((not torch.equal(before, model.weight.detach()), engine.skipped_steps, sched.num_steps,
                        opt._global_grad_norm))
    return results


def test_guarded_optimizer_skips_non_finite_steps():
    (moved1, skip1, sched1, norm1), (moved2, skip2, sched2, norm2), (moved3, skip3, sched3, _) = \
        run_distributed(_guarded_skip, 1, timeout=300)[0]
    assert moved1 and skip1 == 0 and sched1 == 1 and 0 < norm1 < math.inf
    assert not moved2 and skip2 == 1 and sched2 == 1 and norm2 == math.inf  # skipped: no update, LR held
    assert moved3 and skip3 == 1 and sched3 == 2


def test_iteration_line_matches_megatron_shape():
    line = mlog.iteration_line(iteration=100, train_iters=1000, consumed_samples=3200, elapsed_ms=812.3,
                               lr=1.5e-4, global_batch_size=32, loss=6.123456, loss_scale=1.0, grad_norm=1.234,
                               skipped=0, nans=0, samples_per_s=39.4, tokens_per_s_per_gpu=1000.0,
                               tflops_per_gpu=12.5, mem_gb=3.2)
    # the exact prefix of Megatron's iteration line (megatron/training.py training_log), which log parsers match
    assert line.startswith(" iteration      100/    1000 | consumed samples:         3200 | elapsed time per "
                           "iteration (ms): 812.3 | learning rate: 1.500E-04 | global batch size:    32 | "
                           "lm loss: 6.123456E+00 | loss scale: 1.0 | grad norm: 1.234 | number of skipped "
                           "iterations:   0 | number of nan iterations:   0 |")
    assert re.search(r"TFLOP/s per GPU: 12\.50 \| peak memory \(GB\): 3\.20 \|$", line)
    with_eta = mlog.iteration_line(iteration=100, train_iters=1000, consumed_samples=3200, elapsed_ms=812.3,
                                   lr=1.5e-4, global_batch_size=32, loss=6.1, loss_scale=1.0, grad_norm=1.2,
                                   skipped=0, nans=0, samples_per_s=39.4, tokens_per_s_per_gpu=1000.0,
                                   tflops_per_gpu=12.5, mem_gb=3.2, eta_s=900 * 0.8123)
    assert with_eta.endswith("| peak memory (GB): 3.20 | ETA: 0:12:11 |")  # 900 iterations left x 0.81 s


def test_lr_schedule_against_formulas_and_override():
    from megatron_ds.training.lr_schedule import LRSchedule

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    s = LRSchedule(opt, max_lr=1.0, min_lr=0.1, warmup_steps=4, decay_steps=14, decay_style="cosine")
    assert [s.lr_at(i) for i in (0, 2, 4)] == [0.0, 0.5, 1.0]  # linear warmup
    assert s.lr_at(9) == pytest.approx(0.1 + 0.9 * 0.5 * (math.cos(math.pi * 0.5) + 1))  # half-way
    assert s.lr_at(14) == pytest.approx(0.1) and s.lr_at(20) == 0.1
    s.step()
    assert opt.param_groups[0]["lr"] == 0.25
    lin = LRSchedule(opt, max_lr=1.0, min_lr=0.0, warmup_steps=0, decay_steps=10, decay_style="linear")
    assert lin.lr_at(3) == pytest.approx(0.7)
    # loading: the same shape restores the step; a different one is an error unless a flag decides
    def fresh(**policy):
        return LRSchedule(opt, max_lr=1.0, min_lr=0.1, warmup_steps=4, decay_steps=14, decay_style="cosine", **policy)

    same = fresh()
    same.load_state_dict(dict(s.state_dict(), num_steps=6))
    assert same.num_steps == 6 and opt.param_groups[0]["lr"] == pytest.approx(same.lr_at(6))
    saved = dict(s.state_dict(), max_lr=2.0, num_steps=6)
    with pytest.raises(ConfigError, match=r"max_lr: checkpoint 2.0 vs now 1.0.*--override-lr-scheduler"):
        fresh().load_state_dict(saved)
    kept = fresh(use_checkpoint=True)  # --use-checkpoint-lr-scheduler
    kept.load_state_dict(saved)
    assert (kept.max_lr, kept.num_steps) == (2.0, 6)
    mine = fresh(override=True)  # --override-lr-scheduler
    mine.load_state_dict(saved)
    assert (mine.max_lr, mine.num_steps) == (1.0, 6)
    assert opt.param_groups[0]["lr"] == pytest.approx(mine.lr_at(6))


class _Recorder:
    def __init__(self):
        self.keys = set()

    def scalars(self, step, values):
        self.keys |= {k for k, v in values.items() if v is not None}


@pytest.mark.parametrize("extra,logged", [((), True), (("--no-log-learnig-rate-to-tensorboard",), False)])
def test_learning_rate_scalar_can_be_left_out(extra, logged):
    # Megatron-DeepSpeed's --no-log-learnig-rate-to-tensorboard (typo and all) drops only that scalar
    cfg, _ = parse_args(ARGS + ["--train-iters", "2", *extra])
    run = resolve(cfg, world_size=1, vocab_size=64, device_type="cpu", family=GPT)
    tb = _Recorder()
    Loop(run, StubEngine([1.0, 1.0]), loss_fn=None, dp_group=None, device=torch.device("cpu"), tb=tb,
         save=lambda st: None, start_time=0.0).train(TrainState(), None, None)
    assert ("learning-rate" in tb.keys) is logged and "lm loss" in tb.keys
