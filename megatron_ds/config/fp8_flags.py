"""The FP8 flags -> one ``Fp8Recipe`` (``parallel/fp8.py``), or a one-line refusal.

Megatron-DeepSpeed (megatron/arguments.py ``_add_transformer_engine_args``, deepspeedai/Megatron-DeepSpeed)
turns FP8 on with ``--fp8-e4m3`` or ``--fp8-hybrid`` and hands Transformer Engine a *delayed* scaling
recipe: ``--fp8-margin`` (default 0), ``--fp8-amax-history-len`` (default 1), ``--fp8-amax-compute-algo``
(most_recent | max, default most_recent), ``--fp8-interval`` (declared "DEPRECATED. This flag is
ignored"), ``--no-fp8-wgrad`` (the weight-gradient GEMM in higher precision) and ``--transformer-impl``
(local | transformer_engine). Megatron-LM spells the format ``--fp8-format e4m3|hybrid`` and picks the
scaling with ``--fp8-recipe tensorwise|delayed|mxfp8|blockwise`` (megatron/training/arguments.py).

Here the GEMMs are torchao's float8 with *current* scaling (the scale comes from the tensor being
cast, not from earlier steps' amax): ``tensorwise`` (one scale per tensor, the default, also what
``--fp8-recipe tensorwise`` means in Megatron-LM) or ``rowwise`` (torchao's, one scale per row). A
history of one amax is the nearest delayed scaling comes to it, so ``--fp8-amax-history-len 1`` and
either ``--fp8-amax-compute-algo`` are accepted; a longer history, ``--fp8-recipe delayed``, ``mxfp8``
and ``blockwise`` need Transformer Engine and are refused naming the recipe to use.
"""
from __future__ import annotations

import importlib.util

from megatron_ds.config.schema import ModelConfig
from megatron_ds.errors import ConfigError
from megatron_ds.parallel.fp8 import Fp8Recipe

_TORCHAO_PATH = "FP8 runs on torchao here: --transformer-impl local with --fp8-hybrid or --fp8-e4m3 (or --fp8-format)"
TRANSFORMER_ENGINE_REFUSAL = (
    ("Transformer Engine is installed, but megatron_ds's layers are its own, not Transformer Engine's; "
     if importlib.util.find_spec("transformer_engine") is not None else "Transformer Engine is not installed; ")
    + _TORCHAO_PATH)

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


def _check_recipe(m: ModelConfig, fmt: str) -> str:
    recipe = m.fp8_recipe or "tensorwise"
    if recipe == "delayed":
        raise ConfigError("--fp8-recipe delayed: delayed scaling (an amax history) needs Transformer Engine, which "
                          "megatron_ds does not use; use --fp8-recipe tensorwise (torchao's current scaling, the default)")
    if recipe in ("mxfp8", "blockwise"):
        raise ConfigError(f"--fp8-recipe {recipe} needs Transformer Engine's block-scaled GEMMs; use --fp8-recipe "
                          f"rowwise (torchao's per-row scales) or tensorwise")
    if recipe == "rowwise" and fmt == "hybrid":
        raise ConfigError("--fp8-recipe rowwise casts every operand to E4M3 (torch._scaled_mm's row-scaled GEMMs); "
                          "use --fp8-format e4m3 (or --fp8-e4m3) with it")
    if (m.fp8_amax_history_len or 1) != 1:
        raise ConfigError(f"--fp8-amax-history-len {m.fp8_amax_history_len}: an amax history is delayed scaling, which "
                          f"needs Transformer Engine; drop it (torchao's current scaling uses the amax of the tensor "
                          f"being cast: a history of 1)")
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
    return Fp8Recipe(format=fmt, granularity=granularity, margin=m.fp8_margin or 0, wgrad=m.fp8_wgrad)


def describe_fp8(recipe: Fp8Recipe | None, m: ModelConfig, *, moe: bool) -> str:
    """The dry run's account of the run's recipe (``Layout.fp8``): layers in FP8, memory effect."""
    if recipe is None:
        return "FP8: off"
    fmt = "E4M3 everywhere" if recipe.format == "e4m3" else "E4M3 forward, E5M2 gradients"
    layers = "QKV, attention output, MLP in/out" + (", MoE experts" if moe else "")
    knobs = "".join([
        f"; --fp8-amax-compute-algo {m.fp8_amax_compute_algo}: with an amax history of 1 it is the current amax"
        if m.fp8_amax_compute_algo else "",
        f"; --fp8-interval {m.fp8_interval}: ignored, as Megatron-DeepSpeed ignores it (deprecated)"
        if m.fp8_interval is not None else ""])
    return (f"FP8: {recipe.format} ({fmt}), torchao {recipe.granularity} current scaling (Megatron's Transformer "
            f"Engine default is delayed scaling), margin {recipe.margin}, weight gradient in "
            f"{'FP8' if recipe.wgrad else 'bf16/fp32'}; in FP8: {layers} of every transformer layer; in bf16/fp32: "
            f"embeddings, norms, output layer; memory: unchanged (bf16/fp32 master weights, activations saved "
            f"in their own dtype; the FP8 copies live only during each GEMM){knobs}")


def fp8_device_error(capability: tuple[int, int] | None) -> str | None:
    """One line when the GPU has no FP8 tensor cores (V100 7.0, A100 8.0): torch._scaled_mm needs 8.9+."""
    if capability is None or tuple(capability) >= FP8_CAPABILITY:
        return None
    return (f"FP8 needs a GPU of compute capability {FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]}+ (Ada, Hopper); this one "
            f"is {capability[0]}.{capability[1]}: drop --fp8-* and train in --bf16")
