"""Process groups for tensor, pipeline and data parallelism, built from DeepSpeed's topology.

The rank layout is DeepSpeed's ``PipeModelDataParallelTopology`` (axes pipe, data, model): tensor
parallel ranks are adjacent (they talk the most, so they should share a node), then data
parallel, then pipeline stages. The same topology object is handed to the ``PipelineModule`` so
both agree on who is who. ``ParallelState`` doubles as the ``mpu`` object DeepSpeed's engine takes
when the model is not a pipeline.
"""
from __future__ import annotations

import torch.distributed as dist

from megatron_ds.ds_compat import PipeModelDataParallelTopology


def make_topology(tp: int, pp: int, dp: int) -> PipeModelDataParallelTopology:
    return PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)


class ParallelState:
    """This rank's groups and coordinates. Every rank must construct it (group creation is collective)."""

    def __init__(self, tp: int, pp: int, dp: int | None = None):
        world = dist.get_world_size()
        if dp is None:
            dp = world // (tp * pp)
        if tp * pp * dp != world:
            raise ValueError(f"TP {tp} x PP {pp} x DP {dp} = {tp * pp * dp} does not match the world size {world}")
        self.topology = make_topology(tp, pp, dp)
        self.rank = dist.get_rank()
        self.world_size = world
        coord = self.topology.get_coord(self.rank)
        self.tp_rank, self.pp_rank, self.dp_rank = coord.model, coord.pipe, coord.data
        self.tp_size, self.pp_size, self.dp_size = tp, pp, dp
        self.tp_group, self.tp_ranks = self._axis_group("model")
        self.dp_group, self.dp_ranks = self._axis_group("data")
        self.pp_group, self.pp_ranks = self._axis_group("pipe")
        # DeepSpeed's "model parallel" group is every rank holding a different piece of one
        # replica (TP x PP): the ranks sharing this rank's data parallel index.
        self.tp_pp_group, self.tp_pp_ranks = self._axis_group("data", complement=True)

    def _axis_group(self, axis: str, complement: bool = False):
        """Create the groups along ``axis`` (or, with complement, across all other axes) on every
        rank, in the same order everywhere, and return the one containing this rank."""
        if complement:
            lists = [sorted(self.topology.filter_match(**{axis: i}))
                     for i in range(self.topology.get_dim(axis))]
        else:
            lists = self.topology.get_axis_comm_lists(axis)
        mine = None
        for ranks in lists:
            group = dist.new_group(ranks=ranks)
            if self.rank in ranks:
                mine = (group, list(ranks))
        assert mine is not None, f"rank {self.rank} is in no {axis} group"
        return mine

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def describe(self) -> str:
        return (f"rank {self.rank}: TP rank {self.tp_rank}/{self.tp_size} {self.tp_ranks}, "
                f"PP stage {self.pp_rank}/{self.pp_size} {self.pp_ranks}, "
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
