"""The GPT split into model chunks for the interleaved pipeline schedule.

Pipeline rank ``r`` of ``pp`` holds ``v`` chunks; chunk ``c`` is virtual stage ``c * pp + r`` and
holds transformer layers ``[(c*pp + r) * L, (c*pp + r + 1) * L)`` (Megatron's assignment, see
``megatron_ds.parallel.partition.chunk_layer_range``). Virtual stage 0 also holds the embedding;
the last one the final norm and the output layer.

Each chunk is a ``GPTSequential`` over a subset of the same DeepSpeed layer specs the
``PipelineModule`` is built from, seeded per global spec index as it seeds them: an interleaved
model starts with exactly the weights of the non-interleaved one and of one process. With tied
embeddings the last virtual stage builds its own copy of the word embedding, which is overwritten
from the first stage's (``sync_tied_weights``) exactly as DeepSpeed's pipeline does.

Checkpoint files: ``layer_files`` names each chunk member by its global spec index, which is what
DeepSpeed's ``PipelineModule`` writes (``layer_XX-model_YY-model_states.pt``), so a checkpoint saved
interleaved is a checkpoint of the non-interleaved pipeline too, and the converters need no chunk
logic. Like ``PipelineModule``, the output layer that only borrows the tied embedding is not a
layer of its own (it has no state); the first stage's copy is saved.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from deepspeed.pipe import TiedLayerSpec
from torch import nn

from megatron_ds import ds_compat
from megatron_ds.config.schema import ModelConfig
from megatron_ds.model.layer_specs import GPTSequential, gpt_layer_specs
from megatron_ds.parallel.partition import chunk_layer_range


def chunk_spec_indices(num_layers: int, pp: int, v: int, rank: int, chunk: int) -> list[int]:
    """Global spec indices (0 = embedding, 1..N = transformer layers, N+1 = final norm, N+2 =
    output layer) held by ``chunk`` of pipeline ``rank``."""
    layers = chunk_layer_range(num_layers, pp, v, rank, chunk)
    indices = [i + 1 for i in layers]
    if chunk == 0 and rank == 0:
        indices.insert(0, 0)
    if chunk == v - 1 and rank == pp - 1:
        indices += [num_layers + 1, num_layers + 2]
    return indices


class GPTModelChunks(nn.Module):
    """This pipeline rank's ``v`` chunks as one module (what DeepSpeed's plain engine wraps).

    ``forward(inputs, chunk=c)`` runs chunk ``c``. ``tied_weight`` is the word embedding on the
    first stage and its copy on the last (None elsewhere or when untied).
    """

    def __init__(self, specs: list, *, num_layers: int, pp: int, pp_rank: int, v: int, tp_group=None, seed: int,
                 tie_group=None, activation_checkpoint_interval: int = 0, loss_report=None,
                 moe_loss_coeff: float = 0.0):
        super().__init__()
        self.pp, self.pp_rank, self.v = pp, pp_rank, v
        self.layer_indices = [chunk_spec_indices(num_layers, pp, v, pp_rank, c) for c in range(v)]
        self.chunks = nn.ModuleList(
            GPTSequential(specs, tp_group=tp_group, seed=seed, layer_indices=indices,
                          activation_checkpoint_interval=activation_checkpoint_interval, loss_report=loss_report,
                          moe_loss_coeff=moe_loss_coeff)
            for indices in self.layer_indices)
        self.loss_fn = self.chunks[0].loss_fn
        self.tied_weight = None
        tied = any(isinstance(spec, TiedLayerSpec) for spec in specs)
        if tied and (pp_rank == 0 or pp_rank == pp - 1):
            chunk = self.chunks[0] if pp_rank == 0 else self.chunks[-1]
            self.tied_weight = chunk.tied_modules[specs[0].key].word_embeddings.weight
            if pp_rank != 0:
                # DeepSpeed's marker: count this copy's gradient once (on the first stage) in the
                # global grad norm, as PipelineModule marks its tied copies.
                ds_compat.mark_pipe_replicated(self.tied_weight)
        self.tie_group = tie_group if self.tied_weight is not None else None
        self.sync_tied_weights()

    def forward(self, inputs, chunk: int = 0):
        return self.chunks[chunk](inputs)

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


def build_interleaved_gpt(model_cfg: ModelConfig, *, pp: int, pp_rank: int, v: int, padded_vocab_size: int,
                          tp_group, seed: int, tie_group=None, activation_checkpoint_interval: int = 0,
                          loss_report=None, **spec_kwargs) -> GPTModelChunks:
    """This rank's chunks of the GPT (``spec_kwargs`` as for ``build_pipeline_gpt``); ``tie_group``
    from ``megatron_ds.pipeline.p2p.tied_embedding_group`` (None: no copies to synchronize)."""
    specs = gpt_layer_specs(model_cfg, padded_vocab_size=padded_vocab_size, tp_group=tp_group,
                            loss_report=loss_report, **spec_kwargs)
    return GPTModelChunks(specs, num_layers=model_cfg.num_layers, pp=pp, pp_rank=pp_rank, v=v, tp_group=tp_group,
                          seed=seed, tie_group=tie_group, loss_report=loss_report,
                          moe_loss_coeff=model_cfg.moe_loss_coeff,
                          activation_checkpoint_interval=activation_checkpoint_interval)
