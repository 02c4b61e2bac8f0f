"""The on-disk format of a ``--save`` directory: names, trackers, the saved config and its signature.

Layout of ``--save DIR``::

    DIR/global_stepN/...                       DeepSpeed's files (module, optimizer, client state)
    DIR/global_stepN/megatron_ds_config.json   META: the run's flags, layout signature, real vocabulary,
                                               tokenizer (``vocabulary``)
    DIR/global_stepN/megatron_ds_manifest.json MANIFEST: every file's size and CRC-32 (``integrity``)
    DIR/latest_checkpointed_iteration.txt      TRACKER, Megatron's: "N"
    DIR/latest                                 DeepSpeed's tracker: "global_stepN" (for its tools)
    DIR/.megatron_ds.lock                      the running job's lock (``lock``)
    DIR/latest_universal                       a DeepSpeed universal checkpoint's tracker (``universal``)

Every module that reads or writes these names takes them from here. The files inside
``global_stepN`` that DeepSpeed writes are described in ``megatron_ds.checkpoint.files``.
"""
from __future__ import annotations

import json
import os
import re

from megatron_ds.config.moe_selection import is_mlm_moe
from megatron_ds.config.moe_params import is_moe
from megatron_ds.errors import ConfigError

TRACKER = "latest_checkpointed_iteration.txt"
DS_TRACKER = "latest"
UNIVERSAL_TRACKER = "latest_universal"  # written by DeepSpeed's ds_to_universal next to its output folder
META = "megatron_ds_config.json"
MANIFEST = "megatron_ds_manifest.json"
# What META says in every checkpoint saved since a manifest alone decides completeness: META is
# written before the manifest, so META without a manifest is an interrupted save -- unless META
# lacks this entry, which marks a checkpoint written before manifests existed (complete then).
COMPLETENESS = ("completeness", "manifest")
_STEP = re.compile(r"^global_step(\d+)$")

# Model fields that must agree between a checkpoint and the run loading it.
SHAPE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "ffn_hidden_size",
                "kv_channels", "position_embedding_type", "normalization", "swiglu", "add_bias_linear",
                "untie_embeddings_and_output_weights")


MLA_SHAPE_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")

# With MoE layers also: the parameters each layer has and how experts split over TP ranks.
MOE_SHAPE_FIELDS = ("num_experts", "expert_interval", "mlp_type", "enable_expert_tensor_parallelism")
MLM_MOE_SHAPE_FIELDS = ("moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
                        "moe_shared_expert_gate", "moe_layer_freq", "moe_router_enable_expert_bias")
EXPERT_PARALLEL_SIZE = "expert_parallel_size"  # a layout field (resharded at --load)
# Megatron-LM's MoE with experts split over TP (a layout field, recorded only when > 1: older checkpoints match)
EXPERT_TENSOR_PARALLEL_SIZE = "expert_tensor_parallel_size"
# Transformer layers of each pipeline stage (of each virtual stage under interleaving) where they are uneven: a
# layout field, since at the same sizes another split gives each stage the optimizer state of other layers.
# Absent for equal stages, what every checkpoint written before uneven stages holds.
PIPELINE_LAYERS = "pipeline_stage_layers"


def checkpoint_tag(iteration: int) -> str:
    return f"global_step{iteration}"


def step_dir(directory: str, iteration: int) -> str:
    """``directory/global_stepN``."""
    return os.path.join(directory, checkpoint_tag(iteration))


def list_steps(directory: str) -> list[int]:
    """Iterations of the global_stepN directories, newest first."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted((int(m.group(1)) for n in names if (m := _STEP.match(n))
                   and os.path.isdir(os.path.join(directory, n))), reverse=True)


def atomic_write(path: str, text: str) -> None:
    """Write ``path`` whole or not at all (temp file, fsync, rename): a crash leaves the old file."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:  # a full disk: leave no half-written temp file behind
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_trackers(directory: str, iteration: int) -> None:
    """Megatron's and DeepSpeed's trackers, pointing at ``global_step{iteration}``."""
    atomic_write(os.path.join(directory, TRACKER), str(iteration))
    atomic_write(os.path.join(directory, DS_TRACKER), checkpoint_tag(iteration))


def read_tracker(directory: str) -> tuple[int | None, str | None]:
    """(iteration, problem). (None, None): no tracker. "release" is iteration 0, as in Megatron."""
    path = os.path.join(directory, TRACKER)
    if not os.path.isfile(path):
        return None, None
    try:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8").strip()
    except UnicodeDecodeError:
        return None, f"{path} is not UTF-8 text (damaged)"
    except OSError as exc:
        return None, f"{path} cannot be read ({exc.strerror})"
    if text == "release":
        return 0, None
    if not text.isdigit():
        return None, f"{path} should hold an iteration number, found {text[:40]!r}"
    return int(text), None


def tracked_iteration(directory: str) -> int | None:
    """The tracker's iteration, None without a tracker; a damaged tracker is a ConfigError."""
    iteration, problem = read_tracker(directory)
    if problem:
        raise ConfigError(problem)
    return iteration


