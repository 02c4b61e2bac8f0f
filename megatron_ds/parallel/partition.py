"""Which transformer layers each pipeline stage holds, for the layout's analytic count
(``config/layout.py``), the model's build (``model/pipeline_model.py``) and the interleaved schedule's
model chunks (``pipeline/chunks.py``) alike.

Without interleaving, DeepSpeed's pipeline engine places the layers itself: ``partition_stages``
is its partition (--pipeline-partition-method). With interleaving, ``chunk_layer_range`` is
Megatron's assignment of layers to the model chunks of each rank.
"""
from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence

from megatron_ds import ds_compat
from megatron_ds.errors import ConfigError


def chunk_layer_range(num_layers: int, pp: int, v: int, rank: int, chunk: int) -> range:
    """Transformer layers (0-based) of chunk ``chunk`` on pipeline rank ``rank``: Megatron's
    assignment, virtual stage ``chunk * pp + rank`` of ``pp * v`` equal ones."""
    per = num_layers // (pp * v)
    stage = chunk * pp + rank
    return range(stage * per, (stage + 1) * per)


def partition_stages(num_stages: int, method: str, names: Sequence[str | None],
                     parameters: Callable[[], Sequence[int]]) -> list[int]:
    """Index of the first layer of each pipeline stage, then the number of layers: how DeepSpeed's
    ``PipelineModule._partition_layers`` splits the layers called ``names`` (class names) by
    --pipeline-partition-method: "uniform" (equal numbers of layers, whatever they hold),
    "parameters" (balanced trainable parameters; ``parameters()`` gives them per layer, asked only
    for this method) or "type:REGEX" (balanced numbers of layers whose class name matches,
    case-insensitive; the default "type:ParallelTransformerLayer" balances transformer layers)."""
    kind, weights = method.lower(), ()  # DeepSpeed lower-cases the method, its regex included
    if kind.startswith("type:"):
        pattern = re.compile(kind.split(":", 1)[1], re.IGNORECASE)
        weights = tuple(1 if name and pattern.search(name) else 0 for name in names)
        if not any(weights):  # DeepSpeed would stop at start-up ("found no valid layers")
            raise ConfigError(f"--pipeline-partition-method {method} matches no layer of the model "
                              f"({', '.join(sorted({n for n in names if n}))})")
    elif kind not in ("uniform", "parameters"):
        raise ConfigError(f"--pipeline-partition-method {method}: DeepSpeed's pipeline knows uniform, parameters "
                          f"and type:REGEX")
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
