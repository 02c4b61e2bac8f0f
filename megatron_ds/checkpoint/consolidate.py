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

FP8 delayed scaling's amax histories and scales (``<layer>.fp8_scaling.*``) are training state, not
weights: left out, unless ``fp8_state=True``.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterator

import torch

from megatron_ds.checkpoint import tp as tp_rules
from megatron_ds.checkpoint.files import CheckpointFiles, layer_prefixes, open_checkpoint
from megatron_ds.checkpoint.sources import layer_source
from megatron_ds.config.family import ModelFamily
from megatron_ds.config.schema import ModelConfig
from megatron_ds.parallel.fp8_delayed import is_fp8_state


@dataclasses.dataclass
class Consolidated:
    model: ModelConfig  # resolved
    padded_vocab_size: int
    vocab_size: int | None  # the real tokenizer vocabulary if the checkpoint recorded it
    iteration: int
    config: dict  # the saved run config (Config.to_dict() of the run that wrote it)
    state_dict: dict[str, torch.Tensor]


def merge_layer(shards: list[dict], prefix: str, model: ModelConfig, family: ModelFamily) -> dict[str, torch.Tensor]:
    """One layer's full fp32 tensors, keyed with ``prefix``, from its tensor parallel shards (split as
    ``family``'s layers split them)."""
    out = {}
    for name in shards[0]:
        full_name = prefix + name
        tensors = [s[name] for s in shards]
        out[full_name] = tp_rules.merge(full_name, tensors, model, family).to(torch.float32).clone()
    return out


def iter_consolidated_layers(ckpt: CheckpointFiles, *, from_masters: bool = False, fp8_state: bool = False,
                             log: Callable = print) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """Yield ``(global layer index, {state-dict key: full fp32 tensor})`` layer by layer (the fp32
    master weights of the optimizer files with ``from_masters``) of an opened checkpoint (``open_checkpoint``)."""
    source = layer_source(ckpt, from_masters=from_masters)
    prefixes = layer_prefixes(ckpt.model, ckpt.padded_vocab_size, ckpt.family)
    for n, (idx, prefix) in enumerate(prefixes):
        tensors = merge_layer(source.shards(idx, prefix), prefix, ckpt.model, ckpt.family)
        yield idx, (tensors if fp8_state else {k: v for k, v in tensors.items() if not is_fp8_state(k)})
        log(f"consolidated layer {n + 1}/{len(prefixes)} of {ckpt.path}")


def load_consolidated(load_dir: str, iteration: int | None = None, *, from_masters: bool = False,
                      fp8_state: bool = False, family: ModelFamily, log: Callable = print) -> Consolidated:
    """The whole model's full fp32 weights from the checkpoint in ``load_dir`` (tracker's iteration
    unless ``iteration`` is given; the optimizer's fp32 masters with ``from_masters``), written by
    ``family``'s model. See the module docstring."""
    ckpt = open_checkpoint(load_dir, iteration, family)
    log(f"reading {ckpt.path} (TP {ckpt.tp}, PP {ckpt.pp}, DP {ckpt.dp}, ZeRO {ckpt.zero_stage}, "
        f"{ckpt.precision})")
    state: dict[str, torch.Tensor] = {}
    for _, tensors in iter_consolidated_layers(ckpt, from_masters=from_masters, fp8_state=fp8_state,
                                               log=lambda *a: None):
        state.update(tensors)
    return Consolidated(model=ckpt.model, padded_vocab_size=ckpt.padded_vocab_size, vocab_size=ckpt.vocab_size,
                        iteration=ckpt.iteration, config=ckpt.config, state_dict=state)
