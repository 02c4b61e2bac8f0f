"""Point-to-point messages between pipeline ranks for the interleaved schedule.

Only neighbours talk: activations go to the next pipeline rank (the last rank's go to rank 0,
which holds the next virtual stage), gradients to the previous one. Shapes and dtypes are known in
advance (``[s, b, h]``, ``[s/tp, b, h]`` under sequence parallelism, plus ``[b, s]`` int64 document
ids with ``--reset-attention-mask``), so no shape is ever exchanged.

Every message is tagged with (kind, sending virtual stage, micro-batch, tensor index), and
activations and gradients travel on two separate copies of the pipeline group: on gloo the tags
match messages, and on NCCL (which ignores tags) each group and direction carries one kind of
message whose order is the same on both ends (both ranks run the schedule's forward order, resp.
backward order). Sends are asynchronous; a receive blocks until its message is there. The
schedule's event simulation (tests/parallel/test_schedules.py) shows that under exactly these
semantics every rank finishes.

Scatter/gather (the SC21 paper's, Megatron-DeepSpeed's ``megatron/p2p_communication.py``, on by
default; ``--no-scatter-gather-tensors-in-pipeline`` turns it off): without sequence parallelism
every TP rank of a stage holds the same hidden state and the same gradient of it, so each sends
only its 1/TP slice of the flattened tensor to its peer (the same TP rank of the neighbouring
stage), and the receiving stage's TP ranks all-gather the slices. The link between stages (the
inter-node network when stages span nodes) carries 1/TP of the bytes; the all-gather runs over
the TP group's fast link. The TP ranks of a stage run the same schedule, so their all-gathers
meet in the same order as the layers' own TP collectives.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

ACTIVATION = 0
GRADIENT = 1


def tied_embedding_group(ps):
    """The group of the first and the last pipeline rank at this rank's data/tensor parallel
    position (they hold the two copies of the tied word embedding); None for other ranks.
    Collective: every rank creates every group, in the same order."""
    topo, mine = ps.topology, None
    if ps.pp_size < 2:
        return None
    for d in range(ps.dp_size):
        for t in range(ps.tp_size):
            ranks = [topo.get_rank(pipe=0, data=d, model=t), topo.get_rank(pipe=ps.pp_size - 1, data=d, model=t)]
            group = dist.new_group(ranks=ranks)
            if ps.rank in ranks:
                mine = group
    return mine


def _pipeline_group_copy(ps):
    mine = None
    for ranks in ps.topology.get_axis_comm_lists("pipe"):
        group = dist.new_group(ranks=ranks)
        if ps.rank in ranks:
            mine = group
    return mine


class PipelineP2P:
    """Tagged sends/receives to the neighbouring pipeline ranks (see the module docstring)."""

    def __init__(self, ps, *, num_virtual_stages: int, micro_batches: int, scatter_gather: bool = False):
        """``scatter_gather``: send 1/TP of each floating-point tensor (see the module docstring);
        only where the TP ranks hold the same tensors (not under sequence parallelism)."""
        topo, coord = ps.topology, dict(data=ps.dp_rank, model=ps.tp_rank)
        self.tp_group = ps.tp_group if scatter_gather and ps.tp_size > 1 else None
        self.tp_size, self.tp_rank = ps.tp_size, ps.tp_rank
        self.next_rank = topo.get_rank(pipe=(ps.pp_rank + 1) % ps.pp_size, **coord)
        self.prev_rank = topo.get_rank(pipe=(ps.pp_rank - 1) % ps.pp_size, **coord)
        self.groups = {ACTIVATION: _pipeline_group_copy(ps), GRADIENT: _pipeline_group_copy(ps)}
        self.num_virtual_stages = num_virtual_stages
        self.micro_batches = micro_batches
        self._pending: list = []  # (request, tensor): sends in flight, their buffers kept alive

    def _tag(self, kind: int, stage: int, microbatch: int, index: int) -> int:
        return ((kind * self.num_virtual_stages + stage) * self.micro_batches + microbatch) * 2 + index

    def send(self, tensors, *, kind: int, stage: int, microbatch: int) -> None:
        """Send ``tensors`` (from virtual ``stage``) onwards: activations to the next rank,
        gradients to the previous one. Returns at once."""
        dst = self.next_rank if kind == ACTIVATION else self.prev_rank
        # forget finished sends, so their buffers (activations) are freed during the step
        self._pending = [(req, t) for req, t in self._pending if not req.is_completed()]
        for i, tensor in enumerate(tensors):
            tensor = tensor.contiguous()
            if self._scattered(tensor.dtype, tensor.numel()):
                tensor = tensor.view(-1).chunk(self.tp_size)[self.tp_rank]
            req = dist.isend(tensor, dst=dst, group=self.groups[kind], tag=self._tag(kind, stage, microbatch, i))
            self._pending.append((req, tensor))

    def recv(self, specs, *, kind: int, stage: int, microbatch: int, device) -> list[torch.Tensor]:
        """Receive what virtual ``stage`` sent for ``microbatch``; ``specs``: (shape, dtype) each."""
        src = self.prev_rank if kind == ACTIVATION else self.next_rank
        out = []
        for i, (shape, dtype) in enumerate(specs):
            numel = torch.Size(shape).numel()
            scattered = self._scattered(dtype, numel)
            buf = torch.empty(numel // self.tp_size if scattered else shape, dtype=dtype, device=device)
            dist.irecv(buf, src=src, group=self.groups[kind], tag=self._tag(kind, stage, microbatch, i)).wait()
            if scattered:
                slices = [torch.empty_like(buf) for _ in range(self.tp_size)]
                dist.all_gather(slices, buf, group=self.tp_group)
                buf = torch.cat(slices).view(shape)
            out.append(buf)
        return out

    def _scattered(self, dtype: torch.dtype, numel: int) -> bool:
        """Whether a tensor travels as 1/TP slices: floating point (the hidden state, its gradient; not
        the int64 document ids) whose size TP divides (else whole, as Megatron's override)."""
        return self.tp_group is not None and dtype.is_floating_point and numel % self.tp_size == 0

    def wait_sends(self) -> None:
        for req, _ in self._pending:
            req.wait()
        self._pending.clear()
