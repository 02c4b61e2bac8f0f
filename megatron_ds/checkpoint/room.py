"""How much disk one checkpoint takes, and how many checkpoints a run writes and keeps.

The size is measured where it can be: the newest complete checkpoint of the same layout in the
directory (its manifest lists every file's size), plus a small margin for what changes between
saves (the RNG states, the config record). Otherwise it is estimated from the parameter count --
the module in its precision plus the fp32 master weights and Adam's two moments -- with a margin
for what the bytes per parameter leave out: each tensor's zip record and pickle entry (about 16 KB
per layer and tensor parallel rank: a dozen tensors, each saved as weight, master and moments), the
client state, the config record and the manifest (128 KB). Measured on the 2-layer test model:
436 KB, estimated 539 KB; the bytes per parameter alone said 361 KB.
"""
from __future__ import annotations

import json
import os

from megatron_ds.checkpoint.format import MANIFEST, list_steps, read_meta, step_dir
from megatron_ds.checkpoint.integrity import quick_status

_ESTIMATE_MARGIN, _ESTIMATE_FIXED, _ESTIMATE_PER_LAYER = 0.05, 128_000, 16_000
_MEASURED_MARGIN, _MEASURED_FIXED = 0.02, 64_000


def human_bytes(n: float) -> str:
    """``n`` bytes in the unit that fits (decimal, as disk sizes are sold): 436 KB, 1.4 MB, 182 GB."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def estimated_bytes(layout) -> int:
    """Estimated size of one checkpoint of ``layout`` (no margin): the module in its precision plus fp32
    master weights and two Adam moments (12 bytes/parameter) when mixed precision keeps them, 8
    (moments) in fp32."""
    weight = {"fp16": 2, "bf16": 2}.get(layout.precision, 4)
    optimizer = 12 if weight == 2 else 8
    return layout.total_params * (weight + optimizer)


def _manifest_bytes(path: str) -> int | None:
    try:
        with open(os.path.join(path, MANIFEST), "rb") as f:
            files = json.loads(f.read().decode("utf-8"))["files"]
        return sum(int(e["size"]) for e in files.values()) + os.path.getsize(os.path.join(path, MANIFEST))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def measured_bytes(directory: str | None, signature: dict | None = None) -> tuple[int, str] | None:
    """(size, path) of the newest complete checkpoint in ``directory`` written with ``signature`` (any
    layout when None); None when there is none."""
    if not directory:
        return None
    for step in list_steps(directory):
        path = step_dir(directory, step)
        if quick_status(path) is not None:
            continue
        if signature is not None:
            try:
                if read_meta(path).get("signature") != signature:
                    continue
            except (OSError, ValueError):
                continue
        size = _manifest_bytes(path)
        if size is not None:
            return size, path
    return None


def checkpoint_room(layout, signature: dict, directories=()) -> tuple[int, str]:
    """(bytes one checkpoint of ``layout`` needs, with its margin; how it was found) -- measured from
    the newest complete checkpoint of this layout in ``directories`` (--save, --load), else estimated."""
    for directory in directories:
        found = measured_bytes(directory, signature)
        if found is not None:
            size, path = found
            return int(size * (1 + _MEASURED_MARGIN)) + _MEASURED_FIXED, f"measured from {path}"
    size = estimated_bytes(layout) * (1 + _ESTIMATE_MARGIN) + _ESTIMATE_FIXED
    size += _ESTIMATE_PER_LAYER * layout.model.num_layers * layout.tp
    return int(size), "estimated from the parameter count"


def complete_checkpoints(directory: str) -> int:
    """How many complete checkpoints ``directory`` holds (``--keep-last`` counts these)."""
    return sum(1 for s in list_steps(directory) if quick_status(step_dir(directory, s)) is None)


def saves_planned(start: int, train_iters: int, save_interval: int | None) -> int:
    """How many checkpoints a run from iteration ``start`` to ``train_iters`` writes: one every
    ``save_interval`` iterations and one at the end (``training.loop``), unless the end is one of them."""
    if start >= train_iters:
        return 0
    if not save_interval:
        return 1
    at_interval = train_iters // save_interval - start // save_interval
    return at_interval + (1 if train_iters % save_interval else 0)


def peak_new_checkpoints(saves: int, existing: int, keep_last: int | None) -> int:
    """The most checkpoints beyond those ``directory`` holds now that a run writing ``saves`` of them
    needs room for at once. Pruning (``--keep-last K``) runs after each save completes, so a save
    needs room for itself while the K kept before it are still there."""
    if saves == 0:
        return 0
    if keep_last is None:
        return saves
    # before save i (i >= 2) the directory holds min(existing + i - 1, K) complete checkpoints
    return max(1, min(existing + saves - 1, keep_last) + 1 - existing)

