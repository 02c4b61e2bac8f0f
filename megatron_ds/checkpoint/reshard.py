"""Resume a checkpoint at another layout: TP, PP, DP, ZeRO stage (0-3), precision or padded
vocabulary may all differ from the run that saved it; the model's shape may not.

Every rank of the new run fills its own parameters and optimizer state from the saved files:

- weights: each parameter's full tensor is rebuilt from the saved tensor parallel shards
  (``tp.merge``), resized to this run's padded vocabulary (and, under --allow-vocab-change, to
  another tokenizer's: ``vocabulary``), and this rank's shard taken
  (``tp.split``). With optimizer state, the fp32 master weights are the source (bf16 runs).
- optimizer state (fp32 masters, Adam ``exp_avg`` / ``exp_avg_sq``, step): read by parameter name
  (``optim_state.SavedOptimizer``: ZeRO / bf16 optimizer shards, ZeRO-3's flat partitions, or the
  ZeRO-0 torch / fp16 optimizer's positional state) and written into this run's optimizer through
  DeepSpeed's public ``safe_set_full_fp32_param`` / ``safe_set_full_optimizer_state`` (ZeRO 1-3,
  bf16), its fp16 optimizer's fp32 copies (fp16 ZeRO-0) or the torch optimizer's state (fp32
  ZeRO-0); ZeRO-3 weights through ``GatheredParameters`` (``engine_state``);
- fp16 ZeRO-0 to fp16 ZeRO-0: the dynamic loss scaler's state;
- LR schedule, iteration, consumed samples and DeepSpeed's step counters from the client state;
- mixture of experts: the saved experts are numbered globally (``megatron_ds.checkpoint.expert_files``);
  each rank takes the experts of its expert parallel rank, whatever EP size saved them (Megatron-LM's layer:
  its slice of the stacked experts' first dimension, ``stacked_experts``);
- FP8 delayed scaling's amax histories and scales (buffers, equal on every tensor parallel rank: the
  amax is reduced over them): tensor parallel rank 0's copy, for every rank of the new layout;
- RNG states only when TP and PP are unchanged (each saved state belongs to a (stage, TP rank)
  that no longer exists otherwise); the new run then keeps its freshly seeded streams.

Files are memory-mapped and read parameter by parameter, one layer's shards at a time.
"""
from __future__ import annotations

import collections
from typing import Callable

import torch

from megatron_ds import ds_compat
from megatron_ds.checkpoint import stacked_experts
from megatron_ds.checkpoint import tp as tp_rules
from megatron_ds.checkpoint.consolidate import merge_layer
from megatron_ds.checkpoint.engine_state import StateSetter
from megatron_ds.checkpoint.files import (CheckpointFiles, checkpoint_names, is_buffer_state, layer_prefixes, load_file,
                                         open_checkpoint)
from megatron_ds.checkpoint.format import EXPERT_PARALLEL_SIZE, EXPERT_TENSOR_PARALLEL_SIZE, PIPELINE_LAYERS
from megatron_ds.checkpoint.moe_sources import expert_global_names
from megatron_ds.checkpoint.optim_state import SavedOptimizer
from megatron_ds.checkpoint.sources import layer_source
from megatron_ds.checkpoint.vocabulary import VocabChange, fit_vocab_rows
from megatron_ds.config.family import ModelFamily
from megatron_ds.errors import ConfigError

VIRTUAL_PP = "virtual_pipeline_model_parallel_size"
LAYOUT_FIELDS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size", "zero_stage",
                 "precision", "padded_vocab_size", "use_pipeline", EXPERT_PARALLEL_SIZE, PIPELINE_LAYERS,
                 EXPERT_TENSOR_PARALLEL_SIZE, VIRTUAL_PP)


