"""Process groups for tensor, pipeline and data parallelism, built from DeepSpeed's topology.

The rank layout is DeepSpeed's ``PipeModelDataParallelTopology`` (axes pipe, data, model): tensor
parallel ranks are adjacent (they talk the most, so they should share a node), then data
parallel, then pipeline stages. The same topology object is handed to the ``PipelineModule`` so
both agree on who is who. ``ParallelState`` doubles as the ``mpu`` object DeepSpeed's engine takes
when the model is not a pipeline.

DeepSpeed-Ulysses (sequence parallel size SP > 1, plain engine only) adds a "sequence" axis between
data and model: TP ranks stay adjacent, the SP ranks of one sequence come next (they all-to-all in
every layer), then DP. At TP 1 that makes an SP group ``SP`` consecutive ranks, as Megatron-DeepSpeed's
``initialize_model_parallel`` builds them (megatron/core/parallel_state.py). SP ranks hold the same
weights, so they belong to the "sequence data parallel" group DeepSpeed's engine and ZeRO reduce
gradients over (sum over SP x DP, divided by DP: runtime/engine.py ``_reduce_non_expert_gradients``),
and not to the model parallel group (TP x PP: checkpoint ranks, gradient norms).

Context parallelism (Megatron-LM's --context-parallel-size CP, parallel/context_parallel.py): CP ranks hold
the same weights and split every sequence, so Megatron reduces gradients over data x context parallel ranks
(megatron/core/parallel_state.py ``get_data_parallel_group(with_context_parallel=True)``; its rank order
"tp-cp-ep-dp-pp": TP fastest, then CP, then DP, then PP). Here DeepSpeed's topology gets a data axis of
DP x CP ranks, and the CP groups are runs of CP consecutive data coordinates: rank = ((pp x DP + dp) x CP + cp)
x TP + tp, Megatron's order. DeepSpeed's engine then averages gradients over DP x CP and ZeRO shards over them,
as Megatron's distributed optimizer shards over dp-cp; the loss each CP rank returns is scaled for that
(model/language_model.py). The CP ranks of one data parallel rank read the same micro-batches
(``loader_rank``), as TP ranks do.

Mixture of experts: the expert parallel groups (ranks that split one MoE layer's experts and
all-to-all tokens) and expert data parallel groups (ranks holding the same experts, which average
their gradients) are DeepSpeed's own (deepspeed/utils/groups.py), created by ``expert_groups`` on every
rank before the engine exists; ``expert_parallel_rank`` transcribes the rank order they get, so a
model can be built holding the right experts (and ``expert_groups`` checks DeepSpeed agrees). Within
each pipeline stage DeepSpeed orders the ranks data-major, tensor-minor, as our topology does:
- without --enable-expert-tensor-parallelism (``_create_expert_and_data_parallel``), an expert
  parallel group is ``EP`` consecutive ranks of the stage, so tensor parallel ranks are expert parallel
  ranks too: at TP 2, EP 2 the two TP ranks of a replica hold half the experts each, and DeepSpeed's
  MoE hands each TP rank half of every expert's capacity slots (sharded_moe.py drop_tokens); the
  expert data parallel group is every ``EP``-th rank of the stage (TP ranks included);
- with it (``_create_expert_data_and_model_parallel``), each TP rank holds a TP slice of its experts,
  the expert parallel group is ``EP`` consecutive data parallel ranks of one TP rank, and the expert
  data parallel group the data parallel ranks ``EP`` apart.
DeepSpeed divides expert gradients by the data parallel size either way (runtime/engine.py
``_reduce_expert_gradients``), which is right since each expert's gradient sums all of its tokens.

Megatron-LM's MoE (model/mlm_moe.py) gets Megatron-LM's expert grid instead (``expert_grid``): each pipeline stage's
TP x CP x DP ranks, in rank order, are laid out as ETP x EP x expert data parallel (EDP) ranks, ETP fastest
(megatron/core/parallel_state.py initialize_model_parallel: the expert RankGenerator, order "tp-ep-dp-pp", tp =
--expert-tensor-parallel-size). At ETP 1 and ETP = TP these are the groups DeepSpeed's two functions above build;
in between (e.g. TP 4, ETP 2, EP 2) only the grid exists. The grid's EP and EDP groups are registered as DeepSpeed's
expert groups (``ds_compat.register_expert_groups``), so its engine and ZeRO reduce and partition the experts over
them; the ETP group (``expert_tensor_parallel_group``) is what the layer gathers tokens over.
"""
from __future__ import annotations

