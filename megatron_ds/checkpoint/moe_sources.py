"""Reading a checkpoint written by an engine with MoE layers (layout: ``megatron_ds.checkpoint.expert_files``).

``MoEModuleSource`` gives the per-layer tensor parallel shards that consolidation, export and
resharding read (``megatron_ds.checkpoint.sources``): the non-expert weights from every TP x PP
rank's mp_rank file, the experts from DeepSpeed's expert files, under their global expert ids (Megatron-LM's
layer: from its stacked experts files, every expert parallel rank's joined, ``stacked_experts``).
``expert_optimizer_files`` lists ZeRO-0's per expert parallel rank optimizer files.
"""
from __future__ import annotations

import collections
import os

import torch
import torch.distributed as dist
from deepspeed.moe.layer import MoE

from megatron_ds.checkpoint import expert_files, stacked_experts
from megatron_ds.checkpoint.files import CheckpointFiles, load_file
from megatron_ds.checkpoint.format import EXPERT_TENSOR_PARALLEL_SIZE
from megatron_ds.errors import ConfigError


class MoEModuleSource:
    """Per-layer tensor parallel shards ({local name: tensor}) of an MoE engine's checkpoint."""

    def __init__(self, ckpt: CheckpointFiles):
        self.ckpt = ckpt
        # tp rank -> the module of each pipeline stage (mp rank = pp rank * tp + tp rank)
        self.modules = {t: [self._module(pp * ckpt.tp + t) for pp in range(ckpt.pp)] for t in range(ckpt.tp)}
        self.expert_files = collections.defaultdict(dict)  # tp rank -> {full name (global id): file}
        # Whole experts (no --enable-expert-tensor-parallelism): DeepSpeed's expert parallel groups
        # span tensor parallel ranks, so one TP rank's files may hold only some experts; any TP
        # rank's copy of an expert is the expert.
        whole = not ckpt.model.enable_expert_tensor_parallelism
        # Megatron-LM's layer at EP > 1 (stacked_experts): tp rank -> {name: {expert parallel rank: tensor}},
        # whole experts on every TP rank too (a TP rank's own file first), else the file of a rank holding the same
        # expert tensor parallel part (Megatron-LM's expert grid: TP rank t holds part t % ETP)
        self.stacked = {t: collections.defaultdict(dict) for t in range(ckpt.tp)}
        etp = ckpt.meta["signature"].get(EXPERT_TENSOR_PARALLEL_SIZE, 1)
        for name in sorted(os.listdir(ckpt.path)):
            if (found := stacked_experts.parse_file(name)) is not None:
                state = load_file(os.path.join(ckpt.path, name))
                for t in range(ckpt.tp):
                    for key, tensor in state.items():
                        key = ckpt.saved_name(key)  # (written by name since model chunks save theirs)
                        if found[1] % ckpt.tp == t or (found[1] % ckpt.tp % etp == t % etp
                                                       and found[0] not in self.stacked[t][key]):
                            self.stacked[t][key][found[0]] = tensor
                continue
            parsed = expert_files.parse_expert_file(name)
            if parsed is None:
                continue
            path = os.path.join(ckpt.path, name)
            for key in load_file(path):
                for t in range(ckpt.tp) if whole else (parsed[2] % ckpt.tp,):
                    self.expert_files[t].setdefault(key, path)

    def _module(self, mp: int) -> dict:
        try:
            state = load_file(self.ckpt.mp_file(mp))
        except FileNotFoundError:
            raise ConfigError(f"checkpoint {self.ckpt.path} is incomplete: {self.ckpt.mp_file(mp)} is missing") from None
        if not state.get("module"):
            raise ConfigError(f"{self.ckpt.mp_file(mp)} holds no module weights")
        # an interleaved or ZB-H1 run's engine saves its model chunks' state dict: the layer files' names instead (its
        # tied weight twice, under its own and its chunk's name: the same tensor)
        return {self.ckpt.saved_name(k): v for k, v in state["module"].items()}

    def shards(self, idx: int, prefix: str) -> list[dict[str, torch.Tensor]]:
        out = []
        for t in range(self.ckpt.tp):
            shard = {}
            for module in self.modules[t]:  # a tied module is on two stages, the same tensors: first one wins
                for k, v in module.items():
                    if k.startswith(prefix):
                        shard.setdefault(k[len(prefix):], v)
            files = {path for key, path in self.expert_files[t].items() if key.startswith(prefix)}
            for path in sorted(files):
                shard.update({k[len(prefix):]: v for k, v in load_file(path).items() if k.startswith(prefix)})
            # the module file holds data parallel rank 0's experts only: every rank's, joined
            shard.update({k[len(prefix):]: stacked_experts.join(parts) for k, parts in self.stacked[t].items()
                          if k.startswith(prefix)})
            out.append(shard)
        return out

    def shapes(self, tp_rank: int) -> dict[str, torch.Size]:
        """{full name (global expert ids): shape} of every saved tensor of ``tp_rank``."""
        out = {k: v.shape for module in self.modules[tp_rank] for k, v in module.items()}
        for path in sorted(set(self.expert_files[tp_rank].values())):
            out.update({k: v.shape for k, v in load_file(path).items()})
        out.update({k: stacked_experts.join(parts).shape for k, parts in self.stacked[tp_rank].items()})
        return out


def expert_optimizer_files(ckpt: CheckpointFiles) -> dict[int, dict[int, str]]:
    """{mp rank: {expert parallel rank: path}} of ZeRO-0's MoE optimizer files (empty without them)."""
    out = collections.defaultdict(dict)
    for name in os.listdir(ckpt.path):
        parsed = expert_files.parse_expert_optim_file(name)
        if parsed is not None:
            out[parsed[1]][parsed[0]] = os.path.join(ckpt.path, name)
    return dict(out)


def expert_global_names(module: torch.nn.Module) -> dict[str, str]:
    """{expert parameter name of this rank's ``module`` (local id): the same with its global id}.
    A DeepSpeed ``MoE`` layer holds ``num_local_experts`` experts of its expert parallel group
    (``deepspeed_moe.ep_group``, set by the engine; none outside an engine: EP 1)."""
    out = {}
    for prefix, sub in module.named_modules():
        if not isinstance(sub, MoE) or not hasattr(sub, "deepspeed_moe"):  # or Megatron-LM's layer's engine marker
            continue
        group = getattr(sub.deepspeed_moe, "ep_group", None)
        ep_rank = dist.get_rank(group=group) if group is not None else 0
        for name, _ in sub.named_parameters(prefix=prefix):
            e = expert_files.expert_id(name)
            if e is not None:
                global_id = expert_files.global_expert(ep_rank, e, sub.num_local_experts)
                out[name] = expert_files.with_expert_id(name, global_id)
    return out
