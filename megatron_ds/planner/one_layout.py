"""The planner as a library: one given layout's predicted step, term by term, with the error to expect.

``plan_cli.evaluate_layout(argv, family=..., tp=8, pp=12, ...)`` takes the flags ``tools/plan.py`` takes (model,
batch, precision, GPUs) and a layout, resolves it as ``--dry-run`` would (a ConfigError where that refuses it), and returns an
``Evaluation``: the memory estimate, the step time split into the time model's terms (``TERMS``), and the
expected error of the prediction for the layout's regime on its GPU. ``tools/plan.py --layout tp=8,pp=12,...``
prints it. The expected errors are the largest errors the model makes on the published runs of each regime
(tests/planner/test_published_runs.py checks every row against them); on a GPU no published run of the regime
was measured on (Hopper: one single-GPU measurement only), the error is unknown and said so, and layouts are
grouped into ties by the A100's error as the least the uncertainty can be.
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_ds.config.memory import GB
from megatron_ds.errors import ConfigError
from megatron_ds.planner import search as planner
from megatron_ds.planner.time_model import EXPECTED_ERROR, error_text, expected_error, regime, tie_groups

__all__ = ["EXPECTED_ERROR", "Evaluation", "error_text", "expected_error", "parse_layout", "regime", "tie_groups"]


@dataclass(frozen=True)
class Evaluation:
    candidate: planner.Candidate
    gpu: object

    @property
    def time(self):
        return self.candidate.time

    @property
    def layout(self):
        return self.candidate.layout

    @property
    def expected_error(self) -> float | None:
        return expected_error(self.layout, self.gpu)

    def terms(self) -> dict[str, float]:
        """Seconds per step of each of the time model's terms (``planner.TERMS``)."""
        return {name: getattr(self.time, attr) for name, attr in planner.TERMS}

    def lines(self) -> list[str]:
        t, lay, gb = self.time, self.layout, self.candidate.memory.total / GB
        out = [f"layout: {self.candidate.knobs.describe()}, DP {lay.dp}, {lay.grad_accum_steps} micro-batches per step: "
               f"{gb:.1f} of {self.gpu.memory_gb:.0f} GB per GPU ({'fits' if gb <= self.gpu.memory_gb else 'DOES NOT FIT'})",
               f"predicted: {t.step_s:.3f} s per step, {t.tflops_per_gpu:.1f} TFLOP/s per GPU, MFU "
               f"{100 * t.mfu:.1f}%; {error_text(lay, self.gpu)}",
               "seconds per step on the critical path (the slowest stage's work; the rest of its terms as exposed):"]
        out += [f"  {name:<56} {seconds:>9.3f}  {100 * seconds / t.step_s:5.1f}%" for name, seconds in self.terms().items()]
        return out


def parse_layout(text: str) -> planner.Knobs:
    """``tp=8,pp=12,mb=1,zero=0,recompute=full,sp,v=2`` (``sp``: Megatron's sequence parallelism; ``v``: model
    chunks per pipeline rank; ``ulysses=N``; ``cp=N`` context parallelism; ``recompute=none|selective|full``) as the
    planner's knobs."""
    ints = {"tp": "tp", "pp": "pp", "mb": "mb", "zero": "zero", "v": "v", "ulysses": "sp", "ep": "ep", "cp": "cp"}
    kw: dict = {"tp": 1, "pp": 1}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key in ints and value.isdigit():
            kw[ints[key]] = int(value)
        elif key == "recompute" and value in ("none", "selective", "full"):
            kw["recompute"] = None if value == "none" else value
        elif key == "sp" and not value:
            kw["seq_par"] = True
        else:
            raise ConfigError(f"--layout: cannot read {item!r}; give tp=N,pp=N,mb=N,zero=N,"
                              "recompute=none|selective|full[,sp][,v=N][,ulysses=N][,ep=N][,cp=N]")
    return planner.Knobs(**kw)
