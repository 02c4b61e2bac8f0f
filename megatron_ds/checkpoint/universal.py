"""DeepSpeed universal checkpoints: ``--load DIR --universal-checkpoint``.

A universal checkpoint is what DeepSpeed's converter writes
(``python -m deepspeed.checkpoint.ds_to_universal --input_folder DIR/global_stepN
--output_folder DIR/global_stepN_universal``): one folder per parameter under ``zero/``
holding the *full* (unsharded) fp32 master ``fp32.pt``, Adam's ``exp_avg.pt`` / ``exp_avg_sq.pt``
and ``step.pt`` (each a dict with the tensor under ``"param"``, plus how it was merged), the copied
``mp_rank_*_model_states.pt`` (client state, LR scheduler) and ``DIR/latest_universal`` naming the
folder. As in Megatron-DeepSpeed (megatron/training.py turns ``--universal-checkpoint`` into
DeepSpeed's ``{"checkpoint": {"load_universal": true}}``, and DeepSpeed's engine then reads the tag
from ``latest_universal``), ``--load DIR`` finds the folder through ``DIR/latest_universal``; a
universal folder itself is accepted too.

Two kinds are read, at any TP / PP / DP / ZeRO 0-2 / precision of this run:

- ours, converted from a megatron_ds checkpoint: every checkpoint records the
  ``universal_checkpoint_info`` that ``ds_to_universal`` needs (``checkpoint_info`` below, the
  same patterns as Megatron-DeepSpeed's megatron/model/gpt_model.py ``UniversalCheckpointInfo``),
  plus this toolkit's layout signature, checked against this run's model;
- Megatron-DeepSpeed's GPT (``GPTModelPipe`` or ``GPTModel``): its parameter names are mapped to
  ours and its fused QKV rows reordered where its code version needs it (``megatron_names``).

Each of this run's parameters is read from its own files (memory-mapped), put into our layout,
resized to this run's padded vocabulary and split for this rank by the resharding code
(``megatron_ds.checkpoint.tp``, ``engine_state.StateSetter``), so memory stays near one parameter.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import types
from typing import Callable

import torch

from megatron_ds import ds_compat
from megatron_ds.checkpoint import megatron_names
from megatron_ds.checkpoint import tp as tp_rules
from megatron_ds.checkpoint.engine_state import StateSetter
from megatron_ds.checkpoint.expert_files import has_expert_files
from megatron_ds.checkpoint.files import OPTIM_KEYS, checkpoint_names, load_file, open_checkpoint
from megatron_ds.checkpoint.format import EXPERT_PARALLEL_SIZE, SHAPE_FIELDS, UNIVERSAL_TRACKER
from megatron_ds.checkpoint.vocabulary import VocabSettings, fit_vocab_rows, rows_only
from megatron_ds.config.family import ModelFamily
from megatron_ds.data.tokenizer import canonical_tokenizer_type
from megatron_ds.errors import ConfigError
from megatron_ds.parallel.fp8_delayed import is_fp8_state

UC_INFO = "universal_checkpoint_info"  # deepspeed.checkpoint.constants.UNIVERSAL_CHECKPOINT_INFO
SIGNATURE_KEY = "megatron_ds_signature"  # ours, inside UC_INFO (DeepSpeed ignores unknown keys)
STATES = ("fp32", *OPTIM_KEYS)


# ---------------------------------------------------------------- saving: what ds_to_universal needs
def checkpoint_info(signature: dict, vocab_size: int | None) -> dict:
    """``universal_checkpoint_info`` for a checkpoint of ours: how ``ds_to_universal`` merges each
    parameter's tensor parallel slices. Transcribed from Megatron-DeepSpeed's gpt_model.py
    ``UniversalCheckpointInfo`` for our parameter names (megatron_ds.checkpoint.tp has the rules);
    only patterns that match a parameter of this model are listed, since the converter's strict
    mode refuses unused ones."""
    from deepspeed.checkpoint import constants as c  # noqa: PLC0415

    layer = r"(\d+\.)?"  # pipeline layer index; the plain engine's names have none
    bias = signature["add_bias_linear"]
    norms = ["input_layernorm", "post_attention_layernorm", "final_layernorm"]
    replicated = [rf"{layer}({'|'.join(norms)})\.weight$"]
    if signature["normalization"].lower() == "layernorm":
        replicated.append(rf"{layer}({'|'.join(norms)})\.bias$")
    if signature.get("qk_layernorm") and signature.get("qk_layernorm_scope") != "projection":
        # one weight of head size shared by every head: on each TP rank (projection: split, merged along dim 0)
        kinds = "(weight|bias)" if signature["normalization"].lower() == "layernorm" else "weight"
        replicated.append(rf"{layer}self_attention\.(q|k)_layernorm\.{kinds}$")
    if signature.get("multi_latent_attention"):  # the down projections and the latents' norms (checkpoint/tp.py)
        kinds = "(weight|bias)" if signature["normalization"].lower() == "layernorm" else "weight"
        replicated += [rf"{layer}self_attention\.linear_(q|kv)_down_proj\.weight$",
                       rf"{layer}self_attention\.(q|kv)_layernorm\.{kinds}$"]
    if signature["position_embedding_type"] == "learned_absolute":
        replicated.append(r".*position_embeddings\.weight$")
    if bias:
        replicated.append(rf"{layer}(self_attention\.dense|mlp\.dense_4h_to_h)\.bias$")
    vocab = [r".*word_embeddings\.weight$"]
    if signature["untie_embeddings_and_output_weights"]:
        vocab.append(r".*output_layer\.weight$")
    info = {
        c.UNIVERSAL_CHECKPOINT_VERSION_KEY: c.UNIVERSAL_CHECKPOINT_VERSION_VALUE,
        c.ORIGINAL_VOCAB_SIZE: vocab_size or signature["padded_vocab_size"],
        c.PADDED_VOCAB_SIZE: signature["padded_vocab_size"],
        c.VOCABULARY_PARAMETER_PATTERNS: vocab,
        c.TP_REPLICATED_PARAMETER_PATTERNS: replicated,
        c.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: [rf"{layer}(self_attention\.dense|mlp\.dense_4h_to_h)\.weight$"],
        # rank r holds [gate_r; up_r]: merged to [gate; up], our full layout (tp.py)
        c.PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0: ([rf"{layer}mlp\.dense_h_to_4h\.weight$"]
                                                   + ([rf"{layer}mlp\.dense_h_to_4h\.bias$"] if bias else []))
        if signature["swiglu"] else [],
        SIGNATURE_KEY: dict(signature),
    }
    if signature.get("use_pipeline", True) and not signature["untie_embeddings_and_output_weights"]:
        # the tied embedding is stored by the first and the last stage: keep one copy
        info[c.PIPELINE_REPLICATED_PARAMETER_PATTERNS] = [r"tied_modules\.embed\.word_embeddings\.weight$"]
    return info


def convert(load_dir: str, iteration: int | None = None, *, family: ModelFamily, workers: int = 2,
            log: Callable = print) -> str:
    """Run DeepSpeed's ``ds_to_universal`` on a checkpoint of ours after checking that it can take
    it; returns the universal folder (``DIR/global_stepN_universal``, named in ``DIR/latest_universal``).
    The converter runs through its command line (``python -m``), the interface DeepSpeed documents."""
    ckpt = open_checkpoint(load_dir, iteration, family)
    if not family.universal_checkpoints:
        # the parameter patterns (checkpoint_info) are the GPT's, as upstream's: only Megatron-DeepSpeed's
        # gpt_model.py declares UniversalCheckpointInfo
        raise ConfigError(f"{ckpt.path} is a {family.label} checkpoint: universal checkpoints hold GPT models "
                          f"only; load it directly with --load at any TP / PP / DP (megatron_ds reshards it)")
    if has_expert_files(ckpt.path):
        # ds_to_universal (0.19) reads the module's parameters from ZeRO files and mp_rank files;
        # DeepSpeed-MoE's expert files are neither (Megatron-DeepSpeed's reported KeyError 'param_shapes')
        raise ConfigError(f"{ckpt.path} has mixture-of-experts layers, whose expert files DeepSpeed's "
                          f"ds_to_universal does not convert; load it directly with --load at any EP / TP / PP "
                          f"(megatron_ds reshards it)")
    if ckpt.zero_stage == 0:
        # ds_to_universal reads each parameter's fragments from ZeRO optimizer files
        # (*_optim_states.pt with param_slice_mappings) and its shapes from the mp_rank files'
        # param_shapes; without ZeRO, DeepSpeed writes no such files for fp32 (the torch optimizer's
        # state sits in the mp_rank files) and no param_shapes for bf16.
        raise ConfigError(f"{ckpt.path} was saved without ZeRO (--zero-stage 0, {ckpt.precision}): DeepSpeed's "
                          f"ds_to_universal needs ZeRO-1/2 optimizer files; load it directly with --load at any "
                          f"layout (megatron_ds reshards it), or resume and save once with --zero-stage 1")
    if ckpt.zero_stage == 3:
        raise ConfigError(f"{ckpt.path} was saved with ZeRO-3, which this conversion does not support; load it "
                          f"with --load instead")
    state = load_file(ckpt.mp_file(0))
    if any(ckpt.saved_name(name) != name for group in state.get("param_shapes") or [] for name in group):
        # DeepSpeed's files name the model chunks' parameters (chunks.<c>.*, tied_weight), which the converter's
        # patterns (checkpoint_info) do not match: it stops with "Unused patterns"
        raise ConfigError(f"{ckpt.path} was saved on the interleaved or ZB-H1 schedule, whose optimizer files name "
                          f"the model chunks' parameters, which DeepSpeed's ds_to_universal cannot match; load it "
                          f"directly with --load at any layout and schedule (megatron_ds reshards it)")
    if UC_INFO not in state:
        raise ConfigError(f"{ckpt.path} was saved before megatron_ds recorded {UC_INFO}; load it with --load (at any "
                          f"layout) and save it once")
    out = f"{ckpt.path}_universal"
    log(f"converting {ckpt.path} (TP {ckpt.tp}, PP {ckpt.pp}, DP {ckpt.dp}, ZeRO {ckpt.zero_stage}, {ckpt.precision}) "
        f"to {out} with DeepSpeed's ds_to_universal")
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", ckpt.path,
           "--output_folder", out, "--num_extract_workers", str(workers),
           "--num_merge_workers", str(max(1, workers // 2))]
    rc = subprocess.run(cmd, check=False).returncode
    if rc != 0:
        raise ConfigError(f"DeepSpeed's ds_to_universal failed (exit {rc}) converting {ckpt.path}; its message is above")
    return out


# ---------------------------------------------------------------- reading
def _safe_globals() -> list:
    """Plain data classes these files hold besides tensors: DeepSpeed's SubparamShape (ds_to_universal's
    merge notes), Megatron's argparse Namespace (``args``) and numpy arrays (the numpy RNG state in
    Megatron's ``rng_state``; torch's documentation lists these numpy entries for weights_only)."""
    import numpy as np  # noqa: PLC0415
    from deepspeed.checkpoint.universal_checkpoint import SubparamShape  # noqa: PLC0415

    reconstruct = (getattr(np, "_core", None) or np.core).multiarray._reconstruct
    dtypes = [getattr(np.dtypes, n) for n in dir(np.dtypes) if n.endswith("DType")]
    # files pickled under numpy 1 name it numpy.core.multiarray, numpy 2 numpy._core.multiarray
    return [*ds_compat.checkpoint_safe_globals(), SubparamShape, argparse.Namespace, reconstruct,
            (reconstruct, "numpy.core.multiarray._reconstruct"), np.ndarray, np.dtype, *dtypes]


def _load(path: str):
    """torch.load a universal file lazily and without arbitrary unpickling (``_safe_globals``)."""
    with torch.serialization.safe_globals(_safe_globals()):
        try:
            try:
                return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            except RuntimeError as exc:  # not a zip archive: cannot be memory-mapped
                if "mmap" not in str(exc):
                    raise
                return torch.load(path, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise
        except Exception as exc:  # noqa: BLE001 - one line naming the file
            lines = str(exc).strip().splitlines() or [type(exc).__name__]
            why = next((ln.strip() for ln in lines if "Unsupported global" in ln), lines[0])
            raise ConfigError(f"cannot read universal checkpoint file {path}: {why}") from None


def find_universal(load_dir: str) -> str:
    """The universal checkpoint folder for ``--load load_dir --universal-checkpoint``."""
    if os.path.isdir(os.path.join(load_dir, "zero")):
        return load_dir
    latest = os.path.join(load_dir, UNIVERSAL_TRACKER)
    if not os.path.isfile(latest):
        raise ConfigError(f"--universal-checkpoint: {load_dir} has neither a zero/ folder nor a "
                          f"{UNIVERSAL_TRACKER} file; "
                          f"convert a checkpoint first: python -m deepspeed.checkpoint.ds_to_universal "
                          f"--input_folder {load_dir}/global_stepN --output_folder {load_dir}/global_stepN_universal")
    with open(latest) as f:
        tag = f.read().strip()
    path = os.path.join(load_dir, tag)
    if not os.path.isdir(os.path.join(path, "zero")):
        raise ConfigError(f"{latest} names {tag}, but {path}/zero does not exist")
    return path


class UniversalCheckpoint:
    """One universal checkpoint folder: its client state and its parameters by our names."""

    def __init__(self, path: str):
        self.path = path
        mp_files = sorted(f for f in os.listdir(path) if f.startswith("mp_rank_") and f.endswith("_model_states.pt"))
        if not mp_files:
            raise ConfigError(f"{path} has no mp_rank_*_model_states.pt (not a universal checkpoint)")
        self.state = _load(os.path.join(path, mp_files[0]))
        self.info = self.state.get(UC_INFO) or {}
        self.args = self.state.get("args")  # Megatron-DeepSpeed's argparse Namespace
        self.ours = SIGNATURE_KEY in self.info
        if not self.ours and self.args is None:
            raise ConfigError(f"{path}: neither a megatron_ds nor a Megatron-DeepSpeed checkpoint (no "
                              f"'{UC_INFO}.{SIGNATURE_KEY}' and no 'args' in {mp_files[0]})")
        self.zero = os.path.join(path, "zero")
        names = sorted(n for n in os.listdir(self.zero) if os.path.isdir(os.path.join(self.zero, n)))
        self.by_canonical = megatron_names.index(names)
        self.saved_tp = (self.info[SIGNATURE_KEY]["tensor_model_parallel_size"] if self.ours
                         else int(getattr(self.args, "tensor_model_parallel_size", 1)))

    def tokenizer(self) -> dict:
        """The tokenizer facts it holds (``vocabulary.saved_tokenizer``'s): the real vocabulary size
        both kinds record, and Megatron-DeepSpeed's --tokenizer-type. Ours recorded its padded size
        there when it knew no real one: then only the padded rows are compared."""
        from deepspeed.checkpoint import constants as c  # noqa: PLC0415

        real, padded = self.info.get(c.ORIGINAL_VOCAB_SIZE), self.info.get(c.PADDED_VOCAB_SIZE)
        if self.ours:
            sig = self.info[SIGNATURE_KEY]
            if real and real != padded:
                return {"type": None, "vocab_size": int(real), "eod": None, "digest": None}
            return rows_only(sig["padded_vocab_size"], None, sig["tensor_model_parallel_size"])
        args = self.args
        if real:
            return {"type": canonical_tokenizer_type(getattr(args, "tokenizer_type", None)),
                    "vocab_size": int(real), "eod": None, "digest": None}
        return rows_only(getattr(args, "padded_vocab_size"), getattr(args, "make_vocab_size_divisible_by", None),
                         self.saved_tp)

    def check_model(self, signature: dict) -> None:
        """The saved model's shape must be this run's (one line naming every difference)."""
        if self.ours:
            saved = self.info[SIGNATURE_KEY]
        else:
            saved = megatron_names.signature_from_args(self.args, self.path)
        fields = [k for k in SHAPE_FIELDS + ("max_position_embeddings", "add_qkv_bias", "qk_layernorm",
                                                                    "qk_layernorm_scope") if k in signature]
        norm = lambda v: v.lower() if isinstance(v, str) else v  # noqa: E731 - "LayerNorm" == "layernorm"
        diffs = [f"{k}: checkpoint {saved.get(k)!r} vs now {signature[k]!r}" for k in fields
                 if norm(saved.get(k)) != norm(signature[k])]
        if diffs:
            raise ConfigError(f"universal checkpoint {self.path} does not match this run ({'; '.join(diffs)})")

    def full(self, name: str, model, *, with_optim: bool) -> dict[str, torch.Tensor]:
        """{"fp32", and with_optim "exp_avg", "exp_avg_sq"}: full tensors of our parameter ``name``
        in our layout (vocabulary rows as saved)."""
        canon = megatron_names.canonical(name, ours=True)
        folder = self.by_canonical.get(canon)
        if folder is None:
            raise ConfigError(f"universal checkpoint {self.path} has no tensor for parameter {name}")
        out = {}
        for state in STATES if with_optim else ("fp32",):
            path = os.path.join(self.zero, folder, f"{state}.pt")
            if not os.path.isfile(path):
                if state == "fp32":
                    raise ConfigError(f"{path} is missing")
                # ZeRO makes no optimizer state for a parameter that never had a gradient: Adam's are zeros
                out[state] = torch.zeros_like(out["fp32"])
                continue
            entry = _load(path)
            tensor = entry["param"] if isinstance(entry, dict) else entry
            out[state] = megatron_names.to_our_layout(canon, tensor.float(), entry, model, self)
        return out

    def step(self) -> float | None:
        for folder in self.by_canonical.values():
            path = os.path.join(self.zero, folder, "step.pt")
            if os.path.isfile(path):
                step = _load(path)
                return float(step.item() if torch.is_tensor(step) else step)
        return None


def load_universal(engine, load_dir: str, *, signature: dict, ps, load_optim: bool, load_lr_state: bool,
                   family: ModelFamily, vocab: VocabSettings | None = None,
                   log: Callable = print) -> dict:
    """Fill ``engine``'s parameters (and optimizer state) from the universal checkpoint of
    ``load_dir``; returns the client state (iteration, consumed samples, RNG where it applies).
    ``vocab``: this run's tokenizer, compared with the one the checkpoint was trained with."""
    if not family.universal_checkpoints:
        raise ConfigError(f"--universal-checkpoint: universal checkpoints hold GPT models only (pretrain_gpt.py), "
                          f"this run is {family.label}; load its checkpoints with --load alone "
                          f"(megatron_ds reshards them across TP / PP / DP)")
    if EXPERT_PARALLEL_SIZE in signature:
        raise ConfigError("--universal-checkpoint: DeepSpeed's universal checkpoints do not hold mixture-of-experts "
                          "expert files; load the MoE checkpoint with --load alone (it reshards across EP / TP / PP)")
    uc = UniversalCheckpoint(find_universal(load_dir))
    uc.check_model(signature)
    padded = signature["padded_vocab_size"]
    change = (vocab or VocabSettings(None)).check(uc.tokenizer(), path=uc.path, padded=padded, log=log)
    # what the layout rules read (tp.partition, megatron_names.to_our_layout)
    model = types.SimpleNamespace(**{k: signature[k] for k in ("num_attention_heads", "num_key_value_heads",
                                                                 "swiglu")}, geglu=signature.get("geglu", False),
                                    qk_layernorm_scope=signature.get("qk_layernorm_scope", "head"),
                                    multi_latent_attention=signature.get("multi_latent_attention", False))
    setter = StateSetter(engine)
    saved_as = checkpoint_names(engine.module)  # model chunks (interleaved, ZB-H1): by the PipelineModule's names
    for own_name, param in engine.module.named_parameters():
        name = saved_as[own_name]
        full = uc.full(name, model, with_optim=load_optim)
        real = uc.info.get("original_vocab_size")
        too_big = full["fp32"].shape[0] > padded and (real or 0) > padded
        if change is None and tp_rules.is_vocab_param(name, family) and too_big:  # (--allow-vocab-change cuts rows)
            raise ConfigError(f"{name}: the checkpoint's vocabulary ({real}) exceeds this run's padded "
                              f"vocabulary ({padded}); use the checkpoint's tokenizer")
        shard = {k: tp_rules.split(name, t, ps.tp_size, ps.tp_rank, model, family)
                 for k, t in fit_vocab_rows(name, full, padded, change, family).items()}
        shard["weight"] = shard["fp32"]
        if tuple(shard["weight"].shape) != tuple(param.shape):
            raise ConfigError(f"{name}: the universal checkpoint's tensor gives shape {tuple(shard['weight'].shape)} "
                              f"on this rank, the model has {tuple(param.shape)}")
        setter.set(param, shard)
        del full, shard
    if load_optim:
        step = uc.step()
        if step is None:
            raise ConfigError(f"{uc.path} has no step.pt (Adam's step count); pass --no-load-optim")
        setter.set_step(step)
    if any(is_fp8_state(name) for name, _ in engine.module.named_buffers()):
        log("FP8 delayed scaling starts from an empty amax history: universal checkpoints hold parameters and "
            "their optimizer state only (--load the checkpoint itself to carry the history over)")
    client = _client_state(uc, engine, ps, load_lr_state=load_optim and load_lr_state, log=log)
    log(f"loaded universal checkpoint {uc.path} ({'megatron_ds' if uc.ours else 'Megatron-DeepSpeed'}, saved at "
        f"TP {uc.saved_tp}; iteration {client.get('iteration', 0)}{'' if load_optim else ', weights only'})")
    return client


def _client_state(uc: UniversalCheckpoint, engine, ps, *, load_lr_state: bool, log: Callable) -> dict:
    """Iteration, consumed samples, RNG (same TP and PP only), LR schedule and DeepSpeed's counters."""
    st = uc.state
    client = {"iteration": int(st.get("iteration", 0))}
    if uc.ours:
        client.update({k: st[k] for k in ("consumed_train_samples", "consumed_train_tokens", "consumed_valid_samples",
                                          "nan_iterations", "num_floating_point_operations_so_far") if k in st})
        saved = uc.info[SIGNATURE_KEY]
        if (saved["tensor_model_parallel_size"], saved["pipeline_model_parallel_size"]) == (ps.tp_size, ps.pp_size):
            mine = _load(os.path.join(uc.path, f"mp_rank_{ps.pp_rank * ps.tp_size + ps.tp_rank:02d}_model_states.pt"))
            if mine.get("rng") is not None:
                client["rng"] = mine["rng"]
    else:  # Megatron-DeepSpeed keeps the counters in its args (megatron/checkpointing.py load_checkpoint)
        args = uc.args
        client.update(consumed_train_samples=int(getattr(args, "consumed_train_samples", 0)),
                      consumed_valid_samples=int(getattr(args, "consumed_valid_samples", 0)))
        if st.get("tokens") is not None:
            client["consumed_train_tokens"] = int(st["tokens"])
    if "rng" not in client:
        log("NOTE: RNG states not restored (universal checkpoint of another tensor/pipeline layout or from "
            "Megatron-DeepSpeed); dropout streams start afresh")
    sched = st.get("lr_scheduler")
    if load_lr_state and sched is not None and engine.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(sched if uc.ours else _megatron_schedule(sched, uc.args, uc.path))
    ds_compat.set_engine_counters(engine, st)
    return client


def _megatron_schedule(state: dict, args, path: str) -> dict:
    """Megatron-DeepSpeed's OptimizerParamScheduler state in our LRSchedule's terms. It counts
    samples (megatron/training.py: ``lr_decay_steps = lr_decay_iters * global_batch_size``, stepped
    by ``increment = num_microbatches * micro_batch_size * data_parallel_size``); ours counts steps."""
    if getattr(args, "rampup_batch_size", None):
        raise ConfigError(f"{path}: the learning-rate schedule of a --rampup-batch-size run counts samples; "
                          f"pass --no-load-lr-state to start this run's schedule afresh")
    gbs = int(args.global_batch_size)
    return {"max_lr": state["max_lr"], "min_lr": state["min_lr"],
            "warmup_steps": int(round(state["lr_warmup_steps"] / gbs)),
            "decay_steps": int(round(state["lr_decay_steps"] / gbs)), "decay_style": state["lr_decay_style"],
            "num_steps": int(state["num_steps"]) // gbs}
