"""The FP8 flags -> one ``Fp8Recipe`` (``parallel/fp8.py``), or a one-line refusal.

Megatron-DeepSpeed (megatron/arguments.py ``_add_transformer_engine_args``, deepspeedai/Megatron-DeepSpeed)
turns FP8 on with ``--fp8-e4m3`` or ``--fp8-hybrid`` and hands Transformer Engine a *delayed* scaling
recipe: ``--fp8-margin`` (default 0), ``--fp8-amax-history-len`` (default 1), ``--fp8-amax-compute-algo``
(most_recent | max, default most_recent), ``--fp8-interval`` (declared "DEPRECATED. This flag is
ignored"), ``--no-fp8-wgrad`` (the weight-gradient GEMM in higher precision) and ``--transformer-impl``
(local | transformer_engine). Megatron-LM spells the format ``--fp8-format e4m3|hybrid`` and picks the
scaling with ``--fp8-recipe tensorwise|delayed|mxfp8|blockwise`` (megatron/training/arguments.py).

Here the GEMMs are torchao's float8 casts and ``torch._scaled_mm``, scaled three ways:
- ``delayed``: Transformer Engine's delayed scaling (``parallel/fp8_delayed.py``): each operand's scale from
  the amax history of earlier steps, ``--fp8-amax-history-len``, ``--fp8-amax-compute-algo``, ``--fp8-margin``;
- ``tensorwise``: current scaling, one scale per tensor from the tensor being cast (Megatron-LM's meaning);
- ``rowwise``: torchao's current scaling with one scale per row.
``mxfp8`` and ``blockwise`` need Transformer Engine's block-scaled GEMMs and are refused.

Which recipe runs without ``--fp8-recipe`` (``default_recipe``): Megatron-LM's ``--fp8-format`` means its
``TransformerConfig.fp8_recipe`` default, ``delayed`` (core_v0.19.0 megatron/core/transformer/transformer_config.py);
Megatron-DeepSpeed's ``--fp8-hybrid`` / ``--fp8-e4m3`` (Transformer Engine's ``DelayedScaling``, history 1 by
default) keep the current scaling they have always had here, unless ``--fp8-amax-history-len`` > 1 asks for
the history only delayed scaling reads. ``--fp8-param-gather`` (Megatron-LM: FP8 parameters, gathered in FP8, a
memory and communication saving) is accepted and not made: the weights stay bf16/fp32, cast for each GEMM.
"""
from __future__ import annotations

import importlib.util

from megatron_ds.config.schema import ModelConfig
from megatron_ds.errors import ConfigError
from megatron_ds.parallel.fp8 import Fp8Recipe

# compute capability from which a GPU has FP8 tensor cores (Ada 8.9, Hopper 9.0)
FP8_CAPABILITY = (8, 9)


def fp8_format(m: ModelConfig) -> str | None:
    """"e4m3" | "hybrid" | None (FP8 off), from whichever spelling the command line used."""
    if m.fp8_e4m3 and m.fp8_hybrid:
        # megatron/arguments.py validate_args: "cannot train with both fp8 e4m3 and hybrid formatting"
        raise ConfigError("--fp8-e4m3 and --fp8-hybrid are both set; choose one")
    spelled = "e4m3" if m.fp8_e4m3 else "hybrid" if m.fp8_hybrid else None
    if spelled and m.fp8_format and m.fp8_format != spelled:
        raise ConfigError(f"--fp8-format {m.fp8_format} contradicts --fp8-{spelled}; pass one of them")
    return spelled or m.fp8_format


def default_recipe(m: ModelConfig) -> tuple[str, str]:
    """(the recipe, why) when no --fp8-recipe is given."""
    if m.fp8_recipe:
        return m.fp8_recipe, "--fp8-recipe"
    if m.fp8_format and not (m.fp8_hybrid or m.fp8_e4m3):
        return "delayed", "Megatron-LM's default --fp8-recipe for --fp8-format"
    if (m.fp8_amax_history_len or 1) > 1:
        return "delayed", f"--fp8-amax-history-len {m.fp8_amax_history_len} is delayed scaling's history"
    return "tensorwise", (f"--fp8-{'e4m3' if m.fp8_e4m3 else 'hybrid'} without --fp8-recipe; Megatron-DeepSpeed's "
                          f"Transformer Engine scales from the previous step's amax: --fp8-recipe delayed for that")


