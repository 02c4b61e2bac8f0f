"""A checkpoint's optimizer state by parameter name, whatever optimizer and ZeRO stage wrote it.

For each parameter on each saved tensor parallel x pipeline rank: its full (TP-local) fp32 master
and Adam moments, read from

- ZeRO 1-2 / bf16 optimizer shards: DeepSpeed records each parameter's fragment in
  ``param_slice_mappings``; the data parallel ranks' fragments concatenate to the flat parameter;
- ZeRO-3's flat partitions (``zero3``);
- the ZeRO-0 torch / fp16 optimizer's positional state (``plain_optim``: by the
  ``optimizer_param_names`` this toolkit records, or the order rebuilt for older checkpoints);
  with MoE layers one such state per expert parallel rank (``expert_files``), experts named by global id
  (as the ZeRO shards' experts are renamed);
- Megatron-LM's MoE layer at EP > 1 (``stacked_experts``): each expert parallel rank's state of its stacked
  experts (ZeRO 1-2: partitioned over its expert data parallel group), joined to the EP 1 tensor.

Files are memory-mapped: tensors are read when a parameter's slice is used.
"""
from __future__ import annotations

import collections

import torch

from megatron_ds.checkpoint import expert_files, plain_optim, stacked_experts
from megatron_ds.checkpoint.files import OPTIM_KEYS, CheckpointFiles, load_file
from megatron_ds.checkpoint.format import EXPERT_PARALLEL_SIZE, EXPERT_TENSOR_PARALLEL_SIZE
from megatron_ds.checkpoint.moe_sources import MoEModuleSource, expert_optimizer_files
from megatron_ds.checkpoint.zero3 import Zero3State
from megatron_ds.errors import ConfigError


