"""Checkpoints of Megatron-LM's MoE layer (``model/mlm_moe.py``) at expert parallel size > 1.

The layer holds a rank's experts as stacked tensors, ``experts.linear_fc1/linear_fc2.weight`` (and ``.bias``)
``[local experts, out, in]``; expert parallel rank ``r`` of ``EP`` holds global experts ``r x n .. (r+1) x n - 1``,
so the EP 1 tensor is the EP ranks' tensors concatenated along dimension 0 in rank order (Megatron-LM's global
expert index; its own dist-checkpointing shards the same dimension, megatron/core/transformer/moe/experts.py
``TEGroupedMLP.sharded_state_dict``).

DeepSpeed's engine saves an MoE model's module from data parallel rank 0 only (``_save_moe_checkpoint``): it
would keep that rank's experts and lose the others'. So expert data parallel rank 0 of each expert parallel
rank also writes ``stacked_experts_expp_rank_{r}_mp_rank_{m:02d}_model_states.pt`` ({parameter name: its local
stacked tensor}), through the engine's checkpoint writer -- the same files, CRCs, manifest and kill-safety as
DeepSpeed's own, synchronous or --async-save. Readers (``moe_sources.MoEModuleSource``,
``optim_state.SavedOptimizer``) join the ranks' tensors to the EP 1 tensor, and a run at any EP size takes
its rank's slice (``reshard``): a checkpoint with these files is always loaded resharded. Experts split over ETP
ranks (Megatron-LM's expert grid, parallel/groups.py): TP rank t's files hold part t % ETP of its experts; the
parts of the first ETP ranks are the whole (``etp_split``), and a rank loads part tp rank % ETP (``local_part``).
"""
from __future__ import annotations

import os
import re

import torch

from megatron_ds import ds_compat
from megatron_ds.checkpoint.files import checkpoint_names

# experts.linear_fc1.weight but not shared_experts.linear_fc1.weight
_NAME = re.compile(r"(^|\.)experts\.linear_fc[12]\.(weight|bias)$")
_FILE = re.compile(r"^stacked_experts_expp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")


def is_stacked(name: str) -> bool:
    """Whether ``name`` is a stacked expert tensor of Megatron-LM's MoE layer."""
    return _NAME.search(name) is not None


def file_name(ep_rank: int, mp_rank: int) -> str:
    return f"stacked_experts_expp_rank_{ep_rank}_mp_rank_{mp_rank:02d}_model_states.pt"


def parse_file(name: str) -> tuple[int, int] | None:
    """(expert parallel rank, mp rank) of a stacked experts file's base name, else None."""
    m = _FILE.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def has_files(path: str) -> bool:
    return any(_FILE.match(n) for n in os.listdir(path))


def expert_parameters(module: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """This rank's stacked expert parameters split over expert parallel ranks (EP > 1: marked as DeepSpeed's
    experts, ``ds_compat.mark_expert_parameters``)."""
    return {n: p for n, p in module.named_parameters() if is_stacked(n) and getattr(p, "allreduce", True) is False}


def save(engine, save_dir: str, tag: str) -> None:
    """Expert data parallel rank 0 of each expert parallel rank: its stacked experts' file (after DeepSpeed's
    ``save_checkpoint``, which made the folder)."""
    params = expert_parameters(engine.module)
    if not params:
        return
    group = next(iter(params.values())).group_name
    ep_rank, edp_rank = ds_compat.expert_ranks(group)
    if edp_rank != 0:
        return
    saved_as = checkpoint_names(engine.module)  # the layer files' names (model chunks name theirs otherwise)
    state = {saved_as[n]: p.detach().clone() for n, p in params.items()}
    path = os.path.join(save_dir, tag, file_name(ep_rank, ds_compat.checkpoint_mp_rank(engine)))
    ds_compat.checkpoint_engine(engine).save(state, path)


def stacked_parameters(module: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Every stacked expert parameter of this rank's module, split over EP or ETP ranks or whole."""
    return {n: p for n, p in module.named_parameters() if is_stacked(n)}


def local_part(name: str, tensor: torch.Tensor, module_params: dict, tp_rank: int) -> torch.Tensor:
    """This rank's part of the full (all experts, whole) ``tensor`` of parameter ``name``: ``module_params`` is
    ``stacked_parameters`` of this rank's module (another parameter is returned whole). Its experts' slice at
    EP > 1 (marked as DeepSpeed's experts), then with expert tensor parallelism (``tensor_model_parallel``:
    ``model/mlm_moe.py`` ``_Stacked``) tensor parallel rank ``tp_rank``'s part of each expert."""
    param = module_params.get(name)
    if param is None:
        return tensor
    if getattr(param, "allreduce", True) is False:
        ep_rank, _ = ds_compat.expert_ranks(param.group_name)
        n = param.shape[0]
        if tensor.shape[0] % n:
            raise ValueError(f"{name}: {tensor.shape[0]} saved experts do not divide into parts of {n}")
        tensor = tensor.narrow(0, ep_rank * n, n)
    if getattr(param, "tensor_model_parallel", False):  # split over ETP: part tp_rank % ETP (Megatron-LM's grid)
        dim, stride = param.partition_dim, param.partition_stride
        world = tensor.shape[dim] // param.shape[dim]
        blocks = torch.split(tensor, param.shape[dim] // stride, dim=dim)
        tensor = torch.cat(blocks[tp_rank % world::world], dim=dim)
    return tensor


def etp_split(name: str, shard_shape: torch.Size, model) -> tuple[int, int, int] | None:
    """(dim, stride, parts) along which saved tensor parallel shards of stacked expert ``name`` are parts of the
    whole (experts split over ETP: smaller than ``model``'s experts there; the first ``parts`` = ETP tensor parallel
    ranks hold one each, the others repeat them, Megatron-LM's expert grid), None when each shard is whole."""
    gated = 2 if (model.swiglu or model.geglu) else 1
    if ".linear_fc1." in name:
        dim, stride, full = 1, gated, gated * model.moe_ffn_hidden_size
    elif name.endswith("linear_fc2.weight"):
        dim, stride, full = 2, 1, model.moe_ffn_hidden_size
    else:  # fc2's bias: whole on every rank
        return None
    return (dim, stride, full // shard_shape[dim]) if shard_shape[dim] < full else None


def join(parts: dict[int, torch.Tensor]) -> torch.Tensor:
    """The EP 1 tensor from {expert parallel rank: its stacked tensor} (every rank present)."""
    if sorted(parts) != list(range(len(parts))):
        raise ValueError(f"stacked experts of expert parallel ranks {sorted(parts)}: some are missing")
    return torch.cat([parts[r] for r in range(len(parts))])


def local_shape(shape: torch.Size, ep: int) -> torch.Size:
    return torch.Size((shape[0] // ep, *shape[1:]))
