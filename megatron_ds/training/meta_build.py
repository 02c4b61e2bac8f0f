"""--dry-run's model check: the planned model built for real, on the meta device.

``build_stages(run, eod_token)`` builds, for one rank of every pipeline stage (tensor and data
parallel rank 0: data parallel ranks hold the same modules, tensor parallel ranks the same shapes,
since the padded vocabulary divides evenly), what training builds there (the family's ``build_stage``
over ``engine.model_kwargs``):
the same layer specs, vocabulary padding, tied copy or untied output layer, tensor parallel shards,
Llama-style RoPE / SwiGLU / RMSNorm / GQA, and the model chunks of the interleaved schedule. On
the meta device the parameters have shapes and dtypes but no memory, so a 13B model builds in a
second on a login node. Tensor parallel layers ask their group for its size and their rank: at
TP > 1 the build runs in a fake process group of TP ranks that never communicates, destroyed
before this returns.

``report`` puts each stage's built parameter count, and the weights, gradients and optimizer
states that follow from it (``config.memory.parameter_state``: the layout's precision, ZeRO stage
and data parallel split), next to the estimate's, which counts the parameters by formula
(``ModelFamily.count_parameters``). More than ``TOLERANCE`` apart is a warning: one of the two
is wrong about the model the run would train.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

from megatron_ds import ds_compat
from megatron_ds.config.layout import Layout
from megatron_ds.config.memory import GB, estimate_stages, parameter_state
from megatron_ds.config.run import Run
from megatron_ds.errors import ConfigError

TOLERANCE = 0.01
"""Largest relative difference between the built model and the estimate that passes unremarked."""

_TERMS = ("weights", "gradients", "optimizer states")


@dataclass(frozen=True)
class BuiltStage:
    stage: int
    params: int  # parameters one rank of the stage holds (a tied weight once)
    param_bytes: int  # what they take in the module: elements x bytes of their dtype
    expert_params: int = 0  # of which MoE experts' (DeepSpeed marks them allreduce=False; ZeRO splits them apart)


def build_stages(run: Run, eod_token: int, on_built=lambda built: None) -> list[BuiltStage]:
    """Build every pipeline stage on the meta device with the model family's stage builder
    (``ModelFamily.build_stage``; see the module docstring); ``on_built`` sees each stage as it is
    done. A shape the layers refuse is a ConfigError."""
    layout = run.layout
    build = layout.family.build_stage
    group = ds_compat.fake_process_group(layout.tp, 0) if layout.tp > 1 else contextlib.nullcontext()
    from deepspeed.moe.utils import is_moe_param  # noqa: PLC0415 (DeepSpeed only once a model is built)

    built = []
    # The meta device as the default too: a tensor parallel layer draws the full weight before
    # it keeps its shard (parallel/layers.py), which must not allocate either.
    with torch.device("meta"), group as tp_group:
        for stage in range(layout.pp):
            try:
                params = list(build(run, stage, tp_group, eod_token).parameters())
            except ValueError as exc:
                raise ConfigError(f"the model of pipeline stage {stage} cannot be built: {exc}") from None
            built.append(BuiltStage(stage, sum(p.numel() for p in params),
                                    sum(p.numel() * p.element_size() for p in params),
                                    sum(p.numel() for p in params if is_moe_param(p))))
            on_built(built[-1])
    return built


def _relative(built: float, estimated: float) -> float:
    return 0.0 if built == estimated else (built - estimated) / max(abs(estimated), 1e-30)


def compare(layout: Layout, built: BuiltStage) -> dict[str, tuple[float, float]]:
    """(built, estimated) parameters, weights, gradients and optimizer-state bytes of a stage."""
    state = parameter_state(layout, built.params, weight_bytes=built.param_bytes, expert_params=built.expert_params)
    estimate = dict(estimate_stages(layout)[built.stage].terms)
    pairs = {"parameters": (built.params, layout.stages[built.stage].params_per_tp_rank)}
    for name, value in zip(_TERMS, (state.weights, state.gradients, state.optimizer)):
        pairs[name] = (value, estimate[name])
    return pairs


def stage_line(layout: Layout, built: BuiltStage) -> str:
    pairs = compare(layout, built)
    count, estimated = pairs["parameters"]
    gb = ", ".join(f"{name} {pairs[name][0] / GB:.2f}/{pairs[name][1] / GB:.2f}" for name in _TERMS)
    return (f"  stage {built.stage}: {count:,} parameters built, {estimated:,} estimated "
            f"({100 * _relative(count, estimated):+.2f}%); GB built/estimated: {gb}")


def worst(layout: Layout, built: list[BuiltStage]) -> tuple[float, int, str]:
    """The largest relative difference: (difference, stage, quantity)."""
    return max((abs(_relative(*pair)), b.stage, name) for b in built for name, pair in compare(layout, b).items())


def _print(line: str) -> None:
    print(line, flush=True)


def report(run: Run, eod_token: int, out=_print) -> list[BuiltStage]:
    """Build on the meta device and print a line per stage as it is built (the progress of a
    long build), then the verdict against the estimate."""
    layout = run.layout
    out(f"model built on the meta device, one rank per pipeline stage (TP rank 0 of {layout.tp}, DP rank 0; "
        f"no memory used):")
    start = time.monotonic()
    built = build_stages(run, eod_token, on_built=lambda b: out(stage_line(layout, b)))
    diff, stage, name = worst(layout, built)
    took = f"built in {time.monotonic() - start:.1f} s"
    if diff <= TOLERANCE:
        out(f"  every stage within {100 * TOLERANCE:g}% of the estimate ({took})")
    else:
        out(f"WARNING: the built model and the memory estimate differ by {100 * diff:.1f}% ({name}, stage "
            f"{stage}): the estimate does not describe the model this run would train ({took})")
    return built
