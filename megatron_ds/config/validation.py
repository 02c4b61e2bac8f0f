"""Checks of the flags that refuse a run before it starts, each a ``ConfigError`` of one line.

``check_ranges`` runs first, before anything else looks at the values: argparse only checks types,
so ``--lr nan`` and ``--train-iters -5`` parse fine and would fail deep inside torch or as a message
about some other flag; it names the flag, the value and the accepted range. The other checks refuse
combinations (sizes that do not divide, flags that exclude each other); ``build_layout`` calls them
in order, on the resolved model shape and sizes, so every message names the values involved and
the fix.
"""
from __future__ import annotations

import dataclasses
import math

from megatron_ds.config.schema import ModelConfig
from megatron_ds.data.tokenizer import canonical_tokenizer_type, resolved_tokenizer_type
from megatron_ds.errors import ConfigError

# (section, field, lower bound, lower inclusive, upper bound, upper inclusive); None = unbounded.
# Only values that were given (not None) are checked; fields absent from the config are skipped,
# so this table stays valid while other fields come and go.
_RANGES: tuple = (
    ("optimizer", "lr", 0.0, True, None, False),
    ("optimizer", "min_lr", 0.0, True, None, False),
    ("optimizer", "decoupled_lr", 0.0, True, None, False),
    ("optimizer", "decoupled_min_lr", 0.0, True, None, False),
    ("optimizer", "weight_decay", 0.0, True, None, False),
    ("optimizer", "clip_grad", 0.0, True, None, False),
    ("optimizer", "adam_beta1", 0.0, True, 1.0, False),
    ("optimizer", "adam_beta2", 0.0, True, 1.0, False),
    ("optimizer", "adam_eps", 0.0, False, None, False),
    ("optimizer", "sgd_momentum", 0.0, True, None, False),
    ("optimizer", "lr_decay_iters", 1, True, None, False),
    ("optimizer", "lr_decay_samples", 1, True, None, False),
    ("optimizer", "lr_warmup_fraction", 0.0, True, 1.0, True),
    ("optimizer", "lr_warmup_iters", 0, True, None, False),
    ("optimizer", "lr_warmup_samples", 0, True, None, False),
    ("optimizer", "lr_wsd_decay_iters", 0, True, None, False),
    ("optimizer", "lr_wsd_decay_samples", 0, True, None, False),
    ("training", "micro_batch_size", 1, True, None, False),
    ("training", "global_batch_size", 1, True, None, False),
    ("training", "train_iters", 0, True, None, False),
    ("training", "train_samples", 0, True, None, False),
    ("training", "exit_interval", 1, True, None, False),
    ("training", "exit_duration_in_mins", 0.0, False, None, False),
    ("training", "eval_interval", 0, True, None, False),
    ("training", "eval_iters", -1, True, None, False),  # -1: none (Megatron-LM validates with eval_iters > 0)
    ("training", "seed", 0, True, None, False),
    ("training", "recompute_num_layers", 1, True, None, False),
    ("training", "max_consecutive_nan_iters", 1, True, None, False),
    ("training", "loss_scale", 0.0, True, None, False),
    ("training", "initial_loss_scale", 1.0, True, None, False),
    ("training", "min_loss_scale", 0.0, False, None, False),
    ("training", "loss_scale_window", 1, True, None, False),
    ("training", "hysteresis", 1, True, None, False),
    ("model", "num_layers", 1, True, None, False),
    ("model", "hidden_size", 1, True, None, False),
    ("model", "num_attention_heads", 1, True, None, False),
    ("model", "num_key_value_heads", 1, True, None, False),
    ("model", "ffn_hidden_size", 1, True, None, False),
    ("model", "kv_channels", 1, True, None, False),
    ("model", "seq_length", 1, True, None, False),
    ("model", "max_position_embeddings", 1, True, None, False),
    ("model", "hidden_dropout", 0.0, True, 1.0, False),
    ("model", "attention_dropout", 0.0, True, 1.0, False),
    ("model", "init_method_std", 0.0, False, None, False),
    ("model", "layernorm_epsilon", 0.0, False, None, False),
    ("model", "make_vocab_size_divisible_by", 1, True, None, False),
    ("model", "rope_theta", 0.0, False, None, False),
    ("model", "rotary_percent", 0.0, False, 1.0, True),
    ("model", "rope_scaling_factor", 0.0, False, None, False),
    ("model", "rope_scaling_low_freq_factor", 0.0, False, None, False),
    ("model", "rope_scaling_original_max_position_embeddings", 1, True, None, False),
    ("model", "rotary_seq_len_interpolation_factor", 0.0, False, None, False),
    ("model", "expert_interval", 1, True, None, False),  # mixture of experts
    ("model", "topk", 1, True, None, False),
    ("model", "moe_train_capacity_factor", 0.0, False, None, False),
    ("model", "moe_eval_capacity_factor", 0.0, False, None, False),
    ("model", "moe_min_capacity", 0, True, None, False),
    ("model", "moe_loss_coeff", 0.0, True, None, False),
    ("parallel", "moe_expert_parallel_size", 1, True, None, False),
    ("parallel", "tensor_model_parallel_size", 1, True, None, False),
    ("parallel", "pipeline_model_parallel_size", 1, True, None, False),
    ("parallel", "distributed_timeout_minutes", 0.0, False, None, False),
    ("data", "num_workers", 0, True, None, False),
    ("data", "vocab_size", 1, True, None, False),
    ("checkpoint", "save_interval", 1, True, None, False),
    ("checkpoint", "keep_last", 1, True, None, False),
    ("checkpoint", "ckpt_step", 0, True, None, False),
    ("logging", "log_interval", 1, True, None, False),
    ("logging", "straggler_minmax_count", 1, True, None, False),
    ("logging", "straggler_ctrlr_port", 0, True, 65535, True),
    ("training", "manual_gc_interval", 0, True, None, False),
    # BERT / T5 data
    ("masked_lm", "mask_prob", 0.0, True, 1.0, True),
    ("masked_lm", "short_seq_prob", 0.0, True, 1.0, True),
    ("masked_lm", "vocab_extra_ids", 0, True, None, False),
    ("masked_lm", "decoder_seq_length", 1, True, None, False),
)


