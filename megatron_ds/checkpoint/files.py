"""Finding and reading the files of a megatron_ds checkpoint, whatever layout wrote it.

A checkpoint ``DIR/global_stepN/`` (``megatron_ds.checkpoint.format``) holds:

- ``megatron_ds_config.json``: the saved run config and its layout signature (TP, PP, DP, ZeRO
  stage, precision, padded vocabulary) -- everything needed to interpret the rest;
- ``layer_{i:02d}-model_{t:02d}-model_states.pt``: DeepSpeed ``PipelineModule`` files, one per
  *global* layer index ``i`` and tensor parallel rank ``t`` (the data parallel and pipeline
  coordinates are not in the name, so these files mean the same at any PP or DP);
- ``mp_rank_{m:02d}_model_states.pt``: one per TP x PP rank ``m = pp_rank * tp + tp_rank``
  (DeepSpeed's "model parallel" rank): client state, LR scheduler, and, for the plain engine
  (``--no-pipeline-parallel``), the module's weights under ``"module"``;
- ``[bf16_]zero_pp_rank_{d}_mp_rank_{m:02d}_optim_states.pt``: ZeRO / bf16 optimizer shards;
- ZeRO-3 only: ``zero_pp_rank_{d}_mp_rank_{m:02d}_model_states.pt`` instead of the mp_rank files,
  the weights in the optimizer shards (``megatron_ds.checkpoint.zero3``);
- with MoE layers: no layer files, the mp_rank files hold every stage's non-expert weights, and
  DeepSpeed's expert files hold the experts (``megatron_ds.checkpoint.expert_files``, ``moe_sources``).

Files are opened with ``torch.load(mmap=True, weights_only=True)``: tensors stay on disk until a
slice of them is used, which keeps conversion memory near one layer even when a file (an
optimizer shard) holds a whole pipeline stage.
"""
from __future__ import annotations

import dataclasses
import functools
import glob
import os
import re

import torch
from deepspeed.pipe import TiedLayerSpec

from megatron_ds import ds_compat
from megatron_ds.checkpoint.format import META, TRACKER, read_meta, step_dir, tracked_iteration
from megatron_ds.config.family import UNRECORDED_FAMILY, ModelFamily
from megatron_ds.config.layout import resolve_model_config
from megatron_ds.config.schema import ModelConfig
from megatron_ds.errors import ConfigError
from megatron_ds.parallel.fp8_delayed import is_fp8_state
from megatron_ds.pipeline.chunks import TIED_WEIGHT, ModelChunks, pipeline_name, tied_weight_name

_LAYER_FILE = re.compile(r"layer_(\d+)-model_(\d+)-model_states\.pt$")
OPTIM_KEYS = ("exp_avg", "exp_avg_sq")  # Adam's moments, as torch's and DeepSpeed's optimizer states name them


def layer_file_name(layer: int, tp_rank: int) -> str:
    """DeepSpeed ``PipelineModule``'s per-layer file: global layer index, tensor parallel rank."""
    return f"layer_{layer:02d}-model_{tp_rank:02d}-model_states.pt"


def model_states_file(path: str, dp_rank: int, mp_rank: int) -> str:
    """ZeRO-3's client state (and empty module) of data parallel rank ``dp_rank``, model parallel ``mp_rank``."""
    return os.path.join(path, f"zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_model_states.pt")


def optim_states_file(path: str, dp_rank: int, mp_rank: int) -> str:
    """A ZeRO optimizer shard of data parallel rank ``dp_rank``, model parallel rank ``mp_rank``."""
    return os.path.join(path, f"zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt")


def layer_prefixes(model: ModelConfig, padded_vocab_size: int, family: ModelFamily) -> list[tuple[int, str]]:
    """(global layer index, state-dict prefix) of every layer that owns parameters, in order.

    Read from the model's own layer specs, so the names follow the model code: a tied module is
    ``tied_modules.<key>.`` (stored once, in the file of its first layer), others ``<index>.``.
    """
    out, seen = [], set()
    for idx, spec in enumerate(family.layer_specs(model, padded_vocab_size)):
        if isinstance(spec, TiedLayerSpec):
            if spec.key in seen:
                continue  # the tied output layer: the same weights, not saved again
            seen.add(spec.key)
            out.append((idx, f"tied_modules.{spec.key}."))
        else:
            out.append((idx, f"{idx}."))
    return out


def checkpoint_names(module: torch.nn.Module) -> dict[str, str]:
    """{name of each of ``module``'s parameters and buffers: the name its checkpoint files give it}: the same but
    for an interleaved or ZB-H1 run's model chunks, whose files are the ``PipelineModule``'s (``pipeline_name``)."""
    names = [n for n, _ in module.named_parameters()] + [n for n, _ in module.named_buffers()]
    rename = module.pipeline_name if isinstance(module, ModelChunks) else str
    return {n: rename(n) for n in names}


def load_file(path: str) -> dict:
    """torch.load a checkpoint file lazily (mmap) and safely (weights_only + DeepSpeed allowlist)."""
    with torch.serialization.safe_globals(ds_compat.checkpoint_safe_globals()):
        try:
            return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except RuntimeError as exc:  # files written without the zipfile format cannot be mapped
            if "mmap" not in str(exc):
                raise
            return torch.load(path, map_location="cpu", weights_only=True)


