"""The planner as a library: one given layout's predicted step, term by term, with the error to expect.

``evaluate_layout(argv, tp=8, pp=12, ...)`` takes the flags ``tools/plan.py`` takes (model, batch, precision,
GPUs) and a layout, resolves it as ``--dry-run`` would (a ConfigError where that refuses it), and returns an
``Evaluation``: the memory estimate, the step time split into the time model's terms (``TERMS``), and the
expected error of the prediction for the layout's regime on its GPU. ``tools/plan.py --layout tp=8,pp=12,...``
prints it. The expected errors are the largest errors the model makes on the published runs of each regime
(tests/planner/test_published_runs.py checks every row against them); on a GPU no published run of the regime
was measured on (Hopper: one single-GPU measurement only), the error is unknown and said so, and layouts are
grouped into ties by the A100's error as the least the uncertainty can be.
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_ds.errors import ConfigError
from megatron_ds.planner import plan_cli
from megatron_ds.planner import search as planner

# Largest |predicted / measured - 1| on the published A100 runs of each regime (tests/planner/test_published_runs.py
# asserts every row within it; docs/planner.md lists the rows):
#   ptd-p         tensor + pipeline + data parallel with full recompute: SC21 Table 1, Table 2 (PTD-P),
#                 Korthikanti et al. 2022 Table 5 (full recompute)
#   no-recompute  selective or no recompute: Korthikanti et al. Table 4 (per layer), Table 5 (selective + SP)
#   zero-3        ZeRO-3 without model parallelism: SC21 Table 2
EXPECTED_ERROR = {"ptd-p": 0.09, "no-recompute": 0.09, "zero-3": 0.11}
MEASURED_GPUS = ("a100-40", "a100-80")  # the GPUs the published runs ran on


def regime(layout) -> str:
    """Which published comparison a layout's prediction is judged by."""
    if layout.zero_stage == 3:
        return "zero-3"
    return "ptd-p" if layout.recompute == "full" else "no-recompute"


def expected_error(layout, gpu) -> float | None:
    """The relative error to expect of a prediction (None: unknown, no published run on this GPU)."""
    return EXPECTED_ERROR[regime(layout)] if gpu.name in MEASURED_GPUS else None


def tie_groups(ranked) -> list[int]:
    """A group number per candidate (sorted fastest first): a candidate joins the current group while its
    step, less its expected error, is within the group's fastest step plus that one's error -- predictions
    overlapping within the error are ties, not a ranking. An unknown error counts as the A100's."""
    groups, group, lead_high = [], 0, None
    for cand in ranked:
        err = EXPECTED_ERROR[regime(cand.layout)]
        low, high = cand.time.step_s * (1 - err), cand.time.step_s * (1 + err)
        if lead_high is None or low > lead_high:
            group, lead_high = group + 1, high
        groups.append(group)
    return groups


def error_text(layout, gpu) -> str:
    err = expected_error(layout, gpu)
    if err is None:
        return (f"expected error unknown on {gpu.name} until measured (on A100 runs of this regime, "
                f"{regime(layout)}: +-{100 * EXPECTED_ERROR[regime(layout)]:.0f}%)")
    return f"expected error +-{100 * err:.0f}% ({regime(layout)} regime, published A100 runs)"


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
        t, lay, gb = self.time, self.layout, self.candidate.memory.total / 1e9
        out = [f"layout: {self.candidate.knobs.describe()}, DP {lay.dp}, {lay.grad_accum_steps} micro-batches per step: "
               f"{gb:.1f} of {self.gpu.memory_gb:.0f} GB per GPU ({'fits' if gb <= self.gpu.memory_gb else 'DOES NOT FIT'})",
               f"predicted: {t.step_s:.3f} s per step, {t.tflops_per_gpu:.1f} TFLOP/s per GPU, MFU "
               f"{100 * t.mfu:.1f}%; {error_text(lay, self.gpu)}",
               "seconds per step on the critical path (the slowest stage's work; the rest of its terms as exposed):"]
        out += [f"  {name:<52} {seconds:>9.3f}  {100 * seconds / t.step_s:5.1f}%" for name, seconds in self.terms().items()]
        return out


def parse_layout(text: str) -> planner.Knobs:
    """``tp=8,pp=12,mb=1,zero=0,recompute=full,sp,v=2`` (``sp``: Megatron's sequence parallelism; ``v``: model
    chunks per pipeline rank; ``ulysses=N``; ``recompute=none|selective|full``) as the planner's knobs."""
    ints = {"tp": "tp", "pp": "pp", "mb": "mb", "zero": "zero", "v": "v", "ulysses": "sp", "ep": "ep"}
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
                              "recompute=none|selective|full[,sp][,v=N][,ulysses=N][,ep=N]")
    return planner.Knobs(**kw)


def evaluate_layout(argv: list[str], *, family=None, knobs: planner.Knobs | None = None, dp: int | None = None,
                    **layout) -> Evaluation:
    """One layout (``knobs``, or its fields as keywords: tp, pp, mb, zero, recompute, seq_par, v, sp, ep) of the
    run ``argv`` describes (tools/plan.py's flags), evaluated; ``dp``, where given, must be what the GPUs leave."""
    from megatron_ds.families import get_family  # noqa: PLC0415 (the families import the planner's FLOPs)

    family = family or get_family("gpt")
    request, _, _ = plan_cli.request_of(list(argv), family, "plan.py")
    knobs = knobs or planner.Knobs(**{"tp": 1, "pp": 1, **layout})
    cand = planner.evaluate(request, knobs)
    if dp is not None and dp != cand.layout.dp:
        raise ConfigError(f"DP {dp} does not follow: {request.cluster.world_size} GPUs / (TP {knobs.tp} x PP "
                          f"{knobs.pp}) leave DP {cand.layout.dp}")
    return Evaluation(cand, request.cluster.gpu)