def flag_name(section_obj, name: str) -> str:
    """The command-line spelling of a config field (its first declared flag)."""
    for f in dataclasses.fields(section_obj):
        if f.name == name:
            flags = f.metadata.get("flags") or ()
            if flags and not f.metadata.get("invert"):
                return flags[0]
    return "--" + name.replace("_", "-")


def _describe(lo, lo_inc, hi, hi_inc) -> str:
    if hi is None:
        return f"{'>=' if lo_inc else '>'} {lo}"
    return f"in {'[' if lo_inc else '('}{lo}, {hi}{']' if hi_inc else ')'}"


def _bad(value, lo, lo_inc, hi, hi_inc) -> bool:
    if isinstance(value, float) and not math.isfinite(value):
        return True
    if lo is not None and (value < lo or (value == lo and not lo_inc)):
        return True
    return hi is not None and (value > hi or (value == hi and not hi_inc))


def range_errors(cfg) -> list[str]:
    """One message per flag whose value is out of range (NaN/inf included)."""
    errors = []
    for section, name, lo, lo_inc, hi, hi_inc in _RANGES:
        obj = getattr(cfg, section, None)
        value = getattr(obj, name, None)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if _bad(value, lo, lo_inc, hi, hi_inc):
            errors.append(f"{flag_name(obj, name)} {value} is out of range: it must be "
                          f"{'a finite number ' if isinstance(value, float) else ''}"
                          f"{_describe(lo, lo_inc, hi, hi_inc)}")
    return errors


def check_ranges(cfg) -> None:
    """Raise ConfigError naming every out-of-range flag."""
    errors = range_errors(cfg)
    if errors:
        raise ConfigError("; ".join(errors))