def read_meta(ckpt_dir: str) -> dict:
    """``global_stepN/megatron_ds_config.json``: {"signature", "config", "vocab_size", ...}."""
    with open(os.path.join(ckpt_dir, META)) as f:
        return json.load(f)


# What a checkpoint's record carries into the checkpoints of a run that loaded it: the Hugging Face class
# an imported model came from (gpt_hf_import writes it, to_hf.py exports to it where it can)
CARRIED = ("hf_architecture",)


def carried_meta(load_dir: str | None, step: int | None = None) -> dict:
    """The ``CARRIED`` entries of the record of --load's checkpoint (``step``, else the one its tracker
    names); {} where there is none or it cannot be read (every checkpoint of a run carries the same)."""
    if not load_dir:
        return {}
    iteration = step if step is not None else read_tracker(load_dir)[0]
    if iteration is None:
        return {}
    try:
        meta = read_meta(step_dir(load_dir, iteration))
    except (OSError, ValueError):
        return {}
    return {k: meta[k] for k in CARRIED if k in meta}


def signature(model, *, padded_vocab_size: int, tp: int = 1, pp: int = 1, dp: int = 1, virtual_pp: int | None = None,
              zero_stage: int = 0, precision: str = "fp32", use_pipeline: bool = True, ep: int = 1) -> dict:
    """What a checkpoint records about the run that wrote it (compared on load): the resolved
    model's shape and the layout. The defaults are those of an imported (TP 1, fp32) checkpoint.
    A mixture-of-experts model adds its experts' shape and the expert parallel size (a dense
    model's signature is what it was before MoE existed, so older checkpoints still match)."""
    sig = {name: getattr(model, name) for name in SHAPE_FIELDS}
    if is_moe(model) and is_mlm_moe(model):  # Megatron-LM's MoE layers (model/mlm_moe.py): their own shape
        sig.update({name: getattr(model, name) for name in MLM_MOE_SHAPE_FIELDS}, num_experts=list(model.num_experts))
        sig[EXPERT_PARALLEL_SIZE] = ep
    elif is_moe(model):
        sig.update({name: getattr(model, name) for name in MOE_SHAPE_FIELDS}, num_experts=list(model.num_experts))
        sig[EXPERT_PARALLEL_SIZE] = ep
    if model.position_embedding_type == "learned_absolute":
        sig["max_position_embeddings"] = model.max_position_embeddings
    if model.position_embedding_type == "relative":  # T5's bias tables' shape (added only then: older
        sig["relative_attention_num_buckets"] = model.relative_attention_num_buckets  # signatures still match)
    if model.geglu:  # T5's gated GeLU doubles the first MLP matrix, as --swiglu
        sig["geglu"] = True
    for name in ("add_qkv_bias", "qk_layernorm"):  # parameters of their own (added only when on, as above)
        if getattr(model, name, False):
            sig[name] = True
    if getattr(model, "qk_layernorm_scope", "head") != "head" and model.qk_layernorm:  # its norms' shapes
        sig["qk_layernorm_scope"] = model.qk_layernorm_scope
    if getattr(model, "multi_latent_attention", False):  # its own parameters and their shapes
        sig.update({name: getattr(model, name) for name in MLA_SHAPE_FIELDS}, multi_latent_attention=True)
    if getattr(model, "decoder_num_layers", None) is not None:  # T5's; its split rank is a layout, resharded
        sig["decoder_num_layers"] = model.decoder_num_layers
    sig.update(padded_vocab_size=padded_vocab_size, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
               data_parallel_size=dp)
    if virtual_pp is not None:
        sig["virtual_pipeline_model_parallel_size"] = virtual_pp
    sig.update(zero_stage=zero_stage, precision=precision, use_pipeline=use_pipeline)
    return sig


def layout_signature(layout) -> dict:
    """The signature of a training run's ``Layout``. Its data parallel size counts the ranks holding
    the same weights, over which ZeRO shards the optimizer state: under DeepSpeed-Ulysses the SP x DP
    ranks of the sequence data parallel group, under context parallelism the DP x CP ranks of DeepSpeed's data
    parallel group (the weights themselves depend on neither SP nor CP). The model
    family is recorded as ``model_family``, but for the one whose checkpoints predate the field
    (``ModelFamily.recorded_name``: the GPT's stay as they were)."""
    sig = signature(layout.model, padded_vocab_size=layout.padded_vocab_size, tp=layout.tp, pp=layout.pp,
                    dp=layout.dp * layout.sp * layout.cp, virtual_pp=layout.virtual_pp, zero_stage=layout.zero_stage,
                    precision=layout.precision, use_pipeline=layout.use_pipeline, ep=layout.ep)
    if layout.family.recorded_name is not None:
        sig["model_family"] = layout.family.recorded_name
    layers = layout.chunk_layers or tuple(s.layers[1] - s.layers[0] for s in layout.stages)
    if len(set(layers)) > 1:
        sig[PIPELINE_LAYERS] = list(layers)
    if layout.etp > 1:
        sig[EXPERT_TENSOR_PARALLEL_SIZE] = layout.etp
    return sig
