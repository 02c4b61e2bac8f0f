"""A checkpoint's fp32 master weights, as a layer source for consolidation, export and resharding.

Mixed-precision runs (bf16, fp16) and every ZeRO stage keep an fp32 copy of each weight in the
optimizer files; the module files hold the weights rounded to the training precision. Exporting
from the masters keeps the bits that rounding drops (``tools/checkpoint/to_hf.py
--from-fp32-masters``). ZeRO-3 checkpoints hold the weights only as masters (their module files
are empty): they are always read from here, rounded to the training precision unless ``exact``, so
that a ZeRO-3 checkpoint consolidates to what its model computed with, as the other stages do.
An fp32 ZeRO-0 run has no separate masters: its torch optimizer updates the weights themselves.
"""
from __future__ import annotations

import torch

from megatron_ds.checkpoint.consolidate import _LayerFileSource, _ModuleSource
from megatron_ds.checkpoint.files import CheckpointFiles
from megatron_ds.config import ConfigError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class MasterSource:
    """Per-layer tensor parallel shards ({local name: tensor}) of the fp32 master weights."""

    def __init__(self, ckpt: CheckpointFiles, *, exact: bool):
        from megatron_ds.checkpoint.reshard import SavedOptimizer  # noqa: PLC0415 - reshard imports consolidate

        self.ckpt = ckpt
        self.dtype = None if exact else DTYPES[ckpt.precision]
        if ckpt.meta.get("weights_only"):
            raise ConfigError(f"{ckpt.path} holds weights only (an imported model): it has no fp32 master weights")
        self.zero3 = None
        if ckpt.zero_stage == 3:
            from megatron_ds.checkpoint.zero3 import Zero3State  # noqa: PLC0415

            self.zero3 = Zero3State(ckpt, with_moments=False)
            return
        self.plain_fp32 = ckpt.precision == "fp32" and ckpt.zero_stage == 0
        self.weights = _LayerFileSource(ckpt) if ckpt.has_layer_files() else _ModuleSource(ckpt)
        self.saved = None if self.plain_fp32 else SavedOptimizer(ckpt, with_moments=False)

    def shards(self, idx: int, prefix: str) -> list[dict[str, torch.Tensor]]:
        if self.zero3 is not None:  # PP is 1 under ZeRO-3: model parallel rank = tensor parallel rank
            shards = [{name[len(prefix):]: self.zero3.tensor(name, t) for name in self.zero3.names(t)
                       if name.startswith(prefix)} for t in range(self.ckpt.tp)]
        else:
            shards = self.weights.shards(idx, prefix)
            if not self.plain_fp32:
                shards = [{local: self._master(prefix + local, t, w.shape) for local, w in shard.items()}
                          for t, shard in enumerate(shards)]
        if self.dtype is None:
            return shards
        return [{k: v.to(self.dtype) for k, v in shard.items()} for shard in shards]

    def _master(self, name: str, tp_rank: int, shape: torch.Size) -> torch.Tensor:
        found = self.saved.tensors(name, tp_rank, shape)
        if found is None or "fp32" not in found:
            raise ConfigError(f"{self.ckpt.path} has no fp32 master weight for {name}")
        return found["fp32"]
