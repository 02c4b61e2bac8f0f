"""The loss report (megatron_ds/model/loss_report.py): named scalars averaged over every add on every
rank, ranks that add nothing joining the same reduction; training and evaluation apart; printed
after lm loss on Megatron's lines."""
import pytest
import torch

from megatron_ds.model.loss_report import EVAL, LossReport
from megatron_ds.training.log import iteration_line, validation_lines
from tests.distributed import run_distributed


def _reduce(rank, world_size):
    report = LossReport(("lm loss", "aux", "never"))
    if rank == 0:  # e.g. the last pipeline stage: two micro-batches
        report.add("aux", torch.tensor(1.0))
        report.add("aux", torch.tensor(2.0))
        report.add("lm loss", torch.tensor(5.0, requires_grad=True) * 2)  # detached by add
        with report.phase(EVAL):
            report.add("aux", 10.0)
    elif rank == 2:
        report.add("aux", torch.tensor(6.0))
    train = report.reduce(torch.device("cpu"))
    evaluation = report.reduce(torch.device("cpu"), phase=EVAL)
    again = report.reduce(torch.device("cpu"))  # reset after a reduce
    return train, evaluation, again


def test_mean_over_every_add_on_every_rank():
    results = run_distributed(_reduce, 3, timeout=300)
    # hand-computed means: aux (1 + 2 + 6) / 3 adds; lm loss one add of 10; eval aux one add of 10
    expected = ({"lm loss": 10.0, "aux": 3.0, "never": None}, {"lm loss": None, "aux": 10.0, "never": None},
                {"lm loss": None, "aux": None, "never": None})
    assert all(r == expected for r in results)


def test_undeclared_names_and_empty_reports():
    with pytest.raises(KeyError):
        LossReport(("a",)).add("b", 1.0)
    assert LossReport().reduce(torch.device("cpu")) == {}  # no names: no collective at all


def test_lines_print_reported_values_after_lm_loss():
    line = iteration_line(iteration=3, train_iters=10, consumed_samples=24, elapsed_ms=1.0, lr=1e-3,
                          global_batch_size=8, loss=2.5, loss_scale=1.0, grad_norm=0.5, skipped=0, nans=0,
                          samples_per_s=1.0, tokens_per_s_per_gpu=1.0, tflops_per_gpu=0.0, mem_gb=0.0,
                          reported={"aux": 0.125, "missing": None})
    assert "| lm loss: 2.500000E+00 | aux: 1.250000E-01 | loss scale:" in line
    assert "missing" not in line
    valid = validation_lines("iteration 3", 2.5, {"aux": 0.125})
    assert "lm loss PPL: 1.218249E+01 | aux value: 1.250000E-01 |" in valid
