"""Which transformer layers each pipeline stage holds, for the layout's analytic count
(``config/layout.py``), the model's build (``model/pipeline_model.py``) and the interleaved schedule's
model chunks (``pipeline/chunks.py``) alike.

Without interleaving, DeepSpeed's pipeline engine places the layers itself: ``partition_stages``
is its partition (--pipeline-partition-method), plus "layers:N1,...,Np", transformer layers per stage as
given, which Megatron-LM's uneven-stage flags resolve to (``megatron_stage_layers``). With interleaving,
``chunk_layer_range`` is Megatron's assignment of layers to the model chunks of each rank.
"""
from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence

from megatron_ds import ds_compat
from megatron_ds.errors import ConfigError

# The class name of model/transformer.py's layers, which "layers:" counts (and the default method balances)
TRANSFORMER_LAYER = "ParallelTransformerLayer"
EXPLICIT = "layers:"


def chunk_layer_range(num_layers: int, pp: int, v: int, rank: int, chunk: int,
                      counts: Sequence[int] | None = None) -> range:
    """Transformer layers (0-based) of chunk ``chunk`` on pipeline rank ``rank``: Megatron's
    assignment, virtual stage ``chunk * pp + rank`` of ``pp * v`` equal ones, or of ``counts`` layers
    each in virtual-stage order (``megatron_virtual_stage_layers``)."""
    stage = chunk * pp + rank
    if counts is not None:
        start = sum(counts[:stage])
        return range(start, start + counts[stage])
    per = num_layers // (pp * v)
    return range(stage * per, (stage + 1) * per)


def partition_stages(num_stages: int, method: str, names: Sequence[str | None],
                     parameters: Callable[[], Sequence[int]]) -> list[int]:
    """Index of the first layer of each pipeline stage, then the number of layers: how DeepSpeed's
    ``PipelineModule._partition_layers`` splits the layers called ``names`` (class names) by
    --pipeline-partition-method: "uniform" (equal numbers of layers, whatever they hold),
    "parameters" (balanced trainable parameters; ``parameters()`` gives them per layer, asked only
    for this method) or "type:REGEX" (balanced numbers of layers whose class name matches,
    case-insensitive; the default "type:ParallelTransformerLayer" balances transformer layers;
    BigScience's Megatron-DeepSpeed trained BLOOM with "type:transformer|embedding", counting the embedding
    and the tied output layer as one more layer each). Ours: "layers:N1,...,Np", N1 transformer layers on the first
    stage (after the embedding), ..., Np on the last (before the final norm and the output layer)."""
    kind, weights = method.lower(), ()  # DeepSpeed lower-cases the method, its regex included
    if kind.startswith(EXPLICIT):
        return _explicit(num_stages, method, names)
    if kind.startswith("type:"):
        pattern = re.compile(kind.split(":", 1)[1], re.IGNORECASE)
        weights = tuple(1 if name and pattern.search(name) else 0 for name in names)
        if not any(weights):  # DeepSpeed would stop at start-up ("found no valid layers")
            raise ConfigError(f"--pipeline-partition-method {method} matches no layer of the model "
                              f"({', '.join(sorted({n for n in names if n}))})")
    elif kind not in ("uniform", "parameters"):
        raise ConfigError(f"--pipeline-partition-method {method}: DeepSpeed's pipeline knows uniform, parameters "
                          f"and type:REGEX (and here layers:N1,...,Np)")
    if num_stages == 1:
        return [0, len(names)]
    if kind == "uniform":
        return [int(i) for i in ds_compat.partition_uniform(num_items=len(names), num_parts=num_stages)]
    return list(_balanced(tuple(parameters()) if kind == "parameters" else weights, num_stages))


@functools.lru_cache(maxsize=64)
def _balanced(weights: tuple[int, ...], num_stages: int) -> tuple[int, ...]:
    # DeepSpeed's dynamic program is O(layers^2 x stages) in Python: --dry-run's suggestions ask
    # for the same partition more than once
    return tuple(int(i) for i in ds_compat.partition_balanced(weights=list(weights), num_parts=num_stages))