@dataclasses.dataclass
class CheckpointFiles:
    """One saved checkpoint: where it is and what layout and model wrote it."""

    path: str  # DIR/global_stepN
    iteration: int
    meta: dict  # megatron_ds_config.json
    model: ModelConfig  # resolved
    padded_vocab_size: int
    vocab_size: int | None  # the tokenizer's real vocabulary, when the checkpoint recorded it
    tp: int
    pp: int
    dp: int
    zero_stage: int
    precision: str
    family: ModelFamily  # the model family that wrote it, as its reader was given

    @property
    def config(self) -> dict:
        return self.meta.get("config", {})

    def layer_file(self, layer: int, tp_rank: int) -> str:
        return os.path.join(self.path, layer_file_name(layer, tp_rank))

    def has_layer_files(self) -> bool:
        return any(_LAYER_FILE.search(p) for p in os.listdir(self.path))

    def mp_file(self, mp_rank: int) -> str:
        if self.zero_stage == 3:  # ZeRO-3 writes the client state with every data parallel rank's shapes
            return model_states_file(self.path, 0, mp_rank)
        return os.path.join(self.path, f"mp_rank_{mp_rank:02d}_model_states.pt")

    def optimizer_files(self) -> list[str]:
        return sorted(glob.glob(os.path.join(self.path, "*zero_pp_rank_*_mp_rank_*_optim_states.pt")))

    @functools.cached_property
    def tied_name(self) -> str | None:
        return tied_weight_name(self.family.layer_specs(self.model, self.padded_vocab_size, device="meta"))

    def saved_name(self, name: str) -> str:
        """A parameter name as an optimizer file records it -> the layer files' (``PipelineModule``) name: an
        interleaved or ZB-H1 run's optimizer names its model chunks' parameters (``chunks.<c>.``, ``tied_weight``)."""
        # (the tied name only when asked: it builds the model's specs)
        return pipeline_name(name, self.tied_name if name == TIED_WEIGHT else None)


def resolve_iteration(load_dir: str, iteration: int | None) -> int:
    if iteration is not None:
        return iteration
    found = tracked_iteration(load_dir)
    if found is None:
        raise ConfigError(f"{load_dir} has no {TRACKER}; pass the iteration to load")
    return found


def _complete_step(load_dir: str, iteration: int | None) -> tuple[str, int]:
    """(DIR/global_stepN, N) of the checkpoint in ``load_dir`` at ``iteration`` (default: the tracker's)."""
    if not os.path.isdir(load_dir):
        raise ConfigError(f"checkpoint directory {load_dir} does not exist")
    iteration = resolve_iteration(load_dir, iteration)
    path = step_dir(load_dir, iteration)
    if not os.path.isfile(os.path.join(path, META)):
        raise ConfigError(f"{os.path.join(path, META)} is missing: no complete megatron_ds checkpoint for iteration "
                          f"{iteration} in {load_dir}")
    return path, iteration


def saved_family_name(load_dir: str, iteration: int | None = None) -> str:
    """The name of the model family that wrote the checkpoint (its meta's ``model_family``; absent:
    ``UNRECORDED_FAMILY``), for the tools that look its family up (``families.get_family``) before opening it."""
    path, _ = _complete_step(load_dir, iteration)
    return read_meta(path).get("model_family", UNRECORDED_FAMILY)


def open_checkpoint(load_dir: str, iteration: int | None, family: ModelFamily) -> CheckpointFiles:
    """The checkpoint in ``load_dir`` at ``iteration`` (None: the tracker's), written by ``family``'s
    model; a checkpoint of another family is refused, its layer files would not fit."""
    path, iteration = _complete_step(load_dir, iteration)
    meta = read_meta(path)
    saved, expected = meta.get("model_family", UNRECORDED_FAMILY), family.name
    if saved != expected:
        raise ConfigError(f"{path} holds a {saved} model (pretrain_{saved}.py wrote it), not the {expected} model "
                          f"this reads")
    sig = meta["signature"]
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    # the saved flags are the command line's; which MoE layer they built is in the signature (Megatron-LM's records
    # its top-k), which also holds for checkpoints written before --num-experts alone followed the line's dialect
    model = resolve_model_config(ModelConfig(**{k: v for k, v in meta["config"]["model"].items() if k in known}),
                                 deepspeed="moe_router_topk" not in sig)
    # --fusions-on-cpu was where the saving run compiled its kernels, not a property of the model:
    # a CPU tool reading this checkpoint should not spend minutes compiling them for no gain
    model = dataclasses.replace(model, fusions_on_cpu=False)
    return CheckpointFiles(
        path=path, iteration=iteration, meta=meta, model=model, padded_vocab_size=sig["padded_vocab_size"],
        vocab_size=meta.get("vocab_size"), tp=sig["tensor_model_parallel_size"],
        pp=sig["pipeline_model_parallel_size"], dp=sig["data_parallel_size"], zero_stage=sig["zero_stage"],
        precision=sig["precision"], family=family)


def is_buffer_state(name: str) -> bool:
    """Whether a state-dict name is a replicated buffer saved with the weights, which has no optimizer state and no
    fp32 master: FP8 delayed scaling's amax history and scales, and Megatron-LM's MoE routers' expert biases."""
    return is_fp8_state(name) or name.endswith("router.expert_bias")
