"""Which of the two command-line dialects a run's flags are read in, and what Megatron-LM's data parallel
flags make of DeepSpeed's engine.

A Megatron-DeepSpeed command line names DeepSpeed (``--deepspeed``, ``--deepspeed_config``): its ZeRO comes
from the JSON and --zero-stage, and Megatron-LM's data parallel flags are not read there (Megatron-DeepSpeed's
DeepSpeed path never builds Megatron's distributed optimizer). An upstream Megatron-LM command line names
no DeepSpeed at all: the engine's configuration is derived from its flags (NVIDIA/Megatron-LM core_v0.19.0,
megatron/training/arguments.py): --use-distributed-optimizer shards the optimizer state over the data
parallel ranks (ZeRO 1, fp32 main weights and gradients as Megatron keeps them), --use-megatron-fsdp shards
what --data-parallel-sharding-strategy names (ZeRO 0-3), --overlap-grad-reduce / --overlap-param-gather
overlap the collectives (DeepSpeed's "overlap_comm"), --ddp-bucket-size sizes the reduction buckets, and
with --bf16 gradients accumulate and reduce in fp32 unless --grad-reduce-in-bf16 (``gradient_data_types``).
"""
from __future__ import annotations

import copy

from megatron_ds.config.schema import Config
from megatron_ds.errors import ConfigError

MEGATRON_DEEPSPEED, MEGATRON_LM = "Megatron-DeepSpeed", "Megatron-LM"

# --data-parallel-sharding-strategy -> the ZeRO stage that shards the same
FSDP_STAGES = {"no_shard": 0, "optim": 1, "optim_grads": 2, "optim_grads_params": 3}


def dialect(flags: Config) -> tuple[str, str]:
    """(the dialect the flags are read in, why), for --dry-run."""
    if flags.deepspeed.deepspeed or flags.deepspeed.deepspeed_config:
        return MEGATRON_DEEPSPEED, "the command line names DeepSpeed (--deepspeed / --deepspeed_config)"
    return MEGATRON_LM, "the command line names no DeepSpeed (--deepspeed / --deepspeed_config): the engine comes from its flags"


def _data_parallel_flags(flags: Config) -> list[str]:
    d = flags.deepspeed
    return [flag for flag, given in (("--use-distributed-optimizer", d.use_distributed_optimizer),
                                     ("--use-megatron-fsdp", d.use_megatron_fsdp),
                                     ("--overlap-grad-reduce", d.overlap_grad_reduce),
                                     ("--overlap-param-gather", d.overlap_param_gather),
                                     ("--ddp-bucket-size", d.ddp_bucket_size is not None)) if given]


def zero_stage(flags: Config, template_stage: int | None, notes: list[str]) -> int:
    """The run's ZeRO stage: --zero-stage, else the JSON's, else what Megatron-LM's flags ask for, else 0."""
    d = flags.deepspeed
    named = d.zero_stage if d.zero_stage is not None else template_stage
    if dialect(flags)[0] == MEGATRON_DEEPSPEED:
        if _data_parallel_flags(flags):
            notes.append(f"{', '.join(_data_parallel_flags(flags))}: Megatron-LM's data parallel flags, not read on a "
                         f"Megatron-DeepSpeed command line (it names DeepSpeed); ZeRO comes from --zero-stage and the JSON")
        return named or 0
    if d.use_megatron_fsdp:
        strategy = d.data_parallel_sharding_strategy or "optim_grads_params"
        wanted, why = FSDP_STAGES[strategy], f"--use-megatron-fsdp --data-parallel-sharding-strategy {strategy}"
    elif d.data_parallel_sharding_strategy is not None:
        raise ConfigError(f"--data-parallel-sharding-strategy {d.data_parallel_sharding_strategy} is read only with "
                          f"--use-megatron-fsdp; add it, or use --zero-stage")
    elif d.use_distributed_optimizer:
        wanted, why = 1, "--use-distributed-optimizer"
    else:
        return named or 0
    if named is None:
        notes.append(f"ZeRO stage {wanted}: {why} (Megatron-LM's sharding, as DeepSpeed ZeRO)")
        return wanted
    # the distributed optimizer shards at least the optimizer state (ZeRO >= 1); FSDP's strategy names one stage
    conflict = named != wanted if d.use_megatron_fsdp else named < wanted
    if conflict:
        raise ConfigError(f"{why} shards as ZeRO stage {wanted}, but --zero-stage / the DeepSpeed JSON says {named}; "
                          f"drop one of them")
    return named