import torch.distributed as dist

from megatron_ds import ds_compat
from megatron_ds.ds_compat import PipeModelDataParallelTopology, ProcessTopology

# this process's groups of Megatron-LM's expert grid (``ParallelState.expert_grid``): the layers look their expert
# tensor parallel group up at their first forward, as their expert parallel group (a build on the meta device has none)
_EXPERT_GRID: dict = {}


def expert_grid_lists(stage_ranks: list[int], ep: int, etp: int) -> dict[str, list[list[int]]]:
    """Megatron-LM's expert grid over one pipeline stage's ranks (in rank order): local rank i is expert tensor
    parallel rank i % ETP, expert parallel rank (i // ETP) % EP, expert data parallel rank i // (ETP x EP). ->
    {"etp", "ep", "edp", "emp" (ETP x EP: the ranks holding one copy of every expert's every shard): group lists}."""
    edp = len(stage_ranks) // (ep * etp)
    at = lambda d, e, t: stage_ranks[(d * ep + e) * etp + t]  # noqa: E731
    return {"etp": [[at(d, e, t) for t in range(etp)] for d in range(edp) for e in range(ep)],
            "ep": [[at(d, e, t) for e in range(ep)] for d in range(edp) for t in range(etp)],
            "edp": [[at(d, e, t) for d in range(edp)] for e in range(ep) for t in range(etp)],
            "emp": [[at(d, e, t) for e in range(ep) for t in range(etp)] for d in range(edp)]}


def expert_tensor_parallel_group():
    """This process's expert tensor parallel group of Megatron-LM's grid (``ParallelState.expert_grid``)."""
    if "etp" not in _EXPERT_GRID:
        raise RuntimeError("Megatron-LM's expert grid was not built (ParallelState.expert_grid, before the model runs)")
    return _EXPERT_GRID["etp"]


def make_topology(tp: int, pp: int, dp: int, sp: int = 1):
    if sp == 1:  # the class DeepSpeed's PipelineModule expects
        return PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
    return ProcessTopology(axes=["pipe", "data", "sequence", "model"], dims=[pp, dp, sp, tp])


