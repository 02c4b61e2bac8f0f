"""What Megatron-DeepSpeed silently overrides or ignores, done the same way here but said once.

A launch script that works with Megatron-DeepSpeed must not be refused for a flag that has no effect
there; it must not be silently reinterpreted either. ``megatron_overrides`` applies Megatron-DeepSpeed's
own overrides to the parsed flags and the DeepSpeed JSON and returns the new values with one warning
per override, naming the values involved; neither input is edited. Everything here depends only on
the flags, the DeepSpeed JSON and whether wandb is installed.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import math
import re

from megatron_ds.config.schema import Config
from megatron_ds.errors import ConfigError

# flag -> (TrainingConfig field, key in the JSON's "fp16" block, DeepSpeed's default for that key,
#          flag value -> JSON value)
_LOSS_SCALE_FLAGS = {
    "--loss-scale": ("loss_scale", "loss_scale", 0, float),  # 0 = dynamic
    "--initial-loss-scale": ("initial_loss_scale", "initial_scale_power", 16, lambda v: math.log2(v)),
    "--min-loss-scale": ("min_loss_scale", "min_loss_scale", 1, float),
    "--loss-scale-window": ("loss_scale_window", "loss_scale_window", 1000, float),
    "--hysteresis": ("hysteresis", "hysteresis", 2, float),
}


def _replace(cfg: Config, section: str, **changes) -> Config:
    return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **changes)})


def _sequence_parallel_at_tp1(cfg: Config) -> tuple[Config, list[str]]:
    # megatron/arguments.py validate_args: "disable sequence parallelism when tp=1 to avoid change in
    # numerics when sequence_parallelism is enabled" -- it sets args.sequence_parallel = False.
    if cfg.parallel.sequence_parallel and cfg.parallel.tensor_model_parallel_size == 1:
        return _replace(cfg, "parallel", sequence_parallel=False), [
            "--sequence-parallel is turned off: --tensor-model-parallel-size is 1 (Megatron-DeepSpeed "
            "does the same; sequence parallelism splits activations across tensor parallel ranks)"]
    return cfg, []


def _old_recompute_flag(cfg: Config) -> Config:
    """Megatron-LM before the recompute rename (v2.x, which Megatron-DeepSpeed's examples/pretrain_gpt3_175B.sh
    still uses): ParallelTransformer.forward ran ``_checkpointed_forward`` whenever
    ``activations_checkpoint_method is not None`` -- the flag alone meant full recomputation."""
    t = cfg.training
    if t.activations_checkpoint_method is None:
        return cfg
    changes = {"recompute_method": t.activations_checkpoint_method}
    if t.recompute_granularity is None:
        changes["checkpoint_activations"] = True
    return _replace(cfg, "training", **changes)


def _recompute_activations(cfg: Config) -> tuple[Config, list[str]]:
    """megatron/arguments.py validate_args: ``if args.recompute_activations: args.recompute_granularity =
    'selective'`` -- Megatron's switch for selective recomputation, winning over --recompute-granularity."""
    t = cfg.training
    if not t.recompute_activations or t.recompute_granularity == "selective":
        return cfg, []
    notes = [f"--recompute-activations sets --recompute-granularity selective (was {t.recompute_granularity}), "
             f"as in Megatron-DeepSpeed"] if t.recompute_granularity else []
    return _replace(cfg, "training", recompute_granularity="selective"), notes


def _load_tag(cfg: Config) -> Config:
    """--load-tag names the directory DeepSpeed loads (megatron/checkpointing.py passes it as ``tag``);
    ours are global_stepN, so the tag is --ckpt-step N."""
    c = cfg.checkpoint
    if c.load_tag is None:
        return cfg
    match = re.fullmatch(r"global_step(\d+)", c.load_tag)
    if match is None:
        raise ConfigError(f"--load-tag {c.load_tag}: checkpoints here are named global_stepN; pass "
                          f"--load-tag global_stepN or --ckpt-step N")
    step = int(match.group(1))
    if c.ckpt_step is not None and c.ckpt_step != step:
        raise ConfigError(f"--load-tag {c.load_tag} and --ckpt-step {c.ckpt_step} name different checkpoints")
    return _replace(cfg, "checkpoint", ckpt_step=step)


