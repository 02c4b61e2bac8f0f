"""Mixture-of-experts checkpoints: DeepSpeed's expert files and expert numbering across EP sizes.

With MoE layers DeepSpeed's engine saves differently (deepspeedai/DeepSpeed
``deepspeed/runtime/engine.py``, ``_save_moe_checkpoint`` / ``load_moe_state_dict`` /
``_get_expert_ckpt_name`` / ``_get_optimizer_ckpt_name``, 0.19):

- ``mp_rank_{m:02d}_model_states.pt`` (written by data parallel rank 0 of each TP x PP rank ``m``)
  holds the module's *non-expert* weights under ``"module"``, for the pipeline engine too: with
  MoE layers no ``layer_XX-model_YY`` files are written, each stage's mp_rank file holds its layers
  (keys ``<global layer index>.<name>`` / ``tied_modules.<key>.<name>``, as the layer files would);
- ``layer_{k}_expert_{e}_mp_rank_{m:02d}_model_states.pt``: one file per expert ``e`` of the
  ``k``-th MoE layer *of that model parallel rank's module* (``k`` counts MoE modules in
  ``named_modules`` order, so it restarts at 0 on every pipeline stage), written by expert data
  parallel rank 0 of each expert parallel rank. Its keys are the full parameter names with the
  *global* expert id: ``<layer>.mlp.deepspeed_moe.experts.deepspeed_experts.<e>.<name>``;
- ZeRO-0: ``expp_rank_{r}_mp_rank_{m:02d}_optim_states.pt``, the whole optimizer's
  ``state_dict()`` of expert parallel rank ``r`` (its experts, and the dense parameters, which
  every rank holds alike);
- ZeRO 1-2: the usual ``zero_pp_rank_*`` shards; expert parameters are partitioned over the
  expert data parallel group.

Expert ids: expert parallel rank ``r`` holds ``n = experts / EP`` experts, local ids ``0..n-1``,
global ids ``r * n + local`` (both functions above). A module's own parameter names use local ids.
Consolidated weights (``megatron_ds.checkpoint.consolidate``) use global ids: the names of the same
model at EP 1.
"""
from __future__ import annotations

import collections
import os
import re

# DeepSpeed's moe_str_prefix: what precedes the expert id in a parameter name
EXPERTS_INFIX = ".deepspeed_moe.experts.deepspeed_experts."
_EXPERT_NAME = re.compile(r"^(.*\.deepspeed_moe\.experts\.deepspeed_experts\.)(\d+)(\..+)$")
_EXPERT_FILE = re.compile(r"^layer_(\d+)_expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_EXPERT_OPTIM_FILE = re.compile(r"^expp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


def parse_expert_file(name: str) -> tuple[int, int, int] | None:
    """(MoE layer of the stage, global expert, mp rank) of an expert file's base name, else None."""
    m = _EXPERT_FILE.match(name)
    return (int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else None


def parse_expert_optim_file(name: str) -> tuple[int, int] | None:
    """(expert parallel rank, mp rank) of a ZeRO-0 MoE optimizer file's base name, else None."""
    m = _EXPERT_OPTIM_FILE.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def has_expert_files(path: str) -> bool:
    """Whether the checkpoint directory ``path`` was written by an engine with MoE layers."""
    return any(_EXPERT_FILE.match(n) for n in os.listdir(path))


def expert_id(name: str) -> int | None:
    """The expert id in a parameter name, None for a parameter outside the experts."""
    m = _EXPERT_NAME.match(name)
    return int(m.group(2)) if m else None


def with_expert_id(name: str, expert: int) -> str:
    """``name`` with its expert id replaced by ``expert``."""
    m = _EXPERT_NAME.match(name)
    if m is None:
        raise ValueError(f"{name} is not an expert parameter")
    return f"{m.group(1)}{expert}{m.group(3)}"


def experts_prefix(name: str) -> str:
    """The part of an expert parameter's name before its id (one per MoE layer)."""
    m = _EXPERT_NAME.match(name)
    if m is None:
        raise ValueError(f"{name} is not an expert parameter")
    return m.group(1)


def global_expert(ep_rank: int, local: int, num_local: int) -> int:
    """DeepSpeed's numbering (``_save_moe_checkpoint``): ``ep_rank * num_local_experts + local``."""
    return ep_rank * num_local + local


def place_expert(expert: int, num_local: int) -> tuple[int, int]:
    """(expert parallel rank, local id) holding global expert ``expert``."""
    return divmod(expert, num_local)


def expert_parallel_rank(dp_rank: int, tp_rank: int, *, tp: int, ep: int, expert_tp: bool) -> int:
    """The expert parallel rank of the rank at (data parallel, tensor parallel) coordinates of a pipeline
    stage, in DeepSpeed's group order (explained in ``megatron_ds.parallel.groups``): the rule of
    ``ParallelState.expert_parallel_rank``, for ranks other than this one (checkpoint readers)."""
    return dp_rank % ep if expert_tp else (dp_rank * tp + tp_rank) % ep


def expert_grid_ranks(dp_rank: int, tp_rank: int, *, tp: int, ep: int, etp: int) -> tuple[int, int]:
    """(expert parallel rank, expert data parallel rank) of the rank at (data parallel, tensor parallel) coordinates
    of a pipeline stage in Megatron-LM's expert grid (``ParallelState.expert_grid_rank``; its local rank is
    dp x TP + tp, DeepSpeed's data parallel axis counting DP x CP), for checkpoint readers."""
    local = dp_rank * tp + tp_rank
    return (local // etp) % ep, local // (etp * ep)


def local_counts(names) -> dict[str, int]:
    """{experts prefix: number of distinct expert ids} among ``names`` (the experts a rank holds)."""
    ids = collections.defaultdict(set)
    for name in names:
        if (e := expert_id(name)) is not None:
            ids[experts_prefix(name)].add(e)
    return {prefix: len(found) for prefix, found in ids.items()}


def to_global(state: dict, ep_rank: int) -> dict:
    """Expert parallel rank ``ep_rank``'s state (local expert ids; all its experts of each layer it
    names) with its expert entries renamed to global ids."""
    num_local = local_counts(state)
    out = {}
    for name, value in state.items():
        e = expert_id(name)
        out[name if e is None else with_expert_id(name, global_expert(ep_rank, e, num_local[experts_prefix(name)]))] \
            = value
    return out


def experts_per_layer(names) -> dict[str, int]:
    """{experts prefix: number of experts} of a state with global expert ids (every expert present)."""
    ids = collections.defaultdict(set)
    for name in names:
        if expert_id(name) is not None:
            ids[experts_prefix(name)].add(expert_id(name))
    for prefix, found in ids.items():
        if found != set(range(len(found))):
            raise ValueError(f"{prefix}: experts {sorted(set(range(max(found) + 1)) - found)} are missing")
    return {prefix: len(found) for prefix, found in ids.items()}


def to_local(state: dict, ep_rank: int, ep_size: int) -> dict:
    """The part of a state with global expert ids that expert parallel rank ``ep_rank`` of
    ``ep_size`` holds, renamed to its local ids; non-expert entries are kept."""
    counts = experts_per_layer(state)
    out = {}
    for name, value in state.items():
        e = expert_id(name)
        if e is None:
            out[name] = value
            continue
        total = counts[experts_prefix(name)]
        if total % ep_size:
            raise ValueError(f"{experts_prefix(name)}: {total} experts do not divide over expert parallel size "
                             f"{ep_size}")
        rank, local = place_expert(e, total // ep_size)
        if rank == ep_rank:
            out[with_expert_id(name, local)] = value
    return out
