"""Any megatron_ds checkpoint -> full, unsharded fp32 weights for a single-process model.

``load_consolidated(dir)`` reads a checkpoint written at any TP / PP / DP / ZeRO stage (0-3) /
precision and returns the state dict of ``build_sequential_gpt(c.model,
padded_vocab_size=c.padded_vocab_size, tp_group=None, seed=...)``, key for key, so that
``model.load_state_dict(c.state_dict)`` works. ``iter_consolidated_layers`` yields the same
tensors one pipeline layer at a time, for conversions that must not hold the whole model (13B+
on one node).

Only the per-layer files and the saved config are read, never the layout of the processes that
wrote them: DeepSpeed names layer files by *global* layer index and tensor parallel rank, so a
checkpoint means the same whichever pipeline partition or data parallel size wrote it.

Weights come from the module files, i.e. the numbers the saved model computed with (bf16 or fp16
runs: their half-precision weights, exactly representable in fp32). ``from_masters=True`` takes
the fp32 master copies in the optimizer files instead (what ``megatron_ds.checkpoint.reshard``
resumes training from). ZeRO-3 checkpoints keep the weights only there: they are read from the
masters, rounded to the training precision unless ``from_masters`` (so both ways agree with the
other stages).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterator

import torch
from deepspeed.pipe import TiedLayerSpec

from megatron_ds.config import ConfigError, ModelConfig
from megatron_ds.checkpoint import tp as tp_rules
from megatron_ds.checkpoint.files import CheckpointFiles, load_file, open_checkpoint


@dataclasses.dataclass
class Consolidated:
    model: ModelConfig  # resolved
    padded_vocab_size: int
    vocab_size: int | None  # the real tokenizer vocabulary if the checkpoint recorded it
    iteration: int
    config: dict  # the saved run config (Config.to_dict() of the run that wrote it)
    state_dict: dict[str, torch.Tensor]


def layer_prefixes(model: ModelConfig, padded_vocab_size: int) -> list[tuple[int, str]]:
    """(global layer index, state-dict prefix) of every layer that owns parameters, in order.

    Read from the model's own layer specs, so the names follow the model code: a tied module is
    ``tied_modules.<key>.`` (stored once, in the file of its first layer), others ``<index>.``.
    """
    from megatron_ds.model.pipeline import gpt_layer_specs  # noqa: PLC0415 - heavy import

    out, seen = [], set()
    for idx, spec in enumerate(gpt_layer_specs(model, padded_vocab_size=padded_vocab_size)):
        if isinstance(spec, TiedLayerSpec):
            if spec.key in seen:
                continue  # the tied output layer: the same weights, not saved again
            seen.add(spec.key)
            out.append((idx, f"tied_modules.{spec.key}."))
        else:
            out.append((idx, f"{idx}."))
    return out


class _ModuleSource:
    """Per-layer tensor parallel shards from the plain engine's mp_rank files (module under "module")."""

    def __init__(self, ckpt: CheckpointFiles):
        self.modules = []
        for t in range(ckpt.tp):
            state = load_file(ckpt.mp_file(t))
            if not state.get("module"):
                raise ConfigError(f"{ckpt.path} has neither pipeline layer files nor module weights in "
                                  f"{ckpt.mp_file(t)}")
            self.modules.append(state["module"])

    def shards(self, idx: int, prefix: str) -> list[dict]:
        return [{k[len(prefix):]: v for k, v in m.items() if k.startswith(prefix)} for m in self.modules]


class _LayerFileSource:
    def __init__(self, ckpt: CheckpointFiles):
        self.ckpt = ckpt

    def shards(self, idx: int, prefix: str) -> list[dict]:
        paths = [self.ckpt.layer_file(idx, t) for t in range(self.ckpt.tp)]
        try:
            return [load_file(p) for p in paths]
        except FileNotFoundError as exc:
            raise ConfigError(f"checkpoint {self.ckpt.path} is incomplete: {exc.filename} is missing") from None


def layer_source(ckpt: CheckpointFiles, *, from_masters: bool = False):
    """Where a layer's tensor parallel shards come from: the module's weights (layer files or the
    plain engine's module), or the optimizer's fp32 masters (``from_masters``; ZeRO-3 checkpoints
    always, rounded to the training precision unless ``from_masters``: ZeRO-3 keeps no other copy)."""
    if from_masters or ckpt.zero_stage == 3:
        from megatron_ds.checkpoint.masters import MasterSource  # noqa: PLC0415 - it builds on this module

        return MasterSource(ckpt, exact=from_masters)
    return _LayerFileSource(ckpt) if ckpt.has_layer_files() else _ModuleSource(ckpt)


def merge_layer(shards: list[dict], prefix: str, model: ModelConfig) -> dict[str, torch.Tensor]:
    """One layer's full fp32 tensors, keyed with ``prefix``, from its tensor parallel shards."""
    out = {}
    for name in shards[0]:
        full_name = prefix + name
        tensors = [s[name] for s in shards]
        out[full_name] = tp_rules.merge(full_name, tensors, model).to(torch.float32).clone()
    return out


def iter_consolidated_layers(load_dir: str | CheckpointFiles, iteration: int | None = None, *,
                             from_masters: bool = False,
                             log: Callable = print) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """Yield ``(global layer index, {state-dict key: full fp32 tensor})`` layer by layer (the fp32
    master weights of the optimizer files with ``from_masters``)."""
    ckpt = load_dir if isinstance(load_dir, CheckpointFiles) else open_checkpoint(load_dir, iteration)
    source = layer_source(ckpt, from_masters=from_masters)
    prefixes = layer_prefixes(ckpt.model, ckpt.padded_vocab_size)
    for n, (idx, prefix) in enumerate(prefixes):
        yield idx, merge_layer(source.shards(idx, prefix), prefix, ckpt.model)
        log(f"consolidated layer {n + 1}/{len(prefixes)} of {ckpt.path}")


def load_consolidated(load_dir: str, iteration: int | None = None, *, from_masters: bool = False,
                      log: Callable = print) -> Consolidated:
    """The whole model's full fp32 weights from the checkpoint in ``load_dir`` (tracker's iteration
    unless ``iteration`` is given; the optimizer's fp32 masters with ``from_masters``). See the
    module docstring."""
    ckpt = open_checkpoint(load_dir, iteration)
    log(f"reading {ckpt.path} (TP {ckpt.tp}, PP {ckpt.pp}, DP {ckpt.dp}, ZeRO {ckpt.zero_stage}, "
        f"{ckpt.precision})")
    state: dict[str, torch.Tensor] = {}
    for _, tensors in iter_consolidated_layers(ckpt, from_masters=from_masters, log=lambda *a: None):
        state.update(tensors)
    return Consolidated(model=ckpt.model, padded_vocab_size=ckpt.padded_vocab_size, vocab_size=ckpt.vocab_size,
                        iteration=ckpt.iteration, config=ckpt.config, state_dict=state)
