"""Checkpoints: DeepSpeed engine checkpoints plus Megatron's tracker file.

Layout of ``--save DIR``::

    DIR/global_stepN/...                     DeepSpeed's files (module, optimizer, client state)
    DIR/global_stepN/megatron_ds_config.json the resolved config and layout of the run that saved
    DIR/latest_checkpointed_iteration.txt    Megatron's tracker: "N"
    DIR/latest                               DeepSpeed's tracker: "global_stepN" (for its tools)

The trackers are written by rank 0 only after a barrier that every rank reaches once its own files
are written, and atomically (temp file + rename): a crash during a save leaves the trackers
pointing at the previous, complete checkpoint.

Loading checks the saved layout against this run's before touching any tensor, so a different
model shape or TP/PP fails at once with the differing fields rather than with a size-mismatch
traceback. Files are read with ``torch.load(weights_only=True)`` and an allowlist of the few
DeepSpeed classes its optimizer states contain, instead of unpickling arbitrary objects.
"""
from __future__ import annotations

import json
import os
import random

import numpy as np
import torch
import torch.distributed as dist
from megatron_ds import ds_compat
from megatron_ds.config import ConfigError
from megatron_ds.ds_compat import TorchCheckpointEngine
from megatron_ds.parallel.random import get_rng_tracker
from megatron_ds.training import ckpt_integrity

TRACKER = "latest_checkpointed_iteration.txt"
DS_TRACKER = "latest"
META = "megatron_ds_config.json"
# Fields that must agree between the checkpoint and the run loading it.
SHAPE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "ffn_hidden_size",
                "kv_channels", "position_embedding_type", "normalization", "swiglu", "add_bias_linear",
                "untie_embeddings_and_output_weights")


def checkpoint_tag(iteration: int) -> str:
    return f"global_step{iteration}"