def apply_data_parallel_flags(flags: Config, ds: dict, *, use_pipeline: bool, notes: list[str]) -> None:
    """Megatron-LM's overlap and bucket flags into the merged DeepSpeed JSON ``ds`` (a Megatron-LM command line
    only; a value the JSON sets otherwise is a conflict)."""
    d = flags.deepspeed
    if dialect(flags)[0] == MEGATRON_DEEPSPEED:
        return
    zero = ds.setdefault("zero_optimization", {})
    wanted = {}
    if d.overlap_grad_reduce or d.overlap_param_gather:
        wanted["overlap_comm"] = True
        if use_pipeline:  # deepspeed/runtime/engine.py _configure_zero_optimizer turns it off there
            notes.append("--overlap-grad-reduce/--overlap-param-gather: DeepSpeed's pipeline engine does not overlap "
                         "ZeRO's collectives; they run after the backward pass (the same values)")
    if d.ddp_bucket_size is not None:
        wanted["reduce_bucket_size"] = d.ddp_bucket_size
    for key, value in wanted.items():
        if zero.get(key, value) != value:
            raise ConfigError(f'the DeepSpeed JSON\'s "zero_optimization.{key}" is {zero[key]!r}, but the Megatron-LM '
                              f'flags ask for {value!r}; drop one of them')
        zero[key] = value


_BF16_NAMES = ("bf16", "bfloat16")
BF16_GRADS = {"data_types": {"grad_accum_dtype": "bf16"}, "communication_data_type": "bf16"}
FP32_GRADS = {"data_types": {"grad_accum_dtype": "fp32"}, "communication_data_type": "fp32"}


def _with(template: dict | None, keys: dict) -> dict:
    out = copy.deepcopy(template or {})
    out.setdefault("data_types", {}).update(keys.get("data_types", {}))
    out["communication_data_type"] = keys["communication_data_type"]
    return out


def gradient_data_types(flags: Config, template: dict | None, *, precision: str, zero_stage: int,
                        notes: list[str]) -> dict | None:
    """The DeepSpeed JSON template with the gradients' accumulation and reduction dtype of the run's dialect.

    Megatron-LM (megatron/training/arguments.py validate_args, core_v0.19.0): with --bf16 gradients accumulate
    and all-reduce in fp32 (``accumulate_allreduce_grads_in_fp32``, DistributedDataParallelConfig
    ``grad_reduce_in_fp32``) unless --grad-reduce-in-bf16; read only with --bf16. DeepSpeed 0.19 accumulates as
    "data_types": {"grad_accum_dtype"} says (default the weights' dtype; runtime/engine.py
    _do_optimizer_sanity_check: fp32 with bf16 weights is BF16_Optimizer at ZeRO 1 and the ZeRO optimizers'
    fp32 buffers at ZeRO 2/3, and unsupported without ZeRO) and reduces in "communication_data_type" (default
    bf16 under bf16, even BF16_Optimizer's fp32 gradients are cast to it). A DeepSpeed JSON decides for itself
    (Megatron-DeepSpeed's DeepSpeed path, whose arguments.py has no --grad-reduce-in-bf16); the flag must agree
    with it. Without a JSON a Megatron-DeepSpeed command line keeps DeepSpeed's defaults."""
    bf16_reduce = flags.deepspeed.grad_reduce_in_bf16
    if precision != "bf16":
        if bf16_reduce:
            notes.append("--grad-reduce-in-bf16 has no effect without --bf16 (Megatron-LM reads it only with --bf16)")
        return template
    if template is not None:
        if not bf16_reduce:
            return template
        for key, value in (("data_types.grad_accum_dtype", (template.get("data_types") or {}).get("grad_accum_dtype")),
                           ("communication_data_type", template.get("communication_data_type"))):
            if value is not None and str(value).lower() not in _BF16_NAMES:
                raise ConfigError(f'--grad-reduce-in-bf16 asks for bf16 gradients, but the DeepSpeed JSON\'s "{key}" is '
                                  f'{value!r}; drop one of them')
        return _with(template, BF16_GRADS)
    if bf16_reduce:
        return _with(None, BF16_GRADS)
    if dialect(flags)[0] == MEGATRON_DEEPSPEED:
        return None
    if zero_stage == 0:
        notes.append("--bf16 without ZeRO: gradients accumulate over micro-batches in bf16 (DeepSpeed accumulates "
                     "them in fp32 only with ZeRO, e.g. --use-distributed-optimizer) and are all-reduced in fp32 "
                     "(Megatron-LM: both fp32)")
        return _with(None, {"communication_data_type": "fp32"})
    return _with(None, FP32_GRADS)
