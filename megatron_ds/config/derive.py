"""Everything derived from the config and the world size, in one pure function.

``derive(cfg, world_size, ...)`` validates the combination and returns a ``Layout``: parallel sizes,
micro-batches per step, the padded vocabulary, the resolved model shape, parameter counts per
stage and the DeepSpeed JSON. It touches no process group, file or device, so
``pretrain_gpt.py --dry-run`` and the tests can run it anywhere; every rejection is a
``ConfigError`` whose one-line message names the values involved and the fix.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field

from megatron_ds.config.run_schedule import RunSchedule, ScheduleError, build_run_schedule
from megatron_ds.config.checks import check_ranges
from megatron_ds.config.schema import Config, ModelConfig
from megatron_ds.parallel.schedules import ScheduleError as PipelineScheduleError, check_schedule, describe_assignment, virtual_pipeline_size
from megatron_ds.parallel.utils import pad_vocab_size


class ConfigError(ValueError):
    """A user-facing configuration problem; the message is meant to be printed as is."""


def _need(value, flag: str):
    if value is None:
        raise ConfigError(f"{flag} is required")
    return value


def resolve_model_config(m: ModelConfig) -> ModelConfig:
    """A copy of the model config with every optional shape filled in, as Megatron resolves them."""
    _need(m.num_layers, "--num-layers")
    h = _need(m.hidden_size, "--hidden-size")
    heads = _need(m.num_attention_heads, "--num-attention-heads")
    seq = _need(m.seq_length, "--seq-length")
    pos_type = m.position_embedding_type
    if m.use_rotary_position_embeddings:
        pos_type = "rope"
    elif m.no_position_embedding and pos_type == "learned_absolute":
        pos_type = "none"
    ffn = m.ffn_hidden_size
    if ffn is None:
        # SwiGLU has three matrices instead of two; 2/3 keeps the parameter count of a 4h GeLU MLP.
        ffn = int(4 * h * 2 / 3 / 64) * 64 if m.swiglu else 4 * h
    if m.kv_channels is None and h % heads:
        raise ConfigError(f"--hidden-size {h} is not divisible by --num-attention-heads {heads}; "
                          f"change one of them or pass --kv-channels")
    return dataclasses.replace(
        m,
        num_key_value_heads=m.num_key_value_heads or heads,
        ffn_hidden_size=ffn,
        kv_channels=m.kv_channels or h // heads,
        max_position_embeddings=m.max_position_embeddings or seq,
        position_embedding_type=pos_type,
        use_rotary_position_embeddings=pos_type == "rope",
        normalization=m.normalization.lower(),
    )


@dataclass(frozen=True)
class StageParams:
    stage: int
    layers: tuple[int, int]  # [first, last) transformer layer indices
    params_per_tp_rank: int


@dataclass(frozen=True)
class Layout:
    world_size: int
    tp: int
    pp: int
    virtual_pp: int  # model chunks per pipeline rank (> 1: interleaved 1F1B schedule)
    dp: int
    micro_batch_size: int
    global_batch_size: int
    grad_accum_steps: int  # micro-batches per optimizer step on each data parallel rank
    train_iters: int
    lr_decay_iters: int
    lr_warmup_iters: int
    run: RunSchedule  # ramp-up, token target, LR spans in samples/tokens
    notes: tuple[str, ...]  # Megatron-DeepSpeed overrides applied here too, printed once as warnings
    vocab_size: int
    padded_vocab_size: int
    precision: str  # "fp32" | "fp16" | "bf16"
    zero_stage: int
    use_pipeline: bool
    recompute: str | None  # None | "full" | "selective"
    model: ModelConfig
    total_params: int
    stages: tuple[StageParams, ...]
    ds_config: dict = field(hash=False)

    def _engine_name(self) -> str:
        if self.virtual_pp > 1:
            return "interleaved pipeline schedule on the plain engine"
        return "pipeline engine" if self.use_pipeline else "plain engine"

    def summary(self) -> str:
        m = self.model
        lines = [
            f"world size {self.world_size} = TP {self.tp} x PP {self.pp} x DP {self.dp}"
            f" ({self._engine_name()}, ZeRO {self.zero_stage},"
            f" {self.precision})",
            f"batch: micro {self.micro_batch_size} x DP {self.dp} x {self.grad_accum_steps} micro-batches"
            f" per step = global {self.global_batch_size}; {self.train_iters} iterations",
            f"model: {m.num_layers} layers, hidden {m.hidden_size}, heads {m.num_attention_heads}"
            f" (kv {m.num_key_value_heads}), ffn {m.ffn_hidden_size}, seq {m.seq_length},"
            f" positions {m.position_embedding_type}, {m.normalization},"
            f" {'swiglu' if m.swiglu else 'gelu'}, vocab {self.vocab_size} padded to {self.padded_vocab_size}",
            f"parameters: {self.total_params / 1e6:,.1f}M total",
        ]
        r = self.run
        if r.rampup is not None:
            lines.insert(2, f"batch ramp-up: global {r.rampup.start} + {r.rampup.increment} every "
                            f"{r.rampup.samples_per_increment:,.0f} samples up to {r.rampup.final} after "
                            f"{r.rampup.samples:,} samples")
        if r.train_tokens is not None:
            lines.insert(2, f"train until {r.train_tokens:,} tokens ({self.train_iters} iterations at most)")
        for s in self.stages:
            layers = "" if self.virtual_pp > 1 else f" layers {s.layers[0]}-{s.layers[1] - 1},"
            lines.append(f"  stage {s.stage}:{layers}"
                         f" {s.params_per_tp_rank / 1e6:,.1f}M parameters per tensor parallel rank")
        if self.pp > 1:
            schedule = describe_assignment(m.num_layers, self.pp, self.virtual_pp, self.grad_accum_steps)
            # without interleaving, DeepSpeed's --pipeline-partition-method places the layers (above)
            lines += schedule if self.virtual_pp > 1 else [schedule[0], schedule[-1]]
        return "\n".join(lines)


def _layer_params(m: ModelConfig, tp: int) -> tuple[int, int]:
    """(parameters split over TP, parameters replicated on each TP rank) of one transformer layer."""
    h, d, bias = m.hidden_size, m.kv_channels, m.add_bias_linear
    q, kv = m.num_attention_heads * d, m.num_key_value_heads * d
    ffn_in = 2 * m.ffn_hidden_size if m.swiglu else m.ffn_hidden_size
    split = h * (q + 2 * kv) + q * h + h * ffn_in + m.ffn_hidden_size * h
    if bias:
        split += (q + 2 * kv) + ffn_in
    norm = 2 * h if m.normalization == "layernorm" else h
    replicated = 2 * norm + (2 * h if bias else 0)  # two norms; row-parallel biases are not split
    return split // tp, replicated


def count_parameters(m: ModelConfig, padded_vocab: int, tp: int, pp: int) -> tuple[int, tuple[StageParams, ...]]:
    """Analytic parameter count: (unique total, per-stage count on one TP rank)."""
    h, n = m.hidden_size, m.num_layers
    split, repl = _layer_params(m, tp)
    emb = padded_vocab * h // tp
    pos = m.max_position_embeddings * h if m.position_embedding_type == "learned_absolute" else 0
    final_norm = 2 * h if m.normalization == "layernorm" else h
    tied = not m.untie_embeddings_and_output_weights
    per = n // pp
    stages = []
    for s in range(pp):
        p = per * (split + repl)
        if s == 0:
            p += emb + pos
        if s == pp - 1:
            p += final_norm
            # the tied output layer keeps its own copy of the word embeddings when it is on another stage
            p += emb if (not tied or pp > 1) else 0
        stages.append(StageParams(s, (s * per, (s + 1) * per), p))
    total = n * (split * tp + repl) + emb * tp + pos + final_norm + (0 if tied else emb * tp)
    return total, tuple(stages)


def _json_conflict(name: str, json_value, flag: str, cli_value) -> ConfigError:
    return ConfigError(f"DeepSpeed JSON {name} = {json_value} contradicts {flag}: {cli_value}; "
                       f"remove it from the JSON (the command line owns it) or change the flag")


def guards_optimizer(precision: str, zero_stage: int) -> bool:
    """DeepSpeed's plain fp32 path (no ZeRO, no bf16/fp16 optimizer) neither skips non-finite steps
    nor reports the pre-clip norm; there training.optimizer.GuardedOptimizer clips and skips, and
    DeepSpeed must not clip too."""
    return precision == "fp32" and zero_stage == 0


def build_ds_config(cfg: Config, template: dict | None, *, micro: int, global_batch: int, gas: int,
                    precision: str, zero_stage: int, notes: list | None = None) -> dict:
    """Merge the user's DeepSpeed JSON with what the command line owns, rejecting contradictions.
    A stale batch size / accumulation count in the JSON loses to the command line with a note, as in
    Megatron-DeepSpeed, whose train loop calls engine.set_train_batch_size(DP x micro x micro-batches)
    before every step (megatron/training.py train); a different micro-batch size would really break."""
    ds = copy.deepcopy(template or {})
    for key, value, flag in (("train_batch_size", global_batch, "--global-batch-size"),
                             ("train_micro_batch_size_per_gpu", micro, "--micro-batch-size"),
                             ("gradient_accumulation_steps", gas, "global/(micro x DP)")):
        if ds.get(key, "auto") not in ("auto", value):
            if key == "train_micro_batch_size_per_gpu" or notes is None:
                raise _json_conflict(key, ds[key], flag, value)
            notes.append(f"DeepSpeed JSON {key} = {ds[key]} is overridden by {flag}: {value} "
                         f"(the command line sets the engine's batch, as in Megatron-DeepSpeed)")
        ds[key] = value
    for name in ("fp16", "bf16"):
        block = ds.get(name) or {}
        enabled = block.get("enabled", "auto")
        want = precision == name
        if enabled != "auto" and bool(enabled) != want:
            cli = {"fp16": "--fp16", "bf16": "--bf16", "fp32": "fp32 (neither --fp16 nor --bf16)"}[precision]
            raise _json_conflict(f'"{name}.enabled"', enabled, "the precision flag", cli)
        block["enabled"] = want
        ds[name] = block
    zero = ds.setdefault("zero_optimization", {})
    if zero.get("stage", zero_stage) != zero_stage:
        raise _json_conflict('"zero_optimization.stage"', zero["stage"], "--zero-stage", zero_stage)
    zero["stage"] = zero_stage
    if "optimizer" in ds or "scheduler" in ds:
        raise ConfigError('the DeepSpeed JSON has an "optimizer"/"scheduler" block, but the command line '
                          'owns them (--lr, --lr-decay-style, --adam-beta1 ...); remove the block')
    if ds.get("gradient_clipping", cfg.optimizer.clip_grad) != cfg.optimizer.clip_grad:
        raise _json_conflict("gradient_clipping", ds["gradient_clipping"], "--clip-grad", cfg.optimizer.clip_grad)
    ds["gradient_clipping"] = cfg.optimizer.clip_grad
    if guards_optimizer(precision, zero_stage):
        ds["gradient_clipping"] = 0.0  # our optimizer guard clips instead (see guards_optimizer)
    # DeepSpeed's pipeline partitions activations over TP ranks assuming they are replicated; under
    # sequence parallelism they are already split (and differ per rank), so that must be off.
    sp = cfg.parallel.sequence_parallel
    ds.setdefault("pipeline", {}).update(pipe_partitioned=not sp, grad_partitioned=not sp)
    ds.setdefault("steps_per_print", 10 ** 9)  # we print Megatron's iteration line ourselves
    ds.setdefault("wall_clock_breakdown", False)
    return ds


def _check_divisible(a: int, b: int, message: str) -> None:
    if b <= 0 or a % b:
        raise ConfigError(message)


def _virtual_pp(par, num_layers: int, pp: int, micro_batches: int) -> int:
    """Model chunks per pipeline rank, refusing what the interleaved schedule cannot run."""
    try:
        v = virtual_pipeline_size(num_layers, pp, par.num_layers_per_virtual_pipeline_stage,
                                  par.virtual_pipeline_model_parallel_size)
        check_schedule(pp, micro_batches, v)
    except PipelineScheduleError as exc:
        raise ConfigError(str(exc)) from None
    if v > 1 and par.no_pipeline_parallel:
        raise ConfigError("--no-pipeline-parallel cannot run the interleaved pipeline schedule; drop one of them")
    return v


def derive(cfg: Config, world_size: int, *, vocab_size: int, ds_template: dict | None = None,
           device_type: str = "cuda") -> Layout:
    """Validate ``cfg`` for ``world_size`` processes and compute everything that follows from it."""
    check_ranges(cfg)  # out-of-range numbers by flag name, before any check below reads them
    par, t, o = cfg.parallel, cfg.training, cfg.optimizer
    m = resolve_model_config(cfg.model)
    tp, pp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    if tp < 1 or pp < 1 or world_size < 1:
        raise ConfigError(f"sizes must be positive: world {world_size}, TP {tp}, PP {pp}")
    _check_divisible(world_size, tp * pp,
                     f"world size {world_size} is not divisible by TP x PP = {tp} x {pp} = {tp * pp}; "
                     f"launch a multiple of {tp * pp} processes or change "
                     f"--tensor-model-parallel-size/--pipeline-model-parallel-size")
    dp = world_size // (tp * pp)
    _check_divisible(m.num_attention_heads, tp,
                     f"--num-attention-heads {m.num_attention_heads} is not divisible by "
                     f"--tensor-model-parallel-size {tp}; choose TP dividing the head count")
    _check_divisible(m.num_key_value_heads, tp,
                     f"--num-key-value-heads {m.num_key_value_heads} is not divisible by "
                     f"--tensor-model-parallel-size {tp}; choose TP dividing the KV head count")
    _check_divisible(m.num_attention_heads, m.num_key_value_heads,
                     f"--num-attention-heads {m.num_attention_heads} is not a multiple of "
                     f"--num-key-value-heads {m.num_key_value_heads}")
    _check_divisible(m.num_layers, pp,
                     f"--num-layers {m.num_layers} is not divisible by --pipeline-model-parallel-size "
                     f"{pp}; choose PP dividing the layer count")
    _check_divisible(m.ffn_hidden_size, tp,
                     f"--ffn-hidden-size {m.ffn_hidden_size} is not divisible by "
                     f"--tensor-model-parallel-size {tp}")
    if m.seq_length > m.max_position_embeddings:
        raise ConfigError(f"--seq-length {m.seq_length} exceeds --max-position-embeddings "
                          f"{m.max_position_embeddings}; raise --max-position-embeddings or shorten "
                          f"--seq-length")
    micro = _need(t.micro_batch_size, "--micro-batch-size")
    global_batch = t.global_batch_size or micro * dp
    _check_divisible(global_batch, micro * dp,
                     f"--global-batch-size {global_batch} is not divisible by --micro-batch-size "
                     f"{micro} x DP {dp} = {micro * dp}; use a multiple of {micro * dp}")
    gas = global_batch // (micro * dp)
    virtual_pp = _virtual_pp(par, m.num_layers, pp, gas)

    if t.fp16 and t.bf16:
        raise ConfigError("--fp16 and --bf16 are both set; choose one")
    if t.fp16 and device_type == "cpu":
        raise ConfigError("--fp16 needs a GPU (no fp16 loss scaling on CPU); use --bf16 or fp32 on CPU")
    precision = "fp16" if t.fp16 else "bf16" if t.bf16 else "fp32"

    template_stage = ((ds_template or {}).get("zero_optimization") or {}).get("stage")
    zero_stage = cfg.deepspeed.zero_stage if cfg.deepspeed.zero_stage is not None else (template_stage or 0)
    use_pipeline = not par.no_pipeline_parallel
    if par.no_pipeline_parallel and pp > 1:
        raise ConfigError(f"--no-pipeline-parallel needs --pipeline-model-parallel-size 1 (got {pp})")
    if zero_stage >= 2 and use_pipeline:
        raise ConfigError(f"ZeRO stage {zero_stage} cannot be combined with DeepSpeed's pipeline engine "
                          f"(PP = {pp}); use --zero-stage 0 or 1, or --no-pipeline-parallel with PP = 1")
    if par.sequence_parallel and tp == 1:
        raise ConfigError("--sequence-parallel needs --tensor-model-parallel-size > 1")
    if par.sequence_parallel and m.seq_length % tp:
        raise ConfigError(f"--sequence-parallel needs --seq-length {m.seq_length} divisible by TP {tp}")

    if t.train_iters is not None and t.train_samples is not None:
        raise ConfigError("--train-iters and --train-samples are both set; choose one")
    if t.train_samples is not None:
        train_iters = t.train_samples // global_batch
        decay = (o.lr_decay_samples or t.train_samples) // global_batch
        warmup_abs = o.lr_warmup_samples // global_batch
    else:
        train_iters = t.train_iters if t.train_iters is not None else (0 if t.skip_train else None)
        train_iters = _need(train_iters, "--train-iters (or --train-samples)")
        decay = o.lr_decay_iters or train_iters
        warmup_abs = o.lr_warmup_iters
    if o.lr_warmup_fraction is not None and warmup_abs:
        raise ConfigError("--lr-warmup-fraction and --lr-warmup-iters/--lr-warmup-samples are both set; "
                          "choose one")
    warmup = int(o.lr_warmup_fraction * decay) if o.lr_warmup_fraction is not None else warmup_abs
    try:
        run = build_run_schedule(t, o, seq_length=m.seq_length, global_batch=global_batch, micro_dp=micro * dp)
    except ScheduleError as exc:
        raise ConfigError(str(exc)) from None
    if run.rampup is not None:
        if virtual_pp > 1:
            # The interleaved schedule needs micro-batches per step to be a multiple of PP at every
            # step (Megatron asserts the same); a ramp changes that count from step to step.
            raise ConfigError("--rampup-batch-size cannot be combined with the interleaved pipeline schedule "
                              "(--num-layers-per-virtual-pipeline-stage); drop one of them")
        train_iters = run.train_iters_for_samples(t.train_samples)
    _need(o.lr, "--lr")
    if o.override_lr_scheduler and o.use_checkpoint_lr_scheduler:
        raise ConfigError("--override-lr-scheduler and --use-checkpoint-lr-scheduler are both set; choose one")
    if o.min_lr > o.lr:
        raise ConfigError(f"--min-lr {o.min_lr} is above --lr {o.lr}")

    d = cfg.data
    if d.data_impl in ("lazy", "cached"):
        raise ConfigError(f"--data-impl {d.data_impl} is not supported; preprocess with the mmap format "
                          f"(tools/preprocess_data.py) and use --data-impl mmap")

    recompute = t.recompute_granularity or ("full" if (t.checkpoint_activations
                                                        or t.deepspeed_activation_checkpointing) else None)
    padded = pad_vocab_size(vocab_size, m.make_vocab_size_divisible_by, tp)
    total, stages = count_parameters(m, padded, tp, pp)
    notes: list[str] = []
    ds = build_ds_config(cfg, ds_template, micro=micro, global_batch=global_batch, gas=gas,
                         precision=precision, zero_stage=zero_stage, notes=notes)
    return Layout(world_size=world_size, tp=tp, pp=pp, virtual_pp=virtual_pp, dp=dp, micro_batch_size=micro,
                  global_batch_size=global_batch, grad_accum_steps=gas, train_iters=train_iters,
                  lr_decay_iters=decay, lr_warmup_iters=warmup, run=run, notes=tuple(notes), vocab_size=vocab_size,
                  padded_vocab_size=padded, precision=precision, zero_stage=zero_stage,
                  use_pipeline=use_pipeline, recompute=recompute, model=m, total_params=total,
                  stages=stages, ds_config=ds)
