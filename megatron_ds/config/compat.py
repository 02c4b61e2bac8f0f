"""What Megatron-DeepSpeed silently overrides or ignores, done the same way here but said once.

A launch script that works with Megatron-DeepSpeed must not be refused for a flag that has no effect
there; it must not be silently reinterpreted either. ``megatron_overrides`` applies Megatron-DeepSpeed's
own overrides to a freshly parsed config (in place) and returns one warning per override, naming the
values involved. Everything here is a pure function of the flags and the DeepSpeed JSON.
"""
from __future__ import annotations

from megatron_ds.config.schema import Config

# flag -> (TrainingConfig field, key in the JSON's "fp16" block, DeepSpeed's default for that key)
_LOSS_SCALE_FLAGS = {
    "--loss-scale": ("loss_scale", "loss_scale", 0),  # 0 = dynamic
    "--initial-loss-scale": ("initial_loss_scale", "initial_scale_power", 16),
    "--min-loss-scale": ("min_loss_scale", "min_loss_scale", 1),
    "--loss-scale-window": ("loss_scale_window", "loss_scale_window", 1000),
    "--hysteresis": ("hysteresis", "hysteresis", 2),
}


def _sequence_parallel_at_tp1(cfg: Config) -> list[str]:
    # megatron/arguments.py validate_args: "disable sequence parallelism when tp=1 to avoid change in
    # numerics when sequence_parallelism is enabled" -- it sets args.sequence_parallel = False.
    if cfg.parallel.sequence_parallel and cfg.parallel.tensor_model_parallel_size == 1:
        cfg.parallel.sequence_parallel = False
        return ["--sequence-parallel is turned off: --tensor-model-parallel-size is 1 (Megatron-DeepSpeed "
                "does the same; sequence parallelism splits activations across tensor parallel ranks)"]
    return []


def _loss_scale_flags(cfg: Config, template: dict | None) -> list[str]:
    """Megatron-DeepSpeed's get_megatron_optimizer() returns the bare optimizer under --deepspeed before
    it builds Megatron's grad scaler from --loss-scale & co (megatron/optimizer/__init__.py), so those
    flags have no effect there: DeepSpeed's engine scales the loss from the JSON's "fp16" block. Same
    here; a flag that would have mattered is named with the value actually used."""
    notes = []
    fp16 = (template or {}).get("fp16") or {}
    for flag, (name, key, ds_default) in _LOSS_SCALE_FLAGS.items():
        value = getattr(cfg.training, name)
        if value is None:
            continue
        setattr(cfg.training, name, None)
        if not cfg.training.fp16:
            notes.append(f"{flag} {value:g} has no effect without --fp16 (as in Megatron-DeepSpeed)")
            continue
        used = f'DeepSpeed JSON "fp16.{key}" = {fp16[key]}' if key in fp16 else \
            f'DeepSpeed\'s default "fp16.{key}" = {ds_default}'
        notes.append(f"{flag} {value:g} has no effect with DeepSpeed (as in Megatron-DeepSpeed, whose "
                     f"--deepspeed path never builds Megatron's loss scaler); using {used}. Set it in the "
                     f"JSON's \"fp16\" block instead")
    return notes


def megatron_overrides(cfg: Config, template: dict | None) -> list[str]:
    """Apply Megatron-DeepSpeed's silent overrides to ``cfg`` in place; returns the warnings."""
    return _sequence_parallel_at_tp1(cfg) + _loss_scale_flags(cfg, template)
