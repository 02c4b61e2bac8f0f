"""The optimizer state of a ZeRO-0 fp32 or fp16 checkpoint, by parameter name.

Without ZeRO (and without DeepSpeed's bf16 optimizer) the mp_rank files hold a torch optimizer's
``state_dict()``, keyed by *position* in its parameter groups, in one of three forms:

- fp32: the torch optimizer itself: ``state[i]`` holds parameter i's ``exp_avg`` / ``exp_avg_sq``
  (the weights are their own masters);
- fp16 with DeepSpeed's ``FP16_UnfusedOptimizer`` (any optimizer but DeepSpeed's / apex's
  FusedAdam, e.g. torch's fused AdamW): ``{"optimizer_state_dict": torch state over per-parameter
  fp32 copies, "fp32_groups": [[fp32 master per parameter]], ...}``;
- fp16 with ``FP16_Optimizer`` (apex / DeepSpeed FusedAdam): ``{"optimizer_state_dict": torch
  state with one flat fp32 tensor per group, "fp32_groups_flat": [flat masters], ...}``: a
  group's parameters concatenated in order, without padding (``_flatten_dense_tensors``).

Positions become names through ``optimizer_param_names``, which this toolkit records with every
checkpoint. Checkpoints from before that are read by rebuilding the order: the optimizer's groups
are ``megatron_ds.model.param_groups`` of the stage's module, whose parameters come
in ``named_parameters`` order -- a ``PipelineModule`` (and ``SequentialModel``) registers
``tied_modules`` first (each built from the stage's first spec of its key), then its layers by
index, each layer's parameters in its state-dict order (the order of its layer file). Which layers a pipeline stage held is found from the number of
parameters its optimizer had (stages are consecutive layer ranges); every shape is then checked
against the saved state, and a mismatch is refused in one line.
"""
from __future__ import annotations

import torch
from deepspeed.pipe import TiedLayerSpec

from megatron_ds.checkpoint.files import OPTIM_KEYS, CheckpointFiles, layer_prefixes, load_file
from megatron_ds.errors import ConfigError
from megatron_ds.model.param_groups import param_groups
# What DeepSpeed's ZeRO-0 fp16 optimizers save of their loss scaler (their state_dict())
LOSS_SCALE_KEYS = ("dynamic_loss_scale", "cur_scale", "cur_iter", "last_overflow_iter", "scale_factor", "scale_window")


class _Named(torch.nn.Module):
    """A stand-in module whose named_parameters are the given (name, shape) pairs, on the meta device."""

    def __init__(self, params: list[tuple[str, torch.Size]]):
        super().__init__()
        self.params = [(n, torch.nn.Parameter(torch.empty(s, device="meta"))) for n, s in params]

    def named_parameters(self, *args, **kwargs):
        return iter(self.params)


def _grouped(params: list[tuple[str, torch.Size]], weight_decay: float) -> list[list[str]]:
    """The optimizer's groups of names, as training/optimizer.py groups the module's parameters."""
    module = _Named(params)
    names = {id(p): n for n, p in module.params}
    return [[names[id(p)] for p in g["params"]] for g in param_groups(module, weight_decay)]


class _Layout:
    """Each layer's parameters (name, shape) on one tensor parallel rank, from the saved weights."""

    def __init__(self, ckpt: CheckpointFiles, tp_rank: int):
        self.ckpt, self.tp_rank = ckpt, tp_rank
        self.specs = ckpt.family.layer_specs(ckpt.model, ckpt.padded_vocab_size, device="meta")
        self.n_layers = len(self.specs)
        self.tied = {i: s.key for i, s in enumerate(self.specs) if isinstance(s, TiedLayerSpec)}
        self.prefixes = dict(layer_prefixes(ckpt.model, ckpt.padded_vocab_size, ckpt.family))  # idx -> prefix
        self.first = {key: i for i, key in sorted(self.tied.items(), reverse=True)}  # tied key -> first idx
        self._cache: dict[int, list] = {}
        self.module = None if ckpt.has_layer_files() else load_file(ckpt.mp_file(tp_rank))["module"]

    def layer(self, idx: int) -> list[tuple[str, torch.Size]]:
        if idx not in self._cache:
            prefix = self.prefixes[idx]
            if self.module is not None:
                self._cache[idx] = [(n, t.shape) for n, t in self.module.items() if n.startswith(prefix)]
            else:
                shard = load_file(self.ckpt.layer_file(idx, self.tp_rank))
                self._cache[idx] = [(prefix + n, t.shape) for n, t in shard.items()]
        return self._cache[idx]

    def tied_copy(self, idx: int) -> list[tuple[str, torch.Size]]:
        """The parameters of the tied module a stage builds from spec ``idx`` when it lacks the key's
        first spec (the output layer on a last stage: ``families/gpt/gpt_model.py`` builds it without
        the position table): names from building that spec on the meta device, shapes from the saved
        copy of the key's first spec (the tied weights are the same tensors)."""
        key = self.tied[idx]
        saved = dict(self.layer(self.first[key]))
        prefix = f"tied_modules.{key}."
        with torch.random.fork_rng(devices=[]):  # building draws initial weights: leave the caller's RNG alone
            module = self.specs[idx].build()
        names = [prefix + n for n, _ in module.named_parameters()]
        missing = [n for n in names if n not in saved]
        if missing:
            raise ConfigError(f"{self.ckpt.path}: the saved model has no {missing[0]} (needed to name the optimizer "
                              f"state of pipeline stages); resume it at its own layout, or pass --no-load-optim")
        return [(n, saved[n]) for n in names]

    def stage(self, start: int, end: int) -> list[tuple[str, torch.Size]]:
        """named_parameters of a stage holding layers [start, end): tied modules first."""
        firsts = {}
        for i in range(start, end):
            if i in self.tied:
                firsts.setdefault(self.tied[i], i)
        out = [p for key, i in firsts.items()
               for p in (self.layer(i) if i == self.first[key] else self.tied_copy(i))]
        return out + [p for i in range(start, end) if i not in self.tied and i in self.prefixes
                      for p in self.layer(i)]

    def shapes(self) -> dict[str, torch.Size]:
        return dict(self.stage(0, self.n_layers))


