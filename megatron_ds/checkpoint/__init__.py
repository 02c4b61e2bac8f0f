"""Checkpoints beyond the training run that wrote them: consolidation into full weights (any
layout), resharding to another layout, Hugging Face export and import."""
from megatron_ds.checkpoint.consolidate import Consolidated, iter_consolidated_layers, load_consolidated

__all__ = ["Consolidated", "iter_consolidated_layers", "load_consolidated"]
