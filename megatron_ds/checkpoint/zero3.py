"""Reading a ZeRO-3 checkpoint (``--no-pipeline-parallel --zero-stage 3``) parameter by parameter.

DeepSpeed's ZeRO-3 engine writes, per data parallel rank ``d`` and tensor parallel rank ``m``:

- ``zero_pp_rank_{d}_mp_rank_{m:02d}_model_states.pt``: the client state (iteration, LR schedule
  ...), ``param_shapes`` (one ``{name: full shape}`` dict per optimizer sub-group, in flattening
  order) and a module state dict whose tensors are empty (the weights live only in the partitions);
- ``zero_pp_rank_{d}_mp_rank_{m:02d}_optim_states.pt``: ``fp32_flat_groups`` (rank ``d``'s flat fp32
  partition of each sub-group) and the base optimizer's state, one entry per sub-group whose
  ``exp_avg`` / ``exp_avg_sq`` are flat in the same layout.

The layout (DeepSpeed 0.19's ``deepspeed/utils/zero_to_fp32.py``, ``zero3_partitioned_param_info``
and ``_zero3_merge_trainable_params``): every parameter of ``numel`` elements takes
``ceil(numel / dp)`` consecutive elements of each rank's flat partition of its sub-group, the last
rank's share padded at the end; the full parameter is the ranks' shares concatenated, cut to
``numel``. Unlike ``zero_to_fp32`` (which reads the fp32 masters only, via whole-file loads), this
reads one parameter's shares at a time from memory-mapped files, masters and Adam moments alike.
"""
from __future__ import annotations

import math
import os

import torch

from megatron_ds.checkpoint.files import OPTIM_KEYS, CheckpointFiles, load_file, model_states_file, optim_states_file
from megatron_ds.errors import ConfigError

KEYS = ("fp32", *OPTIM_KEYS)


class Zero3State:
    """Full (tensor parallel local) fp32 masters and Adam moments of a ZeRO-3 checkpoint, by name."""

    def __init__(self, ckpt: CheckpointFiles, *, with_moments: bool = True):
        self.path, self.dp = ckpt.path, ckpt.dp
        self.step = None
        self.place: dict[tuple[str, int], tuple[int, int, torch.Size]] = {}  # (name, mp) -> (group, offset, shape)
        self.flats: dict[int, list[dict[str, list[torch.Tensor]]]] = {}  # mp -> per dp rank: key -> groups
        for mp in range(ckpt.tp * ckpt.pp):
            shapes = load_file(self._need(model_states_file(self.path, 0, mp)))["param_shapes"]
            per_rank = [self._rank_flats(load_file(self._need(optim_states_file(self.path, d, mp))), with_moments)
                        for d in range(self.dp)]
            self._index(mp, shapes, per_rank[0]["fp32"])
            self.flats[mp] = per_rank

    def _need(self, path: str) -> str:
        if not os.path.isfile(path):
            raise ConfigError(f"ZeRO-3 checkpoint {self.path} is incomplete: {os.path.basename(path)} is missing")
        return path

    def _rank_flats(self, state: dict, with_moments: bool) -> dict[str, list[torch.Tensor]]:
        osd = state["optimizer_state_dict"]
        partitions = osd.get("partition_count")
        if partitions not in (None, self.dp) and partitions != [self.dp] * len(osd["fp32_flat_groups"]):
            raise ConfigError(f"{self.path}: ZeRO-3 partition count {partitions} differs from DP {self.dp}")
        out = {"fp32": list(osd["fp32_flat_groups"])}
        if with_moments:
            base = osd["optimizer_state_dict"]["state"]
            for key in KEYS[1:]:
                out[key] = [base[g][key] for g in range(len(out["fp32"]))]
            self.step = float(base[0]["step"])
        return out

    def _index(self, mp: int, shapes: list[dict], flats: list[torch.Tensor]) -> None:
        if len(shapes) != len(flats):
            raise ConfigError(f"{self.path}: {len(shapes)} parameter groups but {len(flats)} flat partitions")
        for g, group in enumerate(shapes):
            offset = 0
            for name, shape in group.items():
                self.place[name, mp] = (g, offset, torch.Size(shape))
                offset += math.ceil(torch.Size(shape).numel() / self.dp)
            if offset != flats[g].numel():
                raise ConfigError(f"{self.path}: ZeRO-3 group {g} holds {flats[g].numel()} elements per rank, its "
                                  f"parameters need {offset}; not a layout this reader knows")

    def names(self, mp: int) -> list[str]:
        return [name for name, m in self.place if m == mp]

    def has(self, name: str, mp: int) -> bool:
        return (name, mp) in self.place

    def tensor(self, name: str, mp: int, key: str = "fp32") -> torch.Tensor:
        """The full (TP-local) tensor ``key`` of parameter ``name`` on model parallel rank ``mp``."""
        g, offset, shape = self.place[name, mp]
        share = math.ceil(shape.numel() / self.dp)
        parts = [rank[key][g][offset:offset + share] for rank in self.flats[mp]]
        return torch.cat(parts)[:shape.numel()].view(shape).detach()

    def tensors(self, name: str, mp: int) -> dict[str, torch.Tensor]:
        return {key: self.tensor(name, mp, key) for key in self.flats[mp][0]}
