"""One resolution: the parsed flags -> ``Run``, the only object training, checkpointing and the tools read.

``resolve(flags, world_size=..., vocab_size=...)`` range-checks the flags, applies Megatron-DeepSpeed's
overrides (new values, nothing edited in place), computes the ``Layout`` and keeps, per concern, the
settings the run reads afterwards. A ``Run`` is frozen and complete: no field is still None where a
flag was required, and nothing derived sits beside the flag it was derived from (the batch sizes,
iterations, precision, recompute and model shape are the layout's; the sections hold what nothing
derives from). ``pretrain_gpt.py --dry-run`` prints it (``describe``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from megatron_ds.config.deepspeed_json import load_ds_template
from megatron_ds.config.family import ModelFamily
from megatron_ds.config.layout import Layout, build_layout
from megatron_ds.config.megatron_overrides import apply_checkpoint_args, megatron_overrides
from megatron_ds.config.memory import choose_fused_loss, gpu_memory_bytes
from megatron_ds.config.schema import CheckpointConfig, Config, DataConfig, LoggingConfig, MaskedLMDataConfig
from megatron_ds.config.validation import check_async_save, check_ranges
from megatron_ds.data.tokenizer import resolved_tokenizer_type

FROM_FLAGS = object()
"""``resolve``'s default DeepSpeed JSON: the file --deepspeed_config names (None without it)."""


@dataclass(frozen=True)
class TrainingSettings:
    """The loop's own settings: what TrainingConfig holds besides batch sizes, iterations, precision
    and recompute (those are the layout's)."""
    seed: int
    eval_interval: int
    eval_iters: int
    skip_train: bool
    exit_interval: int | None
    exit_duration_in_mins: float | None
    exit_signal_handler: bool
    max_consecutive_nan_iters: int
    empty_unused_memory_level: int
    kill_switch_file: str | None  # save and exit when this file exists
    data_parallel_random_init: bool  # a seed per data parallel rank
    manual_gc: bool  # Python's garbage collection by hand, at the same points on every rank
    manual_gc_interval: int
    manual_gc_eval: bool
    calculate_per_token_loss: bool = False  # the loss is the global batch's token mean (model/token_loss.py)


@dataclass(frozen=True)
class OptimizerSettings:
    """The optimizer and the LR schedule's shape (its spans are the layout's, in iterations, and the
    schedule's, in samples / tokens)."""
    optimizer: str
    lr: float
    min_lr: float
    lr_decay_style: str
    weight_decay: float
    start_weight_decay: float | None  # with weight_decay_incr_style linear/cosine
    end_weight_decay: float | None
    weight_decay_incr_style: str
    clip_grad: float
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    sgd_momentum: float
    override_lr_scheduler: bool
    use_checkpoint_lr_scheduler: bool
    cpu_optimizer: bool  # DeepSpeedCPUAdam (torch.optim.AdamW with cpu_torch_adam) for ZeRO-Offload
    cpu_torch_adam: bool
    create_moe_param_group: bool = False  # expert parameters in optimizer groups of their own
    decoupled_lr: float | None = None  # embedding and output layer's peak LR (Megatron-LM); None: --lr
    decoupled_min_lr: float | None = None  # their floor; None: --min-lr
    lr_wsd_decay_style: str = "exponential"  # WSD's decay shape (its span is the schedule's)


@dataclass(frozen=True)
class DistributedSettings:
    """How the processes talk (the sizes are the layout's)."""
    distributed_backend: str | None
    distributed_timeout_minutes: float
    pipeline_partition_method: str