class _ZeroExperts:
    """ZeRO 1-2 shards of an MoE model: a shard names its experts by the local ids of its expert
    parallel rank, a function of its (data parallel, tensor parallel) rank (``expert_files.expert_parallel_rank``).
    ZeRO partitions an expert's flat group over the expert data parallel group; its ranks, ordered
    by data parallel rank, are the group's order, so the pieces concatenate as the dense ones do."""

    def __init__(self, ckpt: CheckpointFiles):
        self.ckpt = ckpt
        self.ep = ckpt.meta["signature"][EXPERT_PARALLEL_SIZE]
        shapes = MoEModuleSource(ckpt).shapes(0)
        self.num_local = {prefix: n // self.ep for prefix, n in expert_files.experts_per_layer(shapes).items()}

    def global_name(self, name: str, dp: int, mp: int) -> str:
        e = expert_files.expert_id(name)
        if e is None:
            return name
        rank = expert_files.expert_parallel_rank(dp, mp % self.ckpt.tp, tp=self.ckpt.tp, ep=self.ep,
                                        expert_tp=self.ckpt.model.enable_expert_tensor_parallelism)
        local = self.num_local[expert_files.experts_prefix(name)]
        return expert_files.with_expert_id(name, expert_files.global_expert(rank, e, local))


class SavedOptimizer:
    """A checkpoint's optimizer state by parameter name: full (TP-local) fp32 master and Adam
    moments of each parameter on each saved TP x PP rank."""

    def __init__(self, ckpt: CheckpointFiles, *, with_moments: bool = True):
        self.ckpt = ckpt
        self.step = None
        self.pieces = collections.defaultdict(list)  # (name, mp_rank) -> [(dp, flat tensors dict, start, numel)]
        self.plain = {}  # (name, mp_rank) -> {"exp_avg": t, "exp_avg_sq": t[, "fp32": fp16 runs' master]}
        self.zero3 = None
        self.experts = None
        # Megatron-LM's stacked experts: name -> mp rank -> {expert parallel rank: ZeRO pieces or plain tensors}
        self.stacked = collections.defaultdict(lambda: collections.defaultdict(dict))
        self.ep = ckpt.meta["signature"].get(EXPERT_PARALLEL_SIZE, 1)
        # Megatron-LM's experts split over ETP ranks of its expert grid (parallel/groups.py)
        self.etp = ckpt.meta["signature"].get(EXPERT_TENSOR_PARALLEL_SIZE, 1)
        self.loss_scale = None  # fp16 ZeRO-0: the dynamic loss scaler's state
        files = ckpt.optimizer_files()
        if ckpt.zero_stage == 3:
            self.zero3 = Zero3State(ckpt, with_moments=with_moments)
            self.step = self.zero3.step
        elif files:
            self.experts = _ZeroExperts(ckpt) if expert_files.has_expert_files(ckpt.path) else None
            for path in files:
                self._index_zero_file(path)
        elif expert_optimizer_files(ckpt):
            self._index_plain_moe(expert_optimizer_files(ckpt))
        else:
            self._index_plain()

    def _index_zero_file(self, path: str) -> None:
        base = path.rsplit("/", 1)[-1]
        dp = int(base.split("zero_pp_rank_")[1].split("_")[0])
        mp = int(base.split("_mp_rank_")[1].split("_")[0])
        osd = load_file(path)["optimizer_state_dict"]
        base = osd["base_optimizer_state"]
        # a torch state dict, or (ZeRO's elastic_checkpoint) one state per group
        state = base["state"] if isinstance(base, dict) else dict(enumerate(base))
        for g, mapping in enumerate(osd["param_slice_mappings"]):
            flat = {"fp32": osd["single_partition_of_fp32_groups"][g], **{k: state[g][k] for k in OPTIM_KEYS}}
            self.step = float(state[g]["step"])
            for name, frag in mapping.items():
                name = self.ckpt.saved_name(name)  # DeepSpeed records the module's names
                if self.experts is not None:
                    name = self.experts.global_name(name, dp, mp)
                tp = self.ckpt.tp
                if stacked_experts.is_stacked(name) and (self.ep > 1 or 1 < self.etp < tp):
                    # ZeRO partitioned them over the expert data parallel group, which may span tensor parallel ranks
                    # (1 < ETP < TP): its pieces kept under the first TP rank of their ETP part, in EDP order
                    r, edp = expert_files.expert_grid_ranks(dp, mp % tp, tp=tp, ep=self.ep, etp=self.etp)
                    owner = mp - mp % tp + mp % tp % self.etp
                    self.stacked[name][owner].setdefault(r, []).append((edp, flat, frag.start, frag.numel))
                    continue
                self.pieces[name, mp].append((dp, flat, frag.start, frag.numel))

    def _index_plain(self) -> None:
        """fp32 / fp16 ZeRO-0: a torch optimizer's positional state (``plain_optim``)."""
        for t in range(self.ckpt.tp):
            mps = self._mp_ranks(t)
            states = [load_file(self.ckpt.mp_file(mp)) for mp in mps]
            names = [state.get("optimizer_param_names") for state in states]
            if any(n is None for n in names):  # saved before the names were recorded
                names = plain_optim.reconstruct_names(self.ckpt, states, t)
            names = [self._saved_names(n) for n in names]
            shapes = plain_optim.saved_shapes(self.ckpt, t)
            self.loss_scale = {k: states[0]["optimizer"][k] for k in plain_optim.LOSS_SCALE_KEYS
                               if k in states[0]["optimizer"]} or None
            for mp, state, group_names in zip(mps, states, names):
                found, step = plain_optim.index_state(self.ckpt, mp, state["optimizer"], group_names, shapes)
                self.plain.update({(name, mp): tensors for name, tensors in found.items() if tensors})
                self.step = step if step is not None else self.step

    def _index_plain_moe(self, files: dict[int, dict[int, str]]) -> None:
        """ZeRO-0 with MoE layers: each expert parallel rank's whole optimizer in its own file
        (``expert_files``), positions named by the ``optimizer_param_names`` of data parallel rank 0, the
        same local names on every expert parallel rank; its experts renamed to global ids."""
        weights = MoEModuleSource(self.ckpt)
        ep = self.ckpt.meta["signature"][EXPERT_PARALLEL_SIZE]
        for t in range(self.ckpt.tp):
            shapes = weights.shapes(t)
            for mp in self._mp_ranks(t):
                names = load_file(self.ckpt.mp_file(mp)).get("optimizer_param_names")
                if names is None:
                    raise ConfigError(f"{self.ckpt.mp_file(mp)} does not name its optimizer's parameters; resume it "
                                      f"at its own layout, or pass --no-load-optim")
                names = self._saved_names(names)
                for r, path in sorted(files.get(mp, {}).items()):
                    local = {name: stacked_experts.local_shape(shape, ep) if stacked_experts.is_stacked(name) else shape
                             for name, shape in expert_files.to_local(shapes, r, ep).items()}
                    opt = load_file(path)["optimizer"]
                    found, step = plain_optim.index_state(self.ckpt, mp, opt, names, local)
                    for name, tensors in expert_files.to_global(found, r).items():
                        if tensors and stacked_experts.is_stacked(name):
                            self.stacked[name][mp][r] = tensors
                        elif tensors:
                            self.plain[name, mp] = tensors
                    self.step = step if step is not None else self.step

    def _saved_names(self, groups: list[list[str]]) -> list[list[str]]:
        """Recorded ``optimizer_param_names`` as the layer files name them (older interleaved runs recorded their
        model chunks' own names)."""
        return [[self.ckpt.saved_name(n) for n in group] for group in groups]

    def _mp_ranks(self, tp_rank: int) -> list[int]:
        return [pp * self.ckpt.tp + tp_rank for pp in range(self.ckpt.pp)]

    def tensors(self, name: str, tp_rank: int, shape: torch.Size) -> dict[str, torch.Tensor] | None:
        """{"fp32"?, "exp_avg", "exp_avg_sq"} of saved TP rank ``tp_rank``'s shard of ``name``."""
        mps = self._mp_ranks(tp_rank)
        if name in self.stacked:
            return self._stacked(name, mps, shape)
        if expert_files.expert_id(name) is not None and not self.ckpt.model.enable_expert_tensor_parallelism:
            # a whole expert: its expert parallel rank's files may belong to another TP rank
            mps = [mp for t in range(self.ckpt.tp) for mp in self._mp_ranks(t)]
        for mp in mps:  # a tied weight lives on two stages: the copies are equal
            if self.zero3 is not None and self.zero3.has(name, mp):
                return self.zero3.tensors(name, mp)
            if (name, mp) in self.plain:
                return self.plain[name, mp]
            if (name, mp) in self.pieces:
                return _join_pieces(self.pieces[name, mp], shape)
        return None

    def _stacked(self, name: str, mps: list[int], shape: torch.Size) -> dict[str, torch.Tensor] | None:
        """The EP 1 state of a stacked expert tensor of the stages of ``mps``: each expert parallel rank's
        (whole experts: from any TP rank of the stage, its own first) joined."""
        tp = self.ckpt.tp
        # the stage's TP ranks holding the same expert tensor parallel part (all of them for whole experts), its own
        # first
        stage_mps = sorted({mp // tp * tp + t for mp in mps for t in range(tp) if t % self.etp == mp % tp % self.etp},
                           key=lambda m: m not in mps)
        parts = {}
        for mp in stage_mps:
            for r, found in self.stacked[name].get(mp, {}).items():
                parts.setdefault(r, found)
        if not parts:
            return None
        local = stacked_experts.local_shape(shape, self.ep)
        for r, found in parts.items():
            if isinstance(found, list):  # ZeRO pieces of the expert data parallel group, ordered as the dense ones
                parts[r] = _join_pieces(found, local)
        return {k: stacked_experts.join({r: t[k] for r, t in parts.items()}) for k in parts[0]}


def _join_pieces(pieces: list, shape: torch.Size) -> dict[str, torch.Tensor]:
    """A parameter's ZeRO fragments [(data parallel rank, flat tensors, start, numel)] as its full state."""
    pieces = sorted(pieces, key=lambda p: p[0])
    return {k: torch.cat([flat[k][start:start + numel] for _, flat, start, numel in pieces]).view(shape)
            for k in ("fp32", *OPTIM_KEYS)}
