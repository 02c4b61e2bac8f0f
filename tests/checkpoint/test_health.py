"""The finiteness flag a save is refused on, over a real DeepSpeed engine's state on two ranks.

ZeRO-1 on two data parallel ranks: each holds half of the fp32 master weights and Adam's moments
(its flat partition) next to the whole module. A NaN in one rank's share of the optimizer state, or
an inf in one rank's module weights, must make every rank refuse to save (the flag is all-reduced),
as a CLI run cannot easily produce (a diverging run's losses go NaN before its weights do:
tests/training/test_divergence.py covers that path end to end).
"""
import torch

from tests.distributed import run_distributed


def _flags(rank, world_size):
    import deepspeed

    from megatron_ds import ds_compat
    from megatron_ds.checkpoint import health

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.1), config={
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 1}})
    engine.backward(engine(torch.randn(1, 8)).pow(2).sum())
    engine.step()
    moments = next(iter(ds_compat.base_optimizer(engine.optimizer).state.values()))["exp_avg"]
    seen = [health.state_finite(engine)]
    if rank == 1:
        moments[0] = float("nan")  # one value of rank 1's half of the optimizer state
    seen.append(health.state_finite(engine))
    moments.nan_to_num_(0.0)
    seen.append(health.state_finite(engine))
    if rank == 0:
        model.weight.data[2, 3] = float("inf")
    seen.append(health.state_finite(engine))
    try:
        health.check_before_save(engine, 3, 2.5)
    except health.NonFiniteState as exc:
        seen.append(str(exc))
    return seen


def test_one_rank_non_finite_stops_every_rank():
    expected = [True, False, True, False, "the weights or optimizer state hold NaN/inf after iteration 3"]
    assert run_distributed(_flags, 2, timeout=600) == [expected, expected]
