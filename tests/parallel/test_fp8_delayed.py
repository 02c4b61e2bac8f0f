"""Delayed scaling (parallel/fp8_delayed.py) against an independent reference of Transformer Engine's recipe.

The reference (``_Reference``) is written from Transformer Engine's definition (NVIDIA/TransformerEngine
transformer_engine/pytorch/fp8.py: ``_default_get_amax_and_update_history``, ``_update_amax_history``,
``_default_sf_compute``; recipe.DelayedScaling's docs), not from our code: it keeps the plain list of each
step's amax per operand; after a step the amax is the largest of the last ``history_len`` steps' (``max``)
or the last step's (``most_recent``), and the scale ``(fp8_max / amax) / 2**margin`` with fp8_max 448 for
E4M3 (1.75 * 2^8) and 57344 for E5M2 (1.75 * 2^15); before the first update every scale is 1. The history
buffer Transformer Engine keeps after an update is slot 0 zeroed (the next step's) followed by the last
``history_len - 1`` amaxes, oldest first. The GEMMs are compared with operands rounded to float8 at
``t * scale`` (saturating) and divided back: the CPU emulation multiplies those in fp32, so only the summation
order differs (1e-6 relative). Scales: ours in fp32, the reference in float64: two fp32 roundings (3e-7).

At TP 2 the amax of each operand is reduced (MAX) over the tensor parallel ranks, so every scale and
history equals TP 1's bitwise (a max of shards' maxes is the max); the outputs equal TP 1's up to the
row-parallel all-reduce's summation order (1e-5 relative, as tests/parallel/test_layers.py).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_ds.parallel.fp8 import Fp8Recipe
from megatron_ds.parallel.fp8_delayed import update_delayed_scaling
from megatron_ds.parallel.layers import ColumnParallelLinear, RowParallelLinear
from tests.distributed import run_distributed

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
MAXES = {E4M3: 448.0, E5M2: 57344.0}


class _Reference:
    """Transformer Engine's delayed scaling for the three operands (input, weight, grad_output)."""

    def __init__(self, recipe: Fp8Recipe):
        self.recipe = recipe
        self.dtypes = (E4M3, E4M3, E5M2 if recipe.format == "hybrid" else E4M3)
        self.amaxes: list[list[float]] = [[], [], []]
        self.scales = [1.0, 1.0, 1.0]

    def after_step(self, amaxes: list[float]) -> None:
        for role, amax in enumerate(amaxes):
            self.amaxes[role].append(amax)
            window = self.amaxes[role][-self.recipe.amax_history_len:]
            chosen = max(window) if self.recipe.amax_compute_algo == "max" else window[-1]
            if chosen > 0:
                self.scales[role] = MAXES[self.dtypes[role]] / chosen / 2.0 ** self.recipe.margin

    def history(self) -> torch.Tensor:
        length = self.recipe.amax_history_len
        rows = []
        for seen in self.amaxes:
            last = seen[-(length - 1):] if length > 1 else []
            rows.append([0.0] * (length - len(last)) + last)
        return torch.tensor(rows, dtype=torch.float64).t()

    def q(self, t: torch.Tensor, role: int) -> torch.Tensor:
        """``t`` rounded to the operand's float8 at its delayed scale, back in fp32."""
        dtype, scale = self.dtypes[role], torch.tensor(self.scales[role], dtype=torch.float32)
        return (t.float() * scale).clamp(-MAXES[dtype], MAXES[dtype]).to(dtype).float() / scale


RECIPES = [Fp8Recipe("hybrid", "delayed"),
           Fp8Recipe("hybrid", "delayed", amax_history_len=4, amax_compute_algo="max"),
           Fp8Recipe("e4m3", "delayed", margin=2, amax_history_len=3),
           Fp8Recipe("hybrid", "delayed", margin=1, amax_history_len=2, amax_compute_algo="max")]
# magnitudes of (input, grad_output) per step: an outlier at step 2, then small values that a stale scale
# from the outlier (max over the history) rounds coarser than the most recent amax would
MAGNITUDES = [(1.0, 1e-3), (0.5, 2e-3), (40.0, 1e-1), (0.2, 1e-4), (0.3, 5e-4), (0.1, 1e-4)]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: f"{r.format}-L{r.amax_history_len}-{r.amax_compute_algo}"
                                                          f"-m{r.margin}")
def test_scales_histories_and_gemms_follow_transformer_engines_delayed_scaling(recipe):
    torch.manual_seed(0)
    layer = ColumnParallelLinear(32, 16, tp_group=None, bias=False, fp8=recipe)
    ref = _Reference(recipe)
    gen = torch.Generator().manual_seed(1)
    for step, (x_mag, g_mag) in enumerate(MAGNITUDES):
        x = (torch.randn(12, 32, generator=gen) * x_mag).requires_grad_()
        g = torch.randn(12, 16, generator=gen) * g_mag
        w = layer.weight.detach()
        y, _ = layer(x)
        y.backward(g)
        want_y = ref.q(x.detach(), 0) @ ref.q(w, 1).t()
        want_gx = ref.q(g, 2) @ ref.q(w, 1)
        want_gw = ref.q(g, 2).t() @ ref.q(x.detach(), 0)
        for name, got, want in (("y", y, want_y), ("grad x", x.grad, want_gx), ("grad w", layer.weight.grad, want_gw)):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * want.abs().max().item(),
                                       msg=lambda m, name=name: f"step {step} {name}: {m}")
        # evaluation (no grad) casts with the same scales and records nothing
        with torch.no_grad():
            layer(x.detach() * 1000)
        update_delayed_scaling(layer, dp_group=None)
        ref.after_step([x.detach().abs().max().item(), w.abs().max().item(), g.abs().max().item()])
        state = layer.fp8_scaling
        torch.testing.assert_close(state.scale.double(), torch.tensor(ref.scales, dtype=torch.float64),
                                   rtol=3e-7, atol=0, msg=lambda m: f"step {step} scales: {m}")
        torch.testing.assert_close(state.amax_history.double(), ref.history(), rtol=0, atol=0)
        with torch.no_grad():
            layer.weight.mul_(1.5 if step == 1 else 0.9)  # what an optimizer step would do
            layer.weight.grad = None
    # the first step cast at scale 1, as Transformer Engine's: a gradient of 1e-3 is then mostly E5M2 subnormals
    assert ref.amaxes[2][0] < 1e-2


