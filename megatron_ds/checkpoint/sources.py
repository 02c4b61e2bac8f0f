"""Where a checkpoint's weights come from, layer by layer: per-layer tensor parallel shards
(``{local name: tensor}``) for consolidation, export and resharding.

- ``LayerFileSource``: DeepSpeed's per-layer files (``layer_XX-model_YY-model_states.pt``, the
  pipeline engine and the interleaved schedule);
- ``ModuleSource``: the plain engine's module in the ``mp_rank`` files (``--no-pipeline-parallel``);
- ``MoEModuleSource`` (``moe_sources``): an engine with MoE layers, either engine: the mp_rank files
  and DeepSpeed's expert files;
- ``MasterSource``: the fp32 master weights in the optimizer files. Mixed-precision runs (bf16,
  fp16) and every ZeRO stage keep an fp32 copy of each weight there; the module files hold the
  weights rounded to the training precision. Exporting from the masters keeps the bits that
  rounding drops (``tools/checkpoint/to_hf.py --from-fp32-masters``). ZeRO-3 checkpoints hold the
  weights only as masters (their module files are empty): they are always read from here, rounded
  to the training precision unless ``exact``, so that a ZeRO-3 checkpoint consolidates to what its
  model computed with, as the other stages do. An fp32 ZeRO-0 run has no separate masters: its
  torch optimizer updates the weights themselves.
"""
from __future__ import annotations

import torch

from megatron_ds.checkpoint import expert_files, stacked_experts
from megatron_ds.checkpoint.files import CheckpointFiles, is_buffer_state, load_file
from megatron_ds.checkpoint.moe_sources import MoEModuleSource
from megatron_ds.checkpoint.optim_state import SavedOptimizer
from megatron_ds.checkpoint.zero3 import Zero3State
from megatron_ds.errors import ConfigError
from megatron_ds.parallel.utils import PRECISION_DTYPES


class ModuleSource:
    """Per-layer tensor parallel shards from the plain engine's mp_rank files (module under "module")."""

    def __init__(self, ckpt: CheckpointFiles):
        self.modules = []
        for t in range(ckpt.tp):
            state = load_file(ckpt.mp_file(t))
            if not state.get("module"):
                raise ConfigError(f"{ckpt.path} has neither pipeline layer files nor module weights in "
                                  f"{ckpt.mp_file(t)}")
            self.modules.append(state["module"])

    def shards(self, idx: int, prefix: str) -> list[dict]:
        return [{k[len(prefix):]: v for k, v in m.items() if k.startswith(prefix)} for m in self.modules]


class LayerFileSource:
    """Per-layer tensor parallel shards from DeepSpeed's per-layer files (the pipeline engine)."""

    def __init__(self, ckpt: CheckpointFiles):
        self.ckpt = ckpt

    def shards(self, idx: int, prefix: str) -> list[dict]:
        paths = [self.ckpt.layer_file(idx, t) for t in range(self.ckpt.tp)]
        try:
            return [load_file(p) for p in paths]
        except FileNotFoundError as exc:
            raise ConfigError(f"checkpoint {self.ckpt.path} is incomplete: {exc.filename} is missing") from None


def layer_source(ckpt: CheckpointFiles, *, from_masters: bool = False):
    """Where a layer's tensor parallel shards come from: the module's weights (layer files or the
    plain engine's module), or the optimizer's fp32 masters (``from_masters``; ZeRO-3 checkpoints
    always, rounded to the training precision unless ``from_masters``: ZeRO-3 keeps no other copy)."""
    if from_masters or ckpt.zero_stage == 3:
        return MasterSource(ckpt, exact=from_masters)
    return module_weights(ckpt)


def module_weights(ckpt: CheckpointFiles):
    """The module's saved weights: per-layer files (pipeline engine), the mp_rank files' module, or
    with MoE layers (DeepSpeed then writes no layer files) the mp_rank files and the expert files."""
    if expert_files.has_expert_files(ckpt.path) or stacked_experts.has_files(ckpt.path):
        return MoEModuleSource(ckpt)
    return LayerFileSource(ckpt) if ckpt.has_layer_files() else ModuleSource(ckpt)


class MasterSource:
    """Per-layer tensor parallel shards ({local name: tensor}) of the fp32 master weights."""

    def __init__(self, ckpt: CheckpointFiles, *, exact: bool):
        self.ckpt = ckpt
        self.dtype = None if exact else PRECISION_DTYPES[ckpt.precision]
        if ckpt.meta.get("weights_only"):
            raise ConfigError(f"{ckpt.path} holds weights only (an imported model): it has no fp32 master weights")
        self.zero3 = None
        if ckpt.zero_stage == 3:
            self.zero3 = Zero3State(ckpt, with_moments=False)
            return
        self.plain_fp32 = ckpt.precision == "fp32" and ckpt.zero_stage == 0
        self.weights = module_weights(ckpt)
        self.saved = None if self.plain_fp32 else SavedOptimizer(ckpt, with_moments=False)

    def shards(self, idx: int, prefix: str) -> list[dict[str, torch.Tensor]]:
        if self.zero3 is not None:  # PP is 1 under ZeRO-3: model parallel rank = tensor parallel rank
            shards = [{name[len(prefix):]: self.zero3.tensor(name, t) for name in self.zero3.names(t)
                       if name.startswith(prefix)} for t in range(self.ckpt.tp)]
        else:
            shards = self.weights.shards(idx, prefix)
            if not self.plain_fp32:
                # buffers (FP8 delayed scaling's amax history and scales, MoE expert biases) are kept as saved
                # (fp32): no masters
                shards = [{local: w if is_buffer_state(local) else self._master(prefix + local, t, w.shape)
                           for local, w in shard.items()} for t, shard in enumerate(shards)]
        if self.dtype is None:
            return shards
        return [{k: v if is_buffer_state(k) else v.to(self.dtype) for k, v in shard.items()} for shard in shards]

    def _master(self, name: str, tp_rank: int, shape: torch.Size) -> torch.Tensor:
        found = self.saved.tensors(name, tp_rank, shape)
        if found is None or "fp32" not in found:
            raise ConfigError(f"{self.ckpt.path} has no fp32 master weight for {name}")
        return found["fp32"]