@dataclass(frozen=True)
class Run:
    """Everything one training run reads, resolved once (see the module docstring)."""
    layout: Layout
    training: TrainingSettings
    optimizer: OptimizerSettings
    distributed: DistributedSettings
    data: DataConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    deepspeed_source: str  # where the DeepSpeed JSON came from, for messages
    notes: tuple[str, ...]  # Megatron-DeepSpeed overrides and JSON values the command line won: warnings
    ignored_flags: tuple[str, ...]  # accepted for compatibility, no effect here
    # The flags as Megatron-DeepSpeed reads them (after its overrides), saved with every checkpoint
    # and given to W&B; nothing reads a setting from it.
    record: dict = field(hash=False, compare=False, repr=False)
    # BERT / T5 samples (--mask-prob, --short-seq-prob, --vocab-extra-ids, --decoder-seq-length)
    masked_lm: MaskedLMDataConfig = field(default_factory=MaskedLMDataConfig)
    # why layout.model.liger_kernel is what it is (memory.choose_fused_loss), for the start-up line
    fused_loss_reason: str = ""

    def describe(self) -> str:
        """The layout, then every section (what ``--dry-run`` prints)."""
        lay = self.layout
        chunk = f", {lay.recompute_num_layers} layer(s) per chunk" if lay.recompute == "full" else ""
        lines = [lay.summary(), f"(Megatron) sequence parallel: {'on' if lay.sequence_parallel else 'off'}; "
                                f"recompute: {lay.recompute or 'none'}{chunk}; transformer layers: "
                                f"{'compiled' if lay.model.compile_layers else 'eager'}"]
        for name in ("training", "optimizer", "distributed", "data", "checkpoint", "logging"):
            section = getattr(self, name)
            values = [(f.name, getattr(section, f.name)) for f in dataclasses.fields(section)]
            # unset options (None) and switches left off are not worth a line's width
            lines.append(f"{name}: " + ", ".join(f"{k} {v!r}" for k, v in values if v is not None and v is not False))
        return "\n".join(lines)


def _settings(cls, section):
    """``cls`` filled from the same-named fields of a flags section."""
    return cls(**{f.name: getattr(section, f.name) for f in dataclasses.fields(cls)})


def resolve(flags: Config, *, world_size: int, vocab_size: int, family: ModelFamily, device_type: str = "cuda",
            ds_template=FROM_FLAGS, ignored: tuple[str, ...] | list[str] = (), saved_flags: dict | None = None,
            gpu_memory: float | None = None) -> Run:
    """The ``Run`` of the parsed ``flags`` on ``world_size`` processes with a tokenizer of ``vocab_size``
    ids; ``device_type`` "cpu" refuses what needs a GPU. ``ds_template``: the DeepSpeed JSON as a dict
    (default: read from --deepspeed_config). ``saved_flags``: the --load checkpoint's record, for
    --use-checkpoint-args. ``family``: the model family (the entry point's: pretrain_bert.py gives
    BERT's). ``gpu_memory``: bytes of the GPU the run trains on (default:
    --gpu-memory-gb, else ``memory.ASSUMED_GPU``), which decides the output layer's loss kernel where
    no flag does. Pure: no process group, device or DeepSpeed import."""
    template = load_ds_template(flags.deepspeed.deepspeed_config) if ds_template is FROM_FLAGS else ds_template
    flags, checkpoint_notes = apply_checkpoint_args(flags, saved_flags)
    check_ranges(flags)  # out-of-range numbers by flag name, before any check below reads them
    if flags.training.eval_iters < 0:  # Megatron-LM's --eval-iters -1: no validation (do_valid = eval_iters > 0)
        flags = dataclasses.replace(flags, training=dataclasses.replace(flags.training, eval_iters=0))
    # the tokenizer the run trains with, recorded in every checkpoint: the default one by its name too
    flags = dataclasses.replace(flags, data=dataclasses.replace(flags.data,
                                                                tokenizer_type=resolved_tokenizer_type(flags.data)))
    flags, template, notes = megatron_overrides(flags, template)
    notes = checkpoint_notes + notes + check_async_save(flags.checkpoint, template)
    layout, json_notes = build_layout(flags, world_size, vocab_size=vocab_size, template=template,
                                      device_type=device_type, family=family)
    fused, fused_why = choose_fused_loss(layout, gpu_memory or gpu_memory_bytes(flags.gpu_memory_gb))
    layout = dataclasses.replace(layout, model=dataclasses.replace(layout.model, liger_kernel=fused))
    # the partition the layout counted (Megatron-LM's uneven-stage flags resolve to "layers:...")
    distributed = dataclasses.replace(_settings(DistributedSettings, flags.parallel), pipeline_partition_method=(
        layout.pipeline_partition or flags.parallel.pipeline_partition_method))
    return Run(layout=layout, training=_settings(TrainingSettings, flags.training),
               optimizer=_settings(OptimizerSettings, flags.optimizer), distributed=distributed, data=flags.data,
               checkpoint=flags.checkpoint, logging=flags.logging,
               deepspeed_source=flags.deepspeed.deepspeed_config or "the DeepSpeed config",
               notes=tuple(notes + json_notes), ignored_flags=tuple(sorted(set(ignored))), record=flags.to_dict(),
               masked_lm=flags.masked_lm, fused_loss_reason=fused_why)