def needs_reshard(saved_meta: dict, current: dict, *, load_optim: bool) -> bool:
    """Whether DeepSpeed's own loader cannot take this checkpoint as it is."""
    if saved_meta.get("weights_only"):
        return True
    saved = saved_meta["signature"]
    weights = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "padded_vocab_size", "use_pipeline")
    optim = ("data_parallel_size", "zero_stage", "precision")
    # Another expert parallel size: DeepSpeed's loader would read the experts by their global ids,
    # but ZeRO-0's optimizer state of the wrong expert parallel rank (expp_rank files)
    moe = (EXPERT_PARALLEL_SIZE,) if EXPERT_PARALLEL_SIZE in current else ()
    if "moe_router_topk" in saved and max(saved.get(EXPERT_PARALLEL_SIZE, 1), current.get(EXPERT_PARALLEL_SIZE, 1),
                                          saved.get(EXPERT_TENSOR_PARALLEL_SIZE, 1),
                                          current.get(EXPERT_TENSOR_PARALLEL_SIZE, 1)) > 1:
        # Megatron-LM's layer split over EP or ETP ranks: DeepSpeed's loader knows its experts at neither end
        return True
    # Another number of interleaved chunks: the optimizer groups the chunks' parameters in another order (weights
    # alone load as they are: the layer files are the same)
    chunks = load_optim and saved.get(VIRTUAL_PP, 1) != current.get(VIRTUAL_PP, 1)
    return chunks or saved.get(PIPELINE_LAYERS) != current.get(PIPELINE_LAYERS) or any(
        saved.get(k) != current[k] for k in weights + moe + (optim if load_optim else ()))


def optimizer_param_names(engine) -> list[list[str]] | None:
    """The parameter names of a plain torch optimizer's groups, in order (saved with each
    checkpoint: its state is keyed by position only). None for DeepSpeed's own optimizers,
    whose files name their parameters."""
    opt = engine.optimizer
    if ds_compat.names_its_parameters_in_files(opt) or not hasattr(opt, "param_groups"):
        return None  # ZeRO 1-3, bf16: their files name the parameters
    saved = checkpoint_names(engine.module)  # an interleaved run's model chunks: the layer files' names
    names = {id(p): saved[n] for n, p in engine.module.named_parameters()}
    # DeepSpeed's fp16 optimizers (ZeRO-0) hold fp32 copies; their fp16_groups are the module's
    groups = ds_compat.fp16_optimizer_groups(opt) if ds_compat.is_fp16_optimizer(opt) else [
        g["params"] for g in opt.param_groups]
    try:
        return [[names[id(p)] for p in g] for g in groups]
    except KeyError:  # ZeRO's flat groups: not module parameters
        return None


def _layer_of(name: str, prefixes: dict[str, int]) -> int:
    for prefix, idx in prefixes.items():
        if name.startswith(prefix):
            return idx
    raise ConfigError(f"parameter {name} belongs to no layer of the saved model")


def full_tensors(ckpt, source, saved_opt, idx: int, prefix: str) -> dict[str, dict[str, torch.Tensor]]:
    """name -> {"weight", and with optimizer state "fp32", "exp_avg", "exp_avg_sq"} full tensors of a layer."""
    shards = source.shards(idx, prefix)
    weights = merge_layer(shards, prefix, ckpt.model, ckpt.family)
    out = {name: {"weight": w} for name, w in weights.items()}
    if saved_opt is not None:
        for name in (n for n in weights if not is_buffer_state(n)):  # buffers: no optimizer state
            local = name[len(prefix):]
            per_rank = [saved_opt.tensors(name, t, shards[t][local].shape) for t in range(ckpt.tp)]
            if any(p is None for p in per_rank):
                raise ConfigError(f"{ckpt.path} has no optimizer state for {name}; pass --no-load-optim")
            for key in per_rank[0]:
                out[name][key] = tp_rules.merge(name, [p[key].float() for p in per_rank], ckpt.model, ckpt.family)
    return out