def missing_flags(cfg, *, with_data: bool = True) -> list[str]:
    """Every flag a run needs that the command line lacks, named at once: pretrain_gpt.py with no
    arguments lists them all rather than stopping at the first (``require`` below, during ``resolve``).
    The tokenizer files follow the tokenizer type (Megatron-DeepSpeed's default: GPT-2 BPE). Under
    --use-checkpoint-args the model's shape may come from the checkpoint (``require`` still stops a
    run whose checkpoint lacks it)."""
    m, t, o, d = cfg.model, cfg.training, cfg.optimizer, cfg.data
    shape = () if cfg.checkpoint.use_checkpoint_args and cfg.checkpoint.load else (
        (m.num_layers, "--num-layers"), (m.hidden_size, "--hidden-size"),
        (m.num_attention_heads, "--num-attention-heads"), (m.seq_length, "--seq-length"))
    missing = [flag for value, flag in (*shape, (t.micro_batch_size, "--micro-batch-size"), (o.lr, "--lr"))
               if value is None]
    if t.train_iters is None and t.train_samples is None and not t.skip_train:
        missing.append("--train-iters (or --train-samples)")
    kind = resolved_tokenizer_type(d)
    default = "" if d.tokenizer_type else ", the default --tokenizer-type"
    if kind == "GPT2BPETokenizer" and not (d.vocab_file and d.merge_file):
        files = " and ".join(f for f, v in (("--vocab-file", d.vocab_file), ("--merge-file", d.merge_file)) if not v)
        missing.append(f"{files} (for {kind}{default})")
    elif canonical_tokenizer_type(kind) in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer",
                                            "HFTokenizer", "TikTokenizer", "Llama3Tokenizer") and not d.tokenizer_model:
        missing.append(f"--tokenizer-model (for {kind})")
    elif kind == "NullTokenizer" and d.vocab_size is None:
        missing.append("--vocab-size (for NullTokenizer)")
    elif kind in ("BertWordPieceLowerCase", "BertWordPieceCase") and not d.vocab_file:
        missing.append(f"--vocab-file (a BERT vocab.txt, for {kind})")
    if with_data and not (d.mock_data or d.data_path or d.train_data_path):
        missing.append("--data-path (or --train-data-path, or --mock-data)")
    return missing


def require(value, flag: str):
    """``value``, which the flag must have given."""
    if value is None:
        raise ConfigError(f"{flag} is required")
    return value


def check_divisible(a: int, b: int, message: str) -> None:
    if b <= 0 or a % b:
        raise ConfigError(message)


def check_parallel_sizes(m: ModelConfig, world_size: int, tp: int, pp: int, sp: int = 1, cp: int = 1) -> None:
    """The world splits into TP x PP x SP x CP x DP, and the model's heads and MLP split over TP;
    under DeepSpeed-Ulysses (SP) each rank attends with 1/(TP x SP) of the (query and key/value) heads.
    The layers need not divide over PP: the partition places them (config/layout.py ``_placement``;
    T5 checks its own split in its ``check``)."""
    if tp < 1 or pp < 1 or sp < 1 or cp < 1 or world_size < 1:
        raise ConfigError(f"sizes must be positive: world {world_size}, TP {tp}, PP {pp}, SP {sp}, CP {cp}")
    axes = [("TP", tp, "--tensor-model-parallel-size"), ("PP", pp, "--pipeline-model-parallel-size")] + \
        [(n, v, f) for n, v, f in (("SP", sp, "--ds-sequence-parallel-size"), ("CP", cp, "--context-parallel-size"))
         if v > 1]
    names, sizes, product = " x ".join(a[0] for a in axes), " x ".join(str(a[1]) for a in axes), tp * pp * sp * cp
    check_divisible(world_size, product,
                    f"world size {world_size} is not divisible by {names} = {sizes} = {product}; "
                    f"launch a multiple of {product} processes or change {'/'.join(a[2] for a in axes)}")
    for heads, flag in ((m.num_attention_heads, "--num-attention-heads"), (m.num_key_value_heads,
                                                                          "--num-key-value-heads")):
        check_divisible(heads, tp, f"{flag} {heads} is not divisible by --tensor-model-parallel-size {tp}; "
                                   f"choose TP dividing the head count")
        # Ulysses scatters whole heads (and, under GQA, whole key/value groups) over the SP ranks
        check_divisible(heads, tp * sp, f"{flag} {heads} is not divisible by TP {tp} x "
                                        f"--ds-sequence-parallel-size {sp}; choose SP dividing {heads} / TP")
    check_divisible(m.num_attention_heads, m.num_key_value_heads,
                    f"--num-attention-heads {m.num_attention_heads} is not a multiple of "
                    f"--num-key-value-heads {m.num_key_value_heads}")
    check_divisible(m.ffn_hidden_size, tp,
                    f"--ffn-hidden-size {m.ffn_hidden_size} is not divisible by "
                    f"--tensor-model-parallel-size {tp}")
    if m.seq_length > m.max_position_embeddings:
        raise ConfigError(f"--seq-length {m.seq_length} exceeds --max-position-embeddings "
                          f"{m.max_position_embeddings}; raise --max-position-embeddings or shorten "
                          f"--seq-length")