def _check_recipe(m: ModelConfig, fmt: str) -> str:
    recipe, _ = default_recipe(m)
    if recipe in ("mxfp8", "blockwise"):
        raise ConfigError(f"--fp8-recipe {recipe} needs Transformer Engine's block-scaled GEMMs; use --fp8-recipe "
                          f"delayed (Megatron-LM's default), rowwise (torchao's per-row scales) or tensorwise")
    if recipe == "rowwise" and fmt == "hybrid":
        raise ConfigError("--fp8-recipe rowwise casts every operand to E4M3 (torch._scaled_mm's row-scaled GEMMs); "
                          "use --fp8-format e4m3 (or --fp8-e4m3) with it")
    if recipe != "delayed" and (m.fp8_amax_history_len or 1) != 1:
        raise ConfigError(f"--fp8-amax-history-len {m.fp8_amax_history_len}: an amax history is delayed scaling's; "
                          f"--fp8-recipe {recipe} scales from the tensor being cast: use --fp8-recipe delayed or drop it")
    if m.fp8_amax_history_len is not None and m.fp8_amax_history_len < 1:
        raise ConfigError(f"--fp8-amax-history-len {m.fp8_amax_history_len} must be >= 1")
    if (m.fp8_margin or 0) < 0:
        raise ConfigError(f"--fp8-margin {m.fp8_margin} must be >= 0")
    return recipe


def fp8_recipe(m: ModelConfig) -> Fp8Recipe | None:
    """The transformer layers' FP8 recipe, or None when no FP8 format is set (the recipe knobs alone
    change nothing, as in Megatron)."""
    fmt = fp8_format(m)
    if fmt is None:
        return None
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError(f"--fp8-{fmt}: FP8 GEMMs come from torchao, which is not installed; pip install 'torchao>=0.18'")
    granularity = _check_recipe(m, fmt)
    if granularity != "delayed":
        return Fp8Recipe(format=fmt, granularity=granularity, margin=m.fp8_margin or 0, wgrad=m.fp8_wgrad)
    return Fp8Recipe(format=fmt, granularity=granularity, margin=m.fp8_margin or 0, wgrad=m.fp8_wgrad,
                     amax_history_len=m.fp8_amax_history_len or 1,
                     amax_compute_algo=m.fp8_amax_compute_algo or "most_recent")


def _scaling(recipe: Fp8Recipe, m: ModelConfig) -> str:
    why = default_recipe(m)[1]
    if recipe.granularity == "delayed":
        return (f"delayed scaling ({why}; Transformer Engine's DelayedScaling): each operand's scale from the "
                f"{recipe.amax_compute_algo} amax of a history of {recipe.amax_history_len} steps, reduced over tensor "
                f"and data parallel ranks, updated after each optimizer step, checkpointed")
    return f"torchao {recipe.granularity} current scaling ({why})"


def describe_fp8(recipe: Fp8Recipe | None, m: ModelConfig, *, moe: bool) -> str:
    """The dry run's account of the run's recipe (``Layout.fp8``): which scaling runs and why, layers in
    FP8, memory effect."""
    if recipe is None:
        return "FP8: off"
    fmt = "E4M3 everywhere" if recipe.format == "e4m3" else "E4M3 forward, E5M2 gradients"
    layers = "QKV, attention output, MLP in/out" + (", MoE experts" if moe else "")
    delayed = recipe.granularity == "delayed"
    knobs = "".join([
        f"; --fp8-amax-compute-algo {m.fp8_amax_compute_algo}: read by delayed scaling only"
        if m.fp8_amax_compute_algo and not delayed else "",
        f"; --fp8-interval {m.fp8_interval}: ignored, as Megatron ignores it (deprecated)"
        if m.fp8_interval is not None else "",
        "; --fp8-param-gather: not made, the weights stay bf16/fp32 and are gathered so, cast to FP8 for each "
        "GEMM (Megatron-LM keeps and gathers them in FP8: less memory and traffic)" if m.fp8_param_gather else ""])
    state = "; per layer an amax history and 3 scales (fp32 buffers)" if delayed else ""
    return (f"FP8: {recipe.format} ({fmt}), {_scaling(recipe, m)}, margin {recipe.margin}, weight gradient in "
            f"{'FP8' if recipe.wgrad else 'bf16/fp32'}; in FP8: {layers} of every transformer layer; in bf16/fp32: "
            f"embeddings, norms, output layer; memory: unchanged (bf16/fp32 master weights, activations saved "
            f"in their own dtype; the FP8 copies live only during each GEMM{state}){knobs}")


def fp8_device_error(capability: tuple[int, int] | None) -> str | None:
    """One line when the GPU has no FP8 tensor cores (V100 7.0, A100 8.0): torch._scaled_mm needs 8.9+."""
    if capability is None or tuple(capability) >= FP8_CAPABILITY:
        return None
    return (f"FP8 needs a GPU of compute capability {FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]}+ (Ada, Hopper); this one "
            f"is {capability[0]}.{capability[1]}: drop --fp8-* and train in --bf16")