def _atomic_write(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def layout_signature(layout) -> dict:
    """What a checkpoint records about the run that wrote it (compared on load)."""
    m = layout.model
    sig = {name: getattr(m, name) for name in SHAPE_FIELDS}
    if m.position_embedding_type == "learned_absolute":
        sig["max_position_embeddings"] = m.max_position_embeddings
    sig.update(padded_vocab_size=layout.padded_vocab_size, tensor_model_parallel_size=layout.tp,
               pipeline_model_parallel_size=layout.pp, data_parallel_size=layout.dp,
               virtual_pipeline_model_parallel_size=layout.virtual_pp,
               zero_stage=layout.zero_stage, precision=layout.precision, use_pipeline=layout.use_pipeline)
    return sig


def check_compatible(saved: dict, current: dict, path: str, *, load_optim: bool) -> None:
    """Raise ConfigError naming every field that differs."""
    # The interleaved schedule orders and groups parameters differently: its optimizer state only
    # fits an interleaved run with the same chunks, but its weights load anywhere (same layer files).
    optim_fields = ("data_parallel_size", "zero_stage", "precision", "virtual_pipeline_model_parallel_size")
    saved = {"virtual_pipeline_model_parallel_size": 1, **saved}  # checkpoints from before interleaving
    fields = [k for k in current if k not in optim_fields]
    if load_optim:
        # ZeRO and DeepSpeed's bf16 optimizer shard optimizer state over data parallel ranks: the
        # shard files only fit the same DP size, stage and precision.
        fields += [k for k in optim_fields if k in current]
    diffs = [f"{k}: checkpoint {saved.get(k)!r} vs now {current[k]!r}" for k in fields if saved.get(k) != current[k]]
    if diffs:
        hint = ("; or pass --no-load-optim to load the weights only" if any(
            saved.get(k) != current[k] for k in optim_fields if k in fields and k in current) else "")
        raise ConfigError(f"checkpoint {path} does not match this run ({'; '.join(diffs)}); use the "
                          f"checkpoint's settings (or convert the checkpoint){hint}")


def rng_state() -> dict:
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        # numpy's state as tensors so the checkpoint stays loadable with weights_only=True
        "numpy": (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]),
        "torch": torch.get_rng_state(),
        "tracker": get_rng_tracker().get_states(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(_to_tuple(state["python"]))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    get_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _to_tuple(x):
    return tuple(_to_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def _is_zip(path: str) -> bool:
    """torch.save writes zip archives; a zeroed or foreign file is not one (and must not be
    reported as a pickle with forbidden objects)."""
    with open(path, "rb") as f:
        return f.read(4) == b"PK\x03\x04"


class WeightsOnlyCheckpointEngine(TorchCheckpointEngine):
    """DeepSpeed's torch checkpoint engine, but loading with weights_only=True."""

    def load(self, path: str, map_location=None):
        with torch.serialization.safe_globals(ds_compat.checkpoint_safe_globals()):
            try:
                return torch.load(path, map_location=map_location, weights_only=True)
            except Exception as exc:  # noqa: BLE001 - re-raised with the file and the remedy
                if not _is_zip(path) or ("weights_only" not in str(exc) and "Unsupported global" not in str(exc)):
                    # a damaged file in a checkpoint without a manifest (older than manifests)
                    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                    raise ConfigError(f"cannot read checkpoint file {path}: {first}") from None
                raise ConfigError(f"refusing to unpickle {path}: it holds objects outside the allowlist "
                                  f"({str(exc).splitlines()[0]}). Only load checkpoints you trust; "
                                  f"this file was not written by megatron_ds") from None


def install_safe_loading(engine, log=print) -> None:
    """Swap DeepSpeed's default torch checkpoint engine for the weights-only one. Another engine
    configured in the JSON (a fast or decoupled writer) is left alone, with a note."""
    if ds_compat.is_default_checkpoint_engine(engine):
        safe = WeightsOnlyCheckpointEngine(config_params=ds_compat.engine_config(engine))
        ds_compat.set_checkpoint_engine(engine, safe)
    else:
        log(f"NOTE: checkpoint engine {type(ds_compat.checkpoint_engine(engine)).__name__} from the DeepSpeed JSON is "
            f"used as is (its loads are not restricted to weights_only)")


def read_tracker(load_dir: str) -> int | None:
    """The iteration in Megatron's tracker file, or None when there is no checkpoint."""
    iteration, problem = ckpt_integrity.read_tracker(load_dir)
    if problem:
        raise ConfigError(problem)
    return iteration


def save_checkpoint(engine, save_dir: str, iteration: int, *, client_state: dict, meta: dict,
                    keep_last: int | None = None, log=print) -> None:
    from megatron_ds.checkpoint.reshard import optimizer_param_names  # noqa: PLC0415

    tag = checkpoint_tag(iteration)
    os.makedirs(save_dir, exist_ok=True)
    # A plain torch optimizer's state is keyed by position: name the positions, so the checkpoint
    # can be resharded to another layout (megatron_ds/checkpoint/reshard.py).
    client_state = {**client_state, "optimizer_param_names": optimizer_param_names(engine)}
    if "signature" in meta:  # what DeepSpeed's ds_to_universal needs (megatron_ds/checkpoint/universal.py)
        from megatron_ds.checkpoint.universal import UC_INFO, checkpoint_info  # noqa: PLC0415

        client_state[UC_INFO] = checkpoint_info(meta["signature"], meta.get("vocab_size"))
    engine.save_checkpoint(save_dir, tag=tag, client_state=client_state, save_latest=False)
    dist.barrier()  # every rank has written its files
    if dist.get_rank() == 0:
        _atomic_write(os.path.join(save_dir, tag, META), json.dumps(meta, indent=2, default=str))
    ckpt_integrity.write_manifest(os.path.join(save_dir, tag), iteration)  # collective; marks it complete
    if dist.get_rank() == 0:
        _atomic_write(os.path.join(save_dir, TRACKER), str(iteration))
        _atomic_write(os.path.join(save_dir, DS_TRACKER), tag)
        if keep_last:
            ckpt_integrity.prune(save_dir, iteration, keep_last, log=log)
    dist.barrier()


def load_checkpoint(engine, load_dir: str, *, signature: dict, load_optim: bool, finetune: bool,
                    load_lr_state: bool = True, exact_step: int | None = None, ps=None, universal: bool = False,
                    log=print) -> tuple[int, dict]:
    """Load the newest complete checkpoint in load_dir (or exactly `exact_step`, --ckpt-step).
    Returns (iteration, client_state); (0, {}) if there is none. A checkpoint of another layout
    (or an imported one) is resharded when ``ps`` is given; ``universal``: a DeepSpeed universal one."""
    if universal:
        from megatron_ds.checkpoint.universal import load_universal  # noqa: PLC0415

        client = load_universal(engine, load_dir, signature=signature, ps=ps, load_optim=load_optim and not finetune,
                                load_lr_state=load_lr_state, log=log)
        return (0 if finetune else client["iteration"]), client
    iteration = ckpt_integrity.choose_checkpoint(load_dir, exact_step=exact_step, log=log)
    if iteration is None:
        log(f"WARNING: no {TRACKER} in --load {load_dir}; starting from scratch")
        return 0, {}
    tag = checkpoint_tag(iteration)
    meta_path = os.path.join(load_dir, tag, META)
    if not os.path.isfile(meta_path):
        raise ConfigError(f"{meta_path} is missing: {load_dir} has a tracker for iteration {iteration} "
                          f"but not the checkpoint it points to")
    with open(meta_path) as f:
        saved = json.load(f)
    from megatron_ds.checkpoint.reshard import LAYOUT_FIELDS, load_resharded, needs_reshard  # noqa: PLC0415

    if ps is not None and needs_reshard(saved, signature, load_optim=load_optim and not finetune):
        shape = {k: v for k, v in signature.items() if k not in LAYOUT_FIELDS}
        check_compatible(saved["signature"], shape, os.path.join(load_dir, tag), load_optim=False)
        client = load_resharded(engine, load_dir, iteration, ps=ps, padded_vocab_size=signature["padded_vocab_size"],
                                load_optim=load_optim and not finetune, load_lr_state=load_lr_state, log=log)
        return (0 if finetune else client.get("iteration", iteration)), client
    check_compatible(saved["signature"], signature, os.path.join(load_dir, tag),
                     load_optim=load_optim and not finetune)
    load_optim = load_optim and not finetune
    # DeepSpeed (0.19) saves the bf16 optimizer's state under ZeRO-0 in its bf16_zero_* files but
    # reads it back from the module file, where it is not: load those files ourselves.
    sharded_without_zero = ds_compat.is_bf16_optimizer(engine.optimizer) and not engine.zero_optimization()
    # no_grad: DeepSpeed re-broadcasts tied weights in place while loading, which autograd would
    # otherwise record (and warn about in the next backward).
    with torch.no_grad():
        path, client_state = engine.load_checkpoint(
            load_dir, tag=tag, load_optimizer_states=load_optim and not sharded_without_zero,
            load_lr_scheduler_states=load_optim and load_lr_state, load_module_strict=True)
    if path is None:
        raise ConfigError(f"DeepSpeed could not load {os.path.join(load_dir, tag)}")
    if sharded_without_zero and load_optim and not ds_compat.load_bf16_optimizer_files(engine, load_dir, tag):
        raise ConfigError(f"{os.path.join(load_dir, tag)} has no bf16 optimizer state files; "
                          f"pass --no-load-optim to load the weights only")
    log(f"loaded checkpoint {os.path.join(load_dir, tag)} (iteration {iteration})")
    return (0 if finetune else iteration), (client_state or {})