def check_precision(t, device_type: str) -> str:
    """"fp16" | "bf16" | "fp32" from --fp16 / --bf16, refusing what cannot run on ``device_type``."""
    if t.fp16 and t.bf16:
        raise ConfigError("--fp16 and --bf16 are both set; choose one")
    if t.fp16 and device_type == "cpu":
        raise ConfigError("--fp16 needs a GPU (DeepSpeed refuses fp16 on the CPU); use --bf16 or fp32 on CPU")
    return "fp16" if t.fp16 else "bf16" if t.bf16 else "fp32"


def check_engine(par, *, pp: int, tp: int, zero_stage: int, seq_length: int) -> None:
    """DeepSpeed's pipeline engine vs its plain one, ZeRO, and Megatron's sequence parallelism."""
    if par.no_pipeline_parallel and pp > 1:
        raise ConfigError(f"--no-pipeline-parallel needs --pipeline-model-parallel-size 1 (got {pp})")
    if zero_stage >= 2 and not par.no_pipeline_parallel:
        raise ConfigError(f"ZeRO stage {zero_stage} cannot be combined with DeepSpeed's pipeline engine "
                          f"(PP = {pp}); use --zero-stage 0 or 1, or --no-pipeline-parallel with PP = 1")
    if par.sequence_parallel and tp == 1:
        raise ConfigError("--sequence-parallel needs --tensor-model-parallel-size > 1")
    if par.sequence_parallel and seq_length % tp:
        raise ConfigError(f"--sequence-parallel needs --seq-length {seq_length} divisible by TP {tp}")
    check_ulysses(par, seq_length)


def check_ulysses(par, seq_length: int) -> None:
    """DeepSpeed-Ulysses runs where Megatron-DeepSpeed runs it: on the plain engine (DeepSpeed's pipeline
    topology has no sequence axis; upstream's example passes --no-pipeline-parallel), never with Megatron's
    --sequence-parallel (megatron/initialize.py raises), with every sequence split evenly."""
    sp = par.ds_sequence_parallel_size
    if sp == 1:
        return
    if not par.no_pipeline_parallel:
        raise ConfigError(f"--ds-sequence-parallel-size {sp} runs on DeepSpeed's plain engine, whose pipeline "
                          f"topology has no sequence axis; add --no-pipeline-parallel (PP 1)")
    if par.sequence_parallel:
        raise ConfigError(f"--ds-sequence-parallel-size {sp} (DeepSpeed-Ulysses) cannot be combined with Megatron's "
                          f"--sequence-parallel (as in Megatron-DeepSpeed); drop --sequence-parallel")
    if seq_length % sp:
        raise ConfigError(f"--seq-length {seq_length} is not divisible by --ds-sequence-parallel-size {sp}")


def check_fp32_residual(m, precision: str) -> None:
    """--fp32-residual-connection keeps the residual stream of a half-precision model in fp32; in an
    fp32 run there is nothing to keep, and Megatron-DeepSpeed refuses it too (megatron/arguments.py:
    "residual connection in fp32 only supported when using fp16 or bf16")."""
    if m.fp32_residual_connection and precision == "fp32":
        raise ConfigError("--fp32-residual-connection keeps the residual stream of an --fp16 or --bf16 model "
                          "in fp32; pass --bf16 or --fp16, or drop it")