def load_resharded(engine, load_dir: str, iteration: int, *, ps, padded_vocab_size: int, load_optim: bool,
                   load_lr_state: bool, family: ModelFamily, vocab_change: VocabChange | None = None,
                   log: Callable = print) -> dict:
    """Fill ``engine``'s parameters (and optimizer state) from a checkpoint saved at another
    layout; ``ps`` is this run's ``ParallelState``, ``family`` its model family,
    ``vocab_change`` a tokenizer change --allow-vocab-change accepted (``vocabulary.fit_vocab_rows``).
    Returns the client state (without RNG states that no longer apply)."""
    ckpt = open_checkpoint(load_dir, iteration, family)
    weights_only = ckpt.meta.get("weights_only", False)
    load_optim = load_optim and not weights_only
    saved_opt = SavedOptimizer(ckpt) if load_optim else None
    source = layer_source(ckpt)
    prefixes = {p: idx for idx, p in layer_prefixes(ckpt.model, ckpt.padded_vocab_size, ckpt.family)}
    # by the names the checkpoint gives them (an interleaved or ZB-H1 run's model chunks name theirs otherwise)
    saved_as = checkpoint_names(engine.module)
    params = {saved_as[n]: p for n, p in engine.module.named_parameters()}
    buffers = {saved_as[n]: b for n, b in engine.module.named_buffers() if is_buffer_state(n)}
    by_layer = collections.defaultdict(list)
    for name in [*params, *buffers]:
        by_layer[_layer_of(name, prefixes)].append(name)
    setter = StateSetter(engine)
    # this rank's DeepSpeed-MoE experts by their saved (global) ids (that layer never runs in model chunks:
    # config/moe_params.py refuses the interleaved and ZB-H1 schedules, so these names are the saved ones)
    saved_names = expert_global_names(engine.module)
    stacked = {saved_as[n]: p for n, p in stacked_experts.stacked_parameters(engine.module).items()}
    fresh = []
    for idx, prefix in sorted((i, p) for p, i in prefixes.items()):
        if idx not in by_layer:
            continue
        full = full_tensors(ckpt, source, saved_opt, idx, prefix)
        for name in by_layer[idx]:
            if name in buffers:
                _load_buffer(buffers[name], full.get(saved_names.get(name, name)), name, fresh)
                continue
            saved = saved_names.get(name, name)
            if saved not in full:
                raise ConfigError(f"{ckpt.path} has no tensor for parameter {saved}")
            fitted = {k: stacked_experts.local_part(name, t, stacked, ps.tp_rank) for k, t in
                      fit_vocab_rows(name, full[saved], padded_vocab_size, vocab_change, family).items()}
            shard = {k: tp_rules.split(name, t, ps.tp_size, ps.tp_rank, ckpt.model, family) for k, t in fitted.items()}
            setter.set(params[name], shard)
    if saved_opt is not None:
        setter.set_step(saved_opt.step)
        if saved_opt.loss_scale and setter.set_loss_scale(saved_opt.loss_scale):
            log(f"fp16 loss scale {saved_opt.loss_scale.get('cur_scale')} carried over")
    if fresh:
        log(f"{ckpt.path} has no saved state for {len(fresh)} buffers (e.g. {fresh[0]}: FP8 delayed scaling's amax "
            f"history, a router's expert bias): they start as in a fresh run")
    client = _client_state(ckpt, engine, ps, load_lr_state=load_optim and load_lr_state, log=log)
    log(f"loaded {ckpt.path} resharded from TP {ckpt.tp} x PP {ckpt.pp} x DP {ckpt.dp} (ZeRO {ckpt.zero_stage}, "
        f"{ckpt.precision}{', weights only' if saved_opt is None else ''})")
    return client


def _load_buffer(buffer: torch.Tensor, saved: dict | None, name: str, fresh: list) -> None:
    """A replicated buffer (``is_buffer_state``) from the saved one (None: not saved, it stays fresh)."""
    if saved is None:
        fresh.append(name)
        return
    tensor = saved["weight"]
    if tensor.shape != buffer.shape:
        raise ConfigError(f"{name}: the checkpoint's buffer has shape {tuple(tensor.shape)}, this run's "
                          f"{tuple(buffer.shape)}: resume with the settings it was saved with (--fp8-amax-history-len, "
                          f"--num-experts)")
    with torch.no_grad():
        buffer.copy_(tensor)


def _client_state(ckpt: CheckpointFiles, engine, ps, *, load_lr_state: bool, log: Callable) -> dict:
    if ckpt.meta.get("weights_only"):
        return {}
    state = load_file(ckpt.mp_file(0))
    client = {k: state[k] for k in ("iteration", "consumed_train_samples", "consumed_valid_samples",
                                    "nan_iterations", "num_floating_point_operations_so_far") if k in state}
    if (ckpt.tp, ckpt.pp) == (ps.tp_size, ps.pp_size):
        mine = load_file(ckpt.mp_file(ps.pp_rank * ps.tp_size + ps.tp_rank))
        if mine.get("rng") is not None:
            client["rng"] = mine["rng"]
    else:
        log("NOTE: RNG states not restored (tensor/pipeline layout changed); dropout streams start afresh")
    if load_lr_state and state.get("lr_scheduler") is not None and engine.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
    ds_compat.set_engine_counters(engine, state)
    return client