# load_args_from_checkpoint (megatron/checkpointing.py): (section, field, force). Without force the
# checkpoint's value fills only a flag the command line left unset; with force it wins.
_CHECKPOINT_ARGS = (
    ("model", "num_layers", False), ("model", "hidden_size", False), ("model", "ffn_hidden_size", False),
    ("model", "seq_length", False), ("model", "num_attention_heads", False), ("model", "num_key_value_heads", False),
    ("model", "kv_channels", False), ("model", "max_position_embeddings", False),
    # add_position_embedding and use_rotary_position_embeddings (force): our three position flags
    ("model", "position_embedding_type", True), ("model", "no_position_embedding", True),
    ("model", "use_rotary_position_embeddings", True), ("model", "rotary_percent", True),
    ("model", "add_bias_linear", True), ("model", "swiglu", True),
    ("model", "untie_embeddings_and_output_weights", True), ("model", "apply_layernorm_1p", True),
    ("data", "tokenizer_type", False), ("data", "tiktoken_pattern", True),  # core_v0.19.0 forces the latter
    ("parallel", "tensor_model_parallel_size", True), ("parallel", "pipeline_model_parallel_size", True),
    ("parallel", "virtual_pipeline_model_parallel_size", True),
    ("parallel", "num_layers_per_virtual_pipeline_stage", False),
)


def apply_checkpoint_args(cfg: Config, saved: dict | None) -> tuple[Config, list[str]]:
    """--use-checkpoint-args: the model shape and parallel sizes from the flags a checkpoint was saved
    with (``saved``: its record, sections of flags; None when it has none), as Megatron's
    load_args_from_checkpoint sets them; one note per value taken."""
    if not cfg.checkpoint.use_checkpoint_args:
        return cfg, []
    if cfg.checkpoint.load is None:
        raise ConfigError("--use-checkpoint-args needs --load (the checkpoint whose flags to use)")
    if not saved:
        return cfg, [f"--use-checkpoint-args: the checkpoint in {cfg.checkpoint.load} has no saved flags; "
                     f"using the command line's"]
    notes = []
    for section, name, force in _CHECKPOINT_ARGS:
        value, current = saved.get(section, {}).get(name), getattr(getattr(cfg, section), name)
        if value is None or value == current or (current is not None and not force):
            continue
        cfg = _replace(cfg, section, **{name: value})
        notes.append(f"--use-checkpoint-args: {name} = {value!r} from the checkpoint (command line: {current!r})")
    return cfg, notes


def _loss_scale_flags(cfg: Config, template: dict | None) -> tuple[Config, list[str]]:
    """Megatron-DeepSpeed's get_megatron_optimizer() returns the bare optimizer under --deepspeed before
    it builds Megatron's grad scaler from --loss-scale & co (megatron/optimizer/__init__.py), so those
    flags have no effect there: DeepSpeed's engine scales the loss from the JSON's "fp16" block. Same
    here (the flags are cleared); a flag that would have mattered is named with the value actually used."""
    notes = []
    fp16 = (template or {}).get("fp16") or {}
    for flag, (name, key, ds_default, to_json) in _LOSS_SCALE_FLAGS.items():
        value = getattr(cfg.training, name)
        if value is None:
            continue
        cfg = _replace(cfg, "training", **{name: None})
        if not cfg.training.fp16:
            if flag == "--loss-scale":  # plain Megatron would apply it to bf16 too; DeepSpeed does not
                notes.append(f"{flag} {value:g} has no effect without --fp16 (as in Megatron-DeepSpeed)")
            continue
        used = fp16.get(key, ds_default)
        if isinstance(used, (int, float)) and float(used) == to_json(value):
            continue  # the flag agrees with what DeepSpeed uses: nothing lost
        where = f'DeepSpeed JSON "fp16.{key}" = {used}' if key in fp16 else \
            f'DeepSpeed\'s default "fp16.{key}" = {used}'
        notes.append(f"{flag} {value:g} has no effect with DeepSpeed (as in Megatron-DeepSpeed, whose "
                     f"--deepspeed path never builds Megatron's loss scaler); using {where}. Set it in the "
                     f"JSON's \"fp16\" block instead")
    return cfg, notes