def check_learning_rate(o) -> None:
    require(o.lr, "--lr")
    if o.override_lr_scheduler and o.use_checkpoint_lr_scheduler:
        raise ConfigError("--override-lr-scheduler and --use-checkpoint-lr-scheduler are both set; choose one")
    if o.min_lr > o.lr:
        raise ConfigError(f"--min-lr {o.min_lr} is above --lr {o.lr}")
    if o.decoupled_lr is not None:
        floor, name = (o.min_lr, "--min-lr") if o.decoupled_min_lr is None else (o.decoupled_min_lr, "--decoupled-min-lr")
        if floor > o.decoupled_lr:
            raise ConfigError(f"{name} {floor} is above --decoupled-lr {o.decoupled_lr} (the embedding and output "
                              f"layer's LR decays from --decoupled-lr to --decoupled-min-lr, default --min-lr)")


def check_per_token_loss(t, m, sp: int) -> None:
    """--calculate-per-token-loss scales the language-model loss itself (model/token_loss.py); the MoE
    auxiliary loss added to it and DeepSpeed-Ulysses' shards are not normalised that way here."""
    if not t.calculate_per_token_loss:
        return
    if any(n > 1 for n in (m.num_experts or (1,))):
        raise ConfigError("--calculate-per-token-loss with --num-experts > 1 is not supported: the MoE auxiliary "
                          "loss would be scaled by the global batch's token count; drop one of them")
    if sp > 1:
        raise ConfigError(f"--calculate-per-token-loss with --ds-sequence-parallel-size {sp} is not supported; "
                          "drop one of them")


def check_activation(m) -> None:
    """One MLP activation. Megatron-DeepSpeed's ParallelMLP takes the first of --openai-gelu, --swiglu,
    --squared-relu (and with --openai-gelu --swiglu builds an MLP whose shapes do not fit), so a second
    one is refused rather than silently dropped (T5's --relu and --geglu are ours)."""
    chosen = [f for f, on in (("--openai-gelu", m.openai_gelu), ("--swiglu", m.swiglu),
                              ("--squared-relu", m.squared_relu), ("--relu", m.relu), ("--geglu", m.geglu)) if on]
    if len(chosen) > 1:
        raise ConfigError(f"{' and '.join(chosen)} each choose the MLP's activation; pass one")


def check_weight_decay(o) -> None:
    """megatron/arguments.py validate_args: a constant style takes --weight-decay and neither bound; the
    others need both (OptimizerParamScheduler asserts 0 <= start <= end)."""
    bounds = (o.start_weight_decay, o.end_weight_decay)
    if o.weight_decay_incr_style == "constant":
        if bounds != (None, None):
            raise ConfigError("--start-weight-decay/--end-weight-decay need --weight-decay-incr-style linear or "
                              "cosine (constant uses --weight-decay)")
        return
    if None in bounds:
        raise ConfigError(f"--weight-decay-incr-style {o.weight_decay_incr_style} needs both --start-weight-decay "
                          f"and --end-weight-decay")
    if not 0 <= bounds[0] <= bounds[1]:
        raise ConfigError(f"--start-weight-decay {bounds[0]} and --end-weight-decay {bounds[1]}: need "
                          f"0 <= start <= end (weight decay only increases, as in Megatron)")


def check_data(d) -> None:
    if d.data_impl in ("lazy", "cached"):
        raise ConfigError(f"--data-impl {d.data_impl} is not supported; preprocess with the mmap format "
                          f"(tools/preprocess_data.py) and use --data-impl mmap")
    if d.train_data_exact_num_epochs is not None:
        if d.train_data_exact_num_epochs < 1:
            raise ConfigError(f"--train-data-exact-num-epochs must be at least 1 (got {d.train_data_exact_num_epochs})")
        if d.mock_data:
            raise ConfigError("--train-data-exact-num-epochs needs --data-path (--mock-data has no epochs)")