def saved_shapes(ckpt: CheckpointFiles, tp_rank: int) -> dict[str, torch.Size]:
    """Every parameter's (tensor parallel local) shape on ``tp_rank``, from the saved weights."""
    return _Layout(ckpt, tp_rank).shapes()


def _saved_sizes(opt: dict) -> list[int]:
    """Per group: the parameter count, or for FP16_Optimizer (one flat tensor per group) its elements."""
    if "fp32_groups_flat" in opt:
        return [t.numel() for t in opt["fp32_groups_flat"]]
    return [len(g["params"]) for g in opt.get("optimizer_state_dict", opt)["param_groups"]]


def _sizes(groups: list[list[str]], shapes: dict[str, torch.Size], flat: bool) -> list[int]:
    return [sum(shapes[n].numel() for n in g) if flat else len(g) for g in groups]


def reconstruct_names(ckpt: CheckpointFiles, states: list[dict], tp_rank: int) -> list[list[list[str]]]:
    """Per pipeline stage (the mp_rank files of ``tp_rank``), the optimizer's groups of parameter
    names (see the module docstring)."""
    if ckpt.meta["signature"].get("virtual_pipeline_model_parallel_size", 1) > 1:
        # the interleaved schedule's chunks hold non-consecutive layers of identical shapes: an
        # order rebuilt wrongly could not be caught by the shape checks
        raise ConfigError(f"{ckpt.path} (interleaved pipeline schedule) does not name its optimizer's parameters "
                          f"(a checkpoint from before resharding existed); resume it at its own layout, or pass "
                          f"--no-load-optim to load the weights only")
    layout = _Layout(ckpt, tp_rank)
    shapes = layout.shapes()
    out, start = [], 0
    for stage, state in enumerate(states):
        flat, want = "fp32_groups_flat" in state["optimizer"], _saved_sizes(state["optimizer"])
        end = layout.n_layers if stage == len(states) - 1 else start
        while end < layout.n_layers and sum(_sizes([[n for n, _ in layout.stage(start, end)]], shapes, flat)) < sum(want):
            end += 1
        groups = _grouped(layout.stage(start, end), 0.0)
        if _sizes(groups, shapes, flat) != want:
            raise ConfigError(f"{ckpt.path} does not name its optimizer's parameters (a checkpoint from before "
                              f"resharding existed) and its stage {stage} optimizer's groups do not match the model's "
                              f"parameters; resume it at its own layout, or pass --no-load-optim")
        out.append(groups)
        start = end
    return out


def index_state(ckpt: CheckpointFiles, mp: int, opt: dict, names: list[list[str]],
                shapes: dict[str, torch.Size]) -> tuple[dict[str, dict[str, torch.Tensor]], float | None]:
    """{name: {"exp_avg", "exp_avg_sq"[, "fp32"]}} of one mp rank's saved optimizer, and Adam's step."""
    torch_state = opt.get("optimizer_state_dict", opt)
    index = _index_flat if "fp32_groups_flat" in opt else _index_per_parameter
    out, step = {}, None
    for g, (group, group_names) in enumerate(zip(torch_state["param_groups"], names)):
        found, group_step = index(ckpt.mp_file(mp), opt, torch_state["state"], g, group["params"], group_names,
                                  shapes)
        out.update(found)
        step = group_step if group_step is not None else step
    return out, step


def _index_flat(path, opt, state, g, positions, names, shapes):
    """FP16_Optimizer: one flat fp32 master (and flat moments) per group, parameters in order."""
    entry, flat, offset, out = state.get(positions[0]), opt["fp32_groups_flat"][g], 0, {}
    for name in names:
        n = shapes[name].numel()
        view = lambda t, o=offset, n=n, s=shapes[name]: t[o:o + n].view(s)  # noqa: E731
        out[name] = {"fp32": view(flat), **({k: view(entry[k]) for k in OPTIM_KEYS} if entry else {})}
        offset += n
    if offset != flat.numel():
        raise ConfigError(f"{path}: fp16 optimizer group {g} holds {flat.numel()} elements, its parameters {offset}")
    return out, float(entry["step"]) if entry else None


def _index_per_parameter(path, opt, state, g, positions, names, shapes):
    """A torch optimizer's own state (fp32), or FP16_UnfusedOptimizer's over per-parameter fp32 copies."""
    if len(names) != len(positions):
        raise ConfigError(f"{path}: optimizer group {g} has {len(positions)} parameters, the names {len(names)}")
    out, step = {}, None
    for j, (position, name) in enumerate(zip(positions, names)):
        entry = state.get(position)
        found = {"fp32": opt["fp32_groups"][g][j]} if "fp32_groups" in opt else {}
        if entry:
            found.update({k: entry[k] for k in OPTIM_KEYS})
            step = float(entry["step"])
        for t in found.values():
            if t.shape != shapes[name]:
                raise ConfigError(f"{path}: optimizer state of {name} has shape {tuple(t.shape)}, the parameter "
                                  f"{tuple(shapes[name])}")
        out[name] = found
    return out, step