def context_parallel_groups(topology, cp: int) -> list[list[int]]:
    """The context parallel groups of a topology whose data axis is DP x CP: CP consecutive data coordinates
    of one pipeline stage and TP rank (module docstring)."""
    dims = dict(zip(topology.get_axis_names(), topology.dims))
    return [[topology.get_rank(pipe=p, data=d * cp + i, model=t) for i in range(cp)]
            for p in range(dims["pipe"]) for d in range(dims["data"] // cp) for t in range(dims["model"])]


class ParallelState:
    """This rank's groups and coordinates. Every rank must construct it (group creation is collective)."""

    def __init__(self, tp: int, pp: int, dp: int | None = None, sp: int = 1, cp: int = 1):
        """``dp``: the data parallel ranks reading different samples (without CP); DeepSpeed's data parallel
        axis (``dp_rank``, ``dp_size``, ``dp_group``) is DP x CP ranks (module docstring)."""
        world = dist.get_world_size()
        if dp is None:
            dp = world // (tp * pp * sp * cp)
        if tp * pp * sp * cp * dp != world:
            raise ValueError(f"TP {tp} x PP {pp} x SP {sp} x CP {cp} x DP {dp} = {tp * pp * sp * cp * dp} does "
                             f"not match the world size {world}")
        if cp > 1 and sp > 1:
            raise ValueError("context parallelism and DeepSpeed-Ulysses cannot be combined")
        self.topology = make_topology(tp, pp, dp * cp, sp)
        self.rank = dist.get_rank()
        self.world_size = world
        coord = self.topology.get_coord(self.rank)
        self.tp_rank, self.pp_rank, self.dp_rank = coord.model, coord.pipe, coord.data
        self.sp_rank = coord.sequence if sp > 1 else 0
        self.tp_size, self.pp_size, self.dp_size, self.sp_size = tp, pp, dp * cp, sp
        # which share of the global batch this rank reads: the CP ranks of a data parallel rank read the same
        self.cp_size, self.cp_rank = cp, coord.data % cp
        self.loader_rank, self.loader_size = coord.data // cp, dp
        self.cp_group, self.cp_ranks = (self._make_groups(context_parallel_groups(self.topology, cp)) if cp > 1
                                        else (None, [self.rank]))
        self.tp_group, self.tp_ranks = self._axis_group("model")
        self.dp_group, self.dp_ranks = self._axis_group("data")
        self.pp_group, self.pp_ranks = self._axis_group("pipe")
        # DeepSpeed's "model parallel" group is every rank holding a different piece of one
        # replica (TP x PP): the ranks sharing this rank's data (and sequence) parallel index.
        self.tp_pp_group, self.tp_pp_ranks = self._shared_group(self._replica_axes())
        if sp > 1:
            self.sp_group, self.sp_ranks = self._axis_group("sequence")
            # every rank holding the same weights: what gradients are reduced over
            self.sp_dp_group, self.sp_dp_ranks = self._shared_group(("pipe", "model"))
        else:
            self.sp_group, self.sp_ranks = None, [self.rank]
            self.sp_dp_group, self.sp_dp_ranks = self.dp_group, self.dp_ranks

    def _replica_axes(self) -> tuple[str, ...]:
        return ("data", "sequence") if self.sp_size > 1 else ("data",)

    def _shared_group(self, axes: tuple[str, ...]):
        """The groups of ranks with equal coordinates on ``axes`` (varying on all others)."""
        coords = sorted({tuple(getattr(self.topology.get_coord(r), a) for a in axes) for r in range(self.world_size)})
        lists = [sorted(self.topology.filter_match(**dict(zip(axes, c)))) for c in coords]
        return self._make_groups(lists)

    def _axis_group(self, axis: str):
        """Create the groups along ``axis`` on every rank and return the one containing this rank."""
        return self._make_groups(self.topology.get_axis_comm_lists(axis))

    def _make_groups(self, lists):
        """Create every group of ``lists`` on every rank, in the same order everywhere (group creation
        is collective), and return (group, ranks) of the one containing this rank."""
        mine = None
        for ranks in lists:
            group = dist.new_group(ranks=ranks)
            if self.rank in ranks:
                mine = (group, list(ranks))
        assert mine is not None, f"rank {self.rank} is in none of the groups {lists}"
        return mine

    def expert_parallel_rank(self, ep: int, expert_tensor_parallel: bool) -> int:
        """This rank's place in its expert parallel group of size ``ep`` (module docstring): it holds
        experts ``[rank * E/ep, (rank + 1) * E/ep)`` of every MoE layer."""
        if ep == 1:
            return 0
        if self.sp_size > 1:
            raise ValueError("MoE does not combine with DeepSpeed-Ulysses sequence parallelism here")
        stage_size = self.world_size // self.pp_size
        if expert_tensor_parallel:
            if self.dp_size % ep:
                raise ValueError(f"expert parallel size {ep} does not divide the data parallel size {self.dp_size}")
            return self.dp_rank % ep
        if stage_size % ep:
            raise ValueError(f"expert parallel size {ep} does not divide the {stage_size} ranks of a pipeline stage")
        return (self.rank % stage_size) % ep

    def expert_grid_rank(self, ep: int, etp: int) -> tuple[int, int]:
        """(expert parallel rank, expert tensor parallel rank) of this rank in Megatron-LM's expert grid (module
        docstring): it holds shard ``etp rank`` of experts ``[ep rank * E/ep, (ep rank + 1) * E/ep)``."""
        if self.sp_size > 1:
            raise ValueError("MoE does not combine with DeepSpeed-Ulysses sequence parallelism here")
        stage_size = self.world_size // self.pp_size
        if stage_size % (ep * etp):
            raise ValueError(f"ETP {etp} x EP {ep} does not divide the {stage_size} ranks of a pipeline stage")
        local = self.rank % stage_size
        return (local // etp) % ep, local % etp

    def expert_grid(self, ep: int, etp: int) -> dict[str, list[int]]:
        """Create Megatron-LM's expert grid groups on every rank (collective, before ``deepspeed.initialize``), register
        its EP and EDP groups as DeepSpeed's expert groups, keep its ETP group for the layers and its ETP x EP group
        (``expert_mp_group``: what expert gradient norms are summed over, with the pipeline stages); returns this
        rank's {"etp", "ep", "edp", "emp": ranks}."""
        stage_size = self.world_size // self.pp_size
        lists = {k: [] for k in ("etp", "ep", "edp", "emp")}
        for p in range(self.pp_size):
            for kind, groups in expert_grid_lists(list(range(p * stage_size, (p + 1) * stage_size)), ep, etp).items():
                lists[kind] += groups
        made = {kind: self._make_groups(groups) for kind, groups in lists.items()}
        _EXPERT_GRID["etp"] = made["etp"][0]
        self.expert_mp_group = made["emp"][0]
        ds_compat.register_expert_groups(ep, etp, ep_group=made["ep"], edp_group=made["edp"], mpu=self)
        return {kind: ranks for kind, (_, ranks) in made.items()}

    def expert_groups(self, ep: int, expert_tensor_parallel: bool) -> tuple[list[int], list[int]]:
        """Create DeepSpeed's expert and expert data parallel groups of size ``ep`` (collective: every
        rank calls it, before ``deepspeed.initialize``); returns this rank's (expert parallel ranks,
        expert data parallel ranks) after checking they are the ones ``expert_parallel_rank`` assumes."""
        ep_ranks, edp_ranks = ds_compat.create_expert_groups(ep, expert_tensor_parallel, mpu=self)
        if len(ep_ranks) != ep or ep_ranks.index(self.rank) != self.expert_parallel_rank(ep, expert_tensor_parallel):
            raise ds_compat.incompatible(f"its expert parallel group {ep_ranks} on rank {self.rank} is not "
                                         f"ordered as megatron_ds builds the experts")
        return ep_ranks, edp_ranks

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def describe(self) -> str:
        return (f"rank {self.rank}: TP rank {self.tp_rank}/{self.tp_size} {self.tp_ranks}, "
                f"PP stage {self.pp_rank}/{self.pp_size} {self.pp_ranks}, "
                f"SP rank {self.sp_rank}/{self.sp_size} {self.sp_ranks}, "
                f"CP rank {self.cp_rank}/{self.cp_size} {self.cp_ranks}, "
                f"DP rank {self.dp_rank}/{self.dp_size} {self.dp_ranks}")

    # --- the `mpu` interface DeepSpeed's engine calls (names are DeepSpeed's) -------------------
    def get_tensor_model_parallel_group(self):
        return self.tp_group

    def get_tensor_model_parallel_rank(self):
        return self.tp_rank

    def get_tensor_model_parallel_world_size(self):
        return self.tp_size

    def get_tensor_model_parallel_src_rank(self):
        return self.tp_ranks[0]

    def get_model_parallel_group(self):
        return self.tp_pp_group

    def get_model_parallel_rank(self):
        return self.tp_pp_ranks.index(self.rank)

    def get_model_parallel_world_size(self):
        return len(self.tp_pp_ranks)

    def get_data_parallel_group(self):
        return self.dp_group

    def get_data_parallel_rank(self):
        return self.dp_rank

    def get_data_parallel_world_size(self):
        return self.dp_size

    def get_data_parallel_group_ranks(self):
        return self.dp_ranks

    def get_pipe_parallel_group(self):
        return self.pp_group

    def get_pipe_parallel_rank(self):
        return self.pp_rank

    def get_pipe_parallel_world_size(self):
        return self.pp_size

    get_pipeline_model_parallel_group = get_pipe_parallel_group
    get_pipeline_model_parallel_rank = get_pipe_parallel_rank
    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size

    # DeepSpeed's engine asks for these by name (deepspeed/utils/groups.py ``_get_sequence_*``) when
    # the mpu has them; at SP 1 the sequence data parallel group is the data parallel group.
    def get_sequence_parallel_group(self):
        return self.sp_group

    def get_sequence_parallel_rank(self):
        return self.sp_rank

    def get_sequence_parallel_world_size(self):
        return self.sp_size

    def get_sequence_data_parallel_group(self):
        return self.sp_dp_group

    def get_sequence_data_parallel_rank(self):
        return self.sp_dp_ranks.index(self.rank)

    def get_sequence_data_parallel_world_size(self):
        return self.sp_size * self.dp_size
