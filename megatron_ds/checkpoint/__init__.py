"""Checkpoints: the on-disk format (format, integrity, lock), saving and loading a live engine
(checkpointing), and checkpoints beyond the run that wrote them: consolidation into full weights
(consolidate, sources), resharding to another layout (reshard, optim_state, engine_state),
DeepSpeed universal checkpoints (universal), Hugging Face export and import (export, import_hf).

``load_consolidated`` and friends are re-exported lazily (PEP 562): importing the format modules
must not import DeepSpeed and the model.
"""
from __future__ import annotations

_EXPORTS = ("Consolidated", "iter_consolidated_layers", "load_consolidated")
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from megatron_ds.checkpoint import consolidate  # noqa: PLC0415 - imports DeepSpeed and the model

    return getattr(consolidate, name)