def check_profile(lg) -> None:
    """--profile's steps `FIRST,LAST` (1 <= FIRST <= LAST), integer ranks, and a --tensorboard-dir for the traces."""
    if lg.profile is None:
        return
    if lg.tensorboard_dir is None:
        raise ConfigError(f"--profile {lg.profile} writes its traces to --tensorboard-dir; pass one")
    if lg.profile == "window":
        if not 0 <= lg.profile_step_start < lg.profile_step_end:
            raise ConfigError(f"--profile-step-start {lg.profile_step_start} --profile-step-end {lg.profile_step_end}: "
                              f"expected 0 <= start < end")
        return
    steps = lg.profile_steps.split(",")
    if len(steps) != 2 or not all(v.strip().isdigit() for v in steps) or not 1 <= int(steps[0]) <= int(steps[1]):
        raise ConfigError(f"--profile_steps {lg.profile_steps}: expected FIRST,LAST with 1 <= FIRST <= LAST")
    bad = [r for r in lg.profile_ranks or () if not r.isdigit()]
    if bad:
        raise ConfigError(f"--profile-ranks {' '.join(bad)}: expected global rank numbers")


def check_async_save(ckpt, template: dict | None) -> list[str]:
    """--async-save and --use-persistent-ckpt-worker (Megatron-LM's): the notes to print; a DeepSpeed
    JSON that picks another checkpoint engine (DataStates, itself asynchronous) is refused, since the
    background save writes through megatron_ds's own."""
    if ckpt.async_save and (template or {}).get("datastates_ckpt") not in (None, False):
        raise ConfigError("--async-save writes checkpoints through megatron_ds's background writer; the DeepSpeed "
                          "JSON's \"datastates_ckpt\" block picks DataStates' checkpoint engine instead: drop one")
    if ckpt.use_persistent_ckpt_worker and not ckpt.async_save:
        return ["--use-persistent-ckpt-worker has no effect without --async-save (as in Megatron-LM)"]
    return []


def check_context_parallel(flags, *, cp: int, seq_length: int, moe: str | None, curriculum: bool) -> str:
    """--context-parallel-size N (parallel/context_parallel.py): Megatron-LM's conditions (megatron/training/
    arguments.py: ``seq_length % (2 * context_parallel_size) == 0``; a2a+p2p needs the hierarchical sizes)
    and what is not built with it here (``moe``: the MoE layer the line builds, "megatron", "deepspeed" or None).
    Returns the attention's communication, "p2p" or "all_gather"."""
    par = flags.parallel
    kinds = set(par.cp_comm_type or ("p2p",))  # Megatron-LM's default: ["p2p"]
    if cp < 1:
        raise ConfigError(f"--context-parallel-size must be positive, got {cp}")
    if cp == 1:
        return "p2p"
    if seq_length % (2 * cp):
        raise ConfigError(f"--seq-length {seq_length} is not a multiple of 2 x --context-parallel-size {cp} "
                          f"(each sequence splits into {2 * cp} equal chunks)")
    refusals = {
        "--cp-comm-type a2a (all-to-all over heads is DeepSpeed-Ulysses here: use --ds-sequence-parallel-size N "
        "instead of --context-parallel-size)": "a2a" in kinds,
        "--cp-comm-type a2a+p2p / --hierarchical-context-parallel-sizes (hierarchical context parallelism is not "
        "built; use --cp-comm-type p2p)": "a2a+p2p" in kinds or bool(par.hierarchical_context_parallel_sizes),
        "different --cp-comm-type values per layer (one kind runs in every layer here)": len(kinds) > 1,
        "--ds-sequence-parallel-size > 1 (DeepSpeed-Ulysses and context parallelism split the same sequence; "
        "choose one)": par.ds_sequence_parallel_size > 1,
        "DeepSpeed-MoE layers (Megatron-DeepSpeed's --num-experts with its MoE flags; Megatron-LM's MoE layer runs "
        "with context parallelism)": moe == "deepspeed",
        "a sequence-length warm-up (curriculum learning cuts sequences below 2 x CP chunks)": curriculum,
    }
    refused = [what for what, on in refusals.items() if on]
    if refused:
        raise ConfigError(f"--context-parallel-size {cp} is not supported with {refused[0]}")
    return kinds.pop()