def test_first_step_casts_at_scale_one_not_at_the_current_amax():
    recipe = Fp8Recipe("hybrid", "delayed")
    layer = ColumnParallelLinear(8, 4, tp_group=None, bias=False, fp8=recipe)
    x = torch.full((2, 8), 1000.0)  # beyond E4M3's 448 at scale 1: saturates, as a stale scale does
    y, _ = layer(x)
    w = layer.weight.detach()
    torch.testing.assert_close(y, torch.full((2, 8), 448.0) @ w.to(E4M3).float().t(), rtol=1e-6, atol=1e-6)


def _mlp(group, recipe):
    torch.manual_seed(3)  # the same full weights at any TP size (layers.py splits a master copy)
    return (ColumnParallelLinear(16, 32, tp_group=group, gather_output=False, fp8=recipe),
            RowParallelLinear(32, 16, tp_group=group, input_is_parallel=True, fp8=recipe))


def _tp2_equals_tp1(rank, world_size):
    recipe = Fp8Recipe("hybrid", "delayed", amax_history_len=3, amax_compute_algo="max")
    dense, split = _mlp(None, recipe), _mlp(dist.group.WORLD, recipe)
    gen = torch.Generator().manual_seed(5)
    for step in range(4):
        x = torch.randn(6, 16, generator=gen) * (10.0 if step == 1 else 1.0)
        g = torch.randn(6, 16, generator=gen) * 1e-3
        outs = []
        for col, row in (dense, split):
            y = row(torch.nn.functional.gelu(col(x)[0]))[0]
            y.backward(g)
            outs.append(y.detach())
            update_delayed_scaling(torch.nn.ModuleList([col, row]), dp_group=None)
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5 * outs[0].abs().max().item())
        for a, b in zip(dense, split):
            assert torch.equal(a.fp8_scaling.amax_history, b.fp8_scaling.amax_history), (step, rank)
            assert torch.equal(a.fp8_scaling.scale, b.fp8_scaling.scale), (step, rank)
    assert (dense[0].fp8_scaling.scale != 1).all()  # every scale moved from the first step's 1
    # data parallel: each rank's own input, one scale for all (Megatron-LM's amax group is TP x DP)
    layer = ColumnParallelLinear(16, 8, tp_group=None, bias=False, fp8=recipe)
    layer(torch.full((2, 16), float(rank + 1)))[0].sum().backward()
    update_delayed_scaling(layer, dp_group=dist.group.WORLD)
    assert layer.fp8_scaling.scale[0].item() == pytest.approx(448.0 / world_size, rel=1e-7)


def test_tp2_scales_equal_tp1_and_data_parallel_ranks_agree():
    run_distributed(_tp2_equals_tp1, 2, timeout=120)


def test_state_is_in_the_layers_state_dict_and_loads_from_checkpoints_without_it():
    recipe = Fp8Recipe("hybrid", "delayed", amax_history_len=2)
    layer = RowParallelLinear(8, 4, tp_group=None, fp8=recipe)
    layer(torch.randn(3, 8))[0].sum().backward()
    update_delayed_scaling(layer, dp_group=None)
    sd = layer.state_dict()
    assert set(sd) == {"weight", "bias", "fp8_scaling.amax_history", "fp8_scaling.scale"}
    fresh = RowParallelLinear(8, 4, tp_group=None, fp8=recipe)
    fresh.load_state_dict(sd)
    assert torch.equal(fresh.fp8_scaling.scale, layer.fp8_scaling.scale)
    # a bf16 run's checkpoint into a delayed-scaling run: fresh state; and the other way round
    fresh.load_state_dict({"weight": sd["weight"], "bias": sd["bias"]})
    RowParallelLinear(8, 4, tp_group=None, fp8=Fp8Recipe("hybrid")).load_state_dict(sd)
    # a model cast to bf16 (DeepSpeed's engine does) keeps its scaling state fp32
    assert fresh.bfloat16().fp8_scaling.scale.dtype == fresh.fp8_scaling.amax_history.dtype == torch.float32
    assert fresh.weight.dtype == torch.bfloat16
    longer = RowParallelLinear(8, 4, tp_group=None, fp8=Fp8Recipe("hybrid", "delayed", amax_history_len=4))
    with pytest.raises(RuntimeError, match="saved with --fp8-amax-history-len 2, this run's is 4; resume with 2"):
        longer.load_state_dict(sd)
