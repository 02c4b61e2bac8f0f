"""A model split into chunks for the interleaved pipeline schedule (and ZB-H1's one chunk per rank).

Pipeline rank ``r`` of ``pp`` holds ``v`` chunks; chunk ``c`` is virtual stage ``c * pp + r``. Which
layer specs each chunk holds is the model family's (the GPT's: ``families/gpt/gpt_model.py``
``chunk_spec_indices``, Megatron's assignment: virtual stage 0 also holds the embedding, the last
one the final norm and the output layer).

Each chunk is a ``SequentialModel`` over a subset of the same DeepSpeed layer specs the
``PipelineModule`` is built from, seeded per global spec index as it seeds them: an interleaved
model starts with exactly the weights of the non-interleaved one and of one process. With tied
embeddings the last virtual stage builds its own copy of the word embedding, which is overwritten
from the first stage's (``sync_tied_weights``) exactly as DeepSpeed's pipeline does.

Checkpoint files: ``layer_files`` names each chunk member by its global spec index, which is what
DeepSpeed's ``PipelineModule`` writes (``layer_XX-model_YY-model_states.pt``), so a checkpoint saved
interleaved is a checkpoint of the non-interleaved pipeline too, and the converters need no chunk
logic. Like ``PipelineModule``, the output layer that only borrows the tied embedding is not a
layer of its own (it has no state); the first stage's copy is saved. The module's own parameter
names (``chunks.<c>.<index>...``, ``tied_weight``), which DeepSpeed's optimizer files record, become
the ``PipelineModule``'s through ``pipeline_name``: what resharding and the checkpoint readers match.
"""
from __future__ import annotations

import re
from typing import Callable

import torch
import torch.distributed as dist
from deepspeed.pipe import TiedLayerSpec
from torch import nn

from megatron_ds import ds_compat
from megatron_ds.model.pipeline_model import SequentialModel

TIED_WEIGHT = "tied_weight"  # ModelChunks' own attribute (and so parameter name) of the tied weight
_CHUNK = re.compile(r"^chunks\.\d+\.")


def pipeline_name(name: str, tied_name: str | None) -> str:
    """The ``PipelineModule`` name of a ``ModelChunks`` parameter or buffer ``name`` (what its checkpoint files
    and the non-interleaved model call it): the chunk prefix dropped (chunk members are named by their global
    spec index), the tied weight as its tied module's (``tied_name``; a chunk's copy has that name too)."""
    if name == TIED_WEIGHT and tied_name is not None:
        return tied_name
    return _CHUNK.sub("", name, count=1)


def tied_weight_name(specs: list) -> str | None:
    """``tied_modules.<key>.<attr>`` of the one tied weight a model of ``specs`` shares (None: no tied first spec)."""
    if not isinstance(specs[0], TiedLayerSpec) or len(specs[0].tied_weight_attr) != 1:
        return None  # (T5 ties several weights: such a model does not run in model chunks)
    return f"tied_modules.{specs[0].key}.{specs[0].tied_weight_attr[0]}"


class ModelChunks(nn.Module):
    """This pipeline rank's chunks as one module (what DeepSpeed's plain engine wraps).

    ``layer_indices[c]``: the global spec indices chunk ``c`` holds. ``forward(inputs, chunk=c)`` runs
    chunk ``c``. ``tied_weight`` is the tied weight (the word embedding) on the first stage and its
    copy on the last (None elsewhere or without a tied spec, which must then be the first spec).
    """

    def __init__(self, specs: list, *, layer_indices: list[list[int]], pp: int, pp_rank: int, seed: int,
                 loss_fn: Callable, tie_group=None, activation_checkpoint_interval: int = 0):
        super().__init__()
        self.pp, self.pp_rank, self.v = pp, pp_rank, len(layer_indices)
        self.layer_indices = layer_indices
        self.chunks = nn.ModuleList(
            SequentialModel(specs, seed=seed, layer_indices=indices, loss_fn=loss_fn,
                            activation_checkpoint_interval=activation_checkpoint_interval)
            for indices in self.layer_indices)
        self.loss_fn = loss_fn
        self.tied_weight = None
        self.tied_name = tied_weight_name(specs)
        tied = isinstance(specs[0], TiedLayerSpec)
        if tied and (pp_rank == 0 or pp_rank == pp - 1):
            chunk = self.chunks[0] if pp_rank == 0 else self.chunks[-1]
            self.tied_weight = _tied_weight(chunk.tied_modules[specs[0].key], specs[0])
            if pp_rank != 0:
                # DeepSpeed's marker: count this copy's gradient once (on the first stage) in the
                # global grad norm, as PipelineModule marks its tied copies.
                ds_compat.mark_pipe_replicated(self.tied_weight)
        self.tie_group = tie_group if self.tied_weight is not None else None
        self.sync_tied_weights()

    def forward(self, inputs, chunk: int = 0):
        return self.chunks[chunk](inputs)

    def pipeline_name(self, name: str) -> str:
        """The ``PipelineModule`` name of this module's parameter or buffer ``name`` (``pipeline_name``)."""
        return pipeline_name(name, self.tied_name)

    def layer_files(self, tp_rank: int) -> list[tuple[str, nn.Module]]:
        """(file name, module) of every chunk member with state, named as ``PipelineModule``
        names its per-layer checkpoint files (global layer index, tensor parallel rank)."""
        files = []
        for chunk, indices in zip(self.chunks, self.layer_indices):
            for idx, func in zip(indices, chunk.forward_funcs):
                if isinstance(func, nn.Module):
                    files.append((f"layer_{idx:02d}-model_{tp_rank:02d}-model_states.pt", func))
        return files

    @torch.no_grad()
    def sync_tied_weights(self) -> None:
        """Copy the first stage's word embedding into the last stage's copy (collective over
        ``tie_group``: the first and last pipeline rank of this data/tensor parallel position)."""
        if self.tie_group is not None:
            src = min(dist.get_process_group_ranks(self.tie_group))  # the first stage's rank
            dist.broadcast(self.tied_weight, src=src, group=self.tie_group)


def _tied_weight(module: nn.Module, spec: TiedLayerSpec) -> torch.Tensor:
    """The one weight a tied spec shares (its ``tied_weight_attr``, e.g. ``word_embeddings.weight``)."""
    (path,) = spec.tied_weight_attr
    for part in path.split("."):
        module = getattr(module, part)
    return module