def _explicit(num_stages: int, method: str, names: Sequence[str | None]) -> list[int]:
    """``partition_stages`` of "layers:N1,...,Np": each stage ends right after its last transformer layer (one
    without any, where the previous one ends), the last stage at the end: what precedes the first transformer
    layer (the embedding) is on the first stage, what follows the last one (final norm, output layer) on the last."""
    try:
        counts = [int(n) for n in method[len(EXPLICIT):].split(",")]
    except ValueError:
        raise ConfigError(f"--pipeline-partition-method {method}: give {EXPLICIT}N1,...,Np, integers") from None
    stack = [i for i, name in enumerate(names) if name == TRANSFORMER_LAYER]
    if len(counts) != num_stages or min(counts) < 0 or sum(counts) != len(stack):
        raise ConfigError(f"--pipeline-partition-method {method}: needs {num_stages} counts (one per pipeline stage) "
                          f"of transformer layers adding up to {len(stack)}")
    parts, held = [0], 0
    for n in counts[:-1]:
        held += n
        parts.append(stack[held - 1] + 1 if held else stack[0])
    return parts + [len(names)]


def megatron_stage_layers(num_layers: int, pp: int, *, first: int | None = None, last: int | None = None,
                          embedding: bool = False, loss: bool = False) -> list[int]:
    """Transformer layers per pipeline stage by Megatron-LM's uneven-stage flags (TransformerConfig's checks and
    transformer_layer.py ``get_transformer_layer_offset``): --decoder-first/last-pipeline-num-layers on the first
    / last stage and the rest split evenly over the others; or --account-for-embedding/loss-in-pipeline-split,
    the embedding / the loss counted as one more layer of the even split, on the first / last stage."""
    if (first is not None or last is not None) and (embedding or loss):
        raise ConfigError("--decoder-first/last-pipeline-num-layers cannot be combined with "
                          "--account-for-embedding/loss-in-pipeline-split (as in Megatron-LM); give one kind")
    if first is None and last is None:
        total = num_layers + embedding + loss
        if total % pp:
            raise ConfigError(f"--num-layers {num_layers}{' + 1 (embedding)' if embedding else ''}"
                              f"{' + 1 (loss)' if loss else ''} = {total} is not divisible by "
                              f"--pipeline-model-parallel-size {pp} (Megatron-LM's split)")
        counts = [total // pp] * pp
        counts[0] -= embedding
        counts[-1] -= loss
        return counts
    for flag, n in (("--decoder-first-pipeline-num-layers", first), ("--decoder-last-pipeline-num-layers", last)):
        if n is not None and n <= 0:
            raise ConfigError(f"{flag} {n} must be positive")
    given = [n for n in (first, last) if n is not None]
    middle, rest = pp - len(given), num_layers - sum(given)
    if middle < 0 or bool(middle) != bool(rest) or (middle and rest % middle):
        raise ConfigError(f"{rest} transformer layers left after --decoder-first/last-pipeline-num-layers "
                          f"do not split evenly over the {max(middle, 0)} other stages of PP {pp}")
    counts = [rest // middle] * middle if middle else []
    return ([first] if first is not None else []) + counts + ([last] if last is not None else [])


def megatron_virtual_stage_layers(num_layers: int, pp: int, v: int, *, first: int | None = None,
                                  last: int | None = None, embedding: bool = False, loss: bool = False) -> list[int]:
    """Transformer layers of each of the ``pp * v`` virtual stages (chunk c of rank r is virtual stage
    c * pp + r) by Megatron-LM's uneven-stage flags with interleaving (TransformerConfig's checks,
    get_transformer_layer_offset and get_num_layers_to_build): each rank's layers -- counting the embedding
    and the loss where they are accounted for -- split evenly over its ``v`` chunks; the embedding then
    takes its place in the first chunk of the first rank, the loss in the last chunk of the last rank."""
    ranks = megatron_stage_layers(num_layers, pp, first=first, last=last, embedding=embedding, loss=loss)
    held = [n + (embedding and r == 0) + (loss and r == pp - 1) for r, n in enumerate(ranks)]
    for r, n in enumerate(held):
        if n % v:
            raise ConfigError(f"pipeline rank {r} holds {n} layer{'s' if n != 1 else ''}, which do not split into "
                              f"{v} virtual pipeline chunks (as Megatron-LM requires)")
    counts = [held[r] // v for _ in range(v) for r in range(pp)]
    counts[0] -= embedding
    counts[-1] -= loss
    return counts