def _json_bf16_over_fp16(cfg: Config, template: dict | None) -> tuple[Config, list[str]]:
    """--fp16 with a JSON that enables bf16 and disables fp16 (Megatron-DeepSpeed's offload example,
    offload_pp/ds_pretrain_gpt_350M.sh, does this): DeepSpeed's engine casts the model to the JSON's
    dtype (deepspeed/runtime/engine.py _configure_distributed_model; with --zero-stage 3 its
    pretrain_gpt.py builds the model inside deepspeed.zero.Init, in that dtype already), so
    Megatron-DeepSpeed trains in bf16. Same here, said once. The reverse, fp16 in
    place of --bf16, could overflow where bf16 does not; it stays a conflict (deepspeed_json)."""
    ds = template or {}
    bf16, fp16 = (ds.get("bf16") or {}).get("enabled"), (ds.get("fp16") or {}).get("enabled")
    if not (cfg.training.fp16 and bf16 is True and fp16 is False):
        return cfg, []
    return _replace(cfg, "training", fp16=False, bf16=True), [
        '--fp16 gives way to the DeepSpeed JSON\'s "bf16": {"enabled": true} with "fp16": {"enabled": false}: '
        'training in bf16 (DeepSpeed casts the model to the JSON\'s dtype, so Megatron-DeepSpeed does too)']


def _disabled_legacy_curriculum(template: dict | None) -> list[str]:
    """A top-level "curriculum_learning" block with "enabled": false (Megatron-DeepSpeed's MoE/curriculum
    templates ship one) changes nothing in Megatron-DeepSpeed, even with --curriculum-learning-legacy (the
    block's "enabled" wins). build_layout takes every legacy block out of the JSON DeepSpeed gets (>= 0.19
    refuses it even disabled) and runs an enabled one itself (config/curriculum.py); this says so once."""
    block = (template or {}).get("curriculum_learning")
    if isinstance(block, dict) and block.get("enabled") is False:
        return ['the DeepSpeed JSON\'s disabled legacy "curriculum_learning" block is dropped (DeepSpeed '
                '>= 0.19 refuses that block even when disabled; it had no effect)']
    return []


def _wandb_missing(cfg: Config) -> list[str]:
    """Megatron-DeepSpeed goes on without W&B when wandb is not installed (megatron/global_vars.py);
    so do we, but --dry-run says so before the queue rather than in the job's log."""
    lg = cfg.logging
    if (lg.wandb_project or lg.wandb_exp_name) and importlib.util.find_spec("wandb") is None:
        return ["--wandb-project/--wandb-name given but the wandb package is not installed (pip install wandb): "
                "the run will not log to W&B"]
    return []


def megatron_overrides(cfg: Config, template: dict | None) -> tuple[Config, dict | None, list[str]]:
    """Megatron-DeepSpeed's silent overrides of the flags ``cfg`` and the DeepSpeed JSON ``template``:
    (new flags, new JSON, one warning per override). The inputs are left as they are."""
    cfg, sequence_parallel = _sequence_parallel_at_tp1(cfg)
    cfg = _old_recompute_flag(cfg)
    cfg, precision = _json_bf16_over_fp16(cfg, template)
    cfg, recompute = _recompute_activations(cfg)
    cfg = _load_tag(cfg)
    cfg, loss_scale = _loss_scale_flags(cfg, template)
    curriculum = _disabled_legacy_curriculum(template)
    return cfg, template, sequence_parallel + precision + recompute + loss_scale + curriculum + _wandb_missing(cfg)
