"""resolve(): every rejection by its message, and the derived values against hand computation."""
import pytest

from megatron_ds.config import parse_args, resolve, resolve_model_config
from megatron_ds.config.megatron_overrides import megatron_overrides
from megatron_ds.errors import ConfigError
from megatron_ds.families.gpt.gpt_family import GPT
from megatron_ds.families.gpt.gpt_params import count_gpt_parameters
from megatron_ds.parallel.utils import pad_vocab_size

BASE = ("--num-layers 4 --hidden-size 64 --num-attention-heads 8 --seq-length 32 --micro-batch-size 2 "
        "--train-iters 10 --lr 1e-3").split()


def make(*extra, world=1, vocab=1000, template=None, device="cpu"):
    """The Run of BASE + extra."""
    cfg, _ = parse_args(BASE + list(extra))
    return resolve(cfg, world_size=world, vocab_size=vocab, ds_template=template, device_type=device, family=GPT)


def rejects(match, *extra, **kw):
    with pytest.raises(ConfigError, match=match):
        make(*extra, **kw)


def test_world_not_divisible_by_tp_pp():
    rejects(r"world size 6 is not divisible by TP x PP = 2 x 2 = 4", "--tensor-model-parallel-size", "2",
            "--pipeline-model-parallel-size", "2", world=6)


def test_heads_not_divisible_by_tp():
    rejects(r"--num-attention-heads 8 is not divisible by --tensor-model-parallel-size 3",
            "--tensor-model-parallel-size", "3", world=3)


def test_kv_heads_not_divisible_by_tp():
    rejects(r"--num-key-value-heads 2 is not divisible by --tensor-model-parallel-size 4",
            "--num-key-value-heads", "2", "--tensor-model-parallel-size", "4", world=4)


def test_pipeline_stage_without_layers():
    # 4 transformer layers, embedding, final norm and output layer over 8 stages by "uniform": one each
    rejects(r"pipeline stage 7 of PP 8 would hold no layer", "--pipeline-model-parallel-size", "8",
            "--pipeline-partition-method", "uniform", world=8)


def test_global_batch_not_divisible():
    rejects(r"--global-batch-size 6 is not divisible by --micro-batch-size 2 x DP 2 = 4",
            "--global-batch-size", "6", world=2)


def test_seq_length_above_positions():
    rejects(r"--seq-length 32 exceeds --max-position-embeddings 16", "--max-position-embeddings", "16")


def test_zero2_with_pipeline():
    rejects(r"ZeRO stage 2 cannot be combined with DeepSpeed's pipeline engine", "--zero-stage", "2",
            "--pipeline-model-parallel-size", "2", world=2)


def test_zero3_allowed_without_pipeline():
    layout = make("--zero-stage", "3", "--no-pipeline-parallel", world=2).layout
    assert layout.ds_config["zero_optimization"]["stage"] == 3 and not layout.use_pipeline


def test_json_train_batch_size_loses_to_the_command_line_with_a_note():
    # Megatron-DeepSpeed calls engine.set_train_batch_size(DP x micro x micro-batches) before every step
    # (megatron/training.py train), so a stale JSON train_batch_size has no effect there either.
    run = make("--global-batch-size", "4", template={"train_batch_size": 64, "gradient_accumulation_steps": 7})
    assert run.layout.ds_config["train_batch_size"] == 4 and run.layout.ds_config["gradient_accumulation_steps"] == 2
    assert any("train_batch_size = 64 is overridden by --global-batch-size: 4" in n for n in run.notes)
    assert any("gradient_accumulation_steps = 7 is overridden" in n for n in run.notes)


def test_json_micro_batch_conflict():
    rejects(r"train_micro_batch_size_per_gpu = 8 contradicts --micro-batch-size: 2",
            template={"train_micro_batch_size_per_gpu": 8})


def test_json_fp16_block_vs_bf16():
    rejects(r'"fp16.enabled" = True contradicts the precision flag: --bf16', "--bf16", template={"fp16": {"enabled": True}})


def test_json_bf16_block_vs_fp32():
    rejects(r'"bf16.enabled" = True contradicts the precision flag: fp32 \(neither', template={"bf16": {"enabled": True}})


def test_json_zero_stage_conflict():
    rejects(r'"zero_optimization.stage" = 2 contradicts --zero-stage: 1', "--zero-stage", "1",
            template={"zero_optimization": {"stage": 2}})


def test_fp16_on_cpu():
    rejects(r"--fp16 needs a GPU", "--fp16", device="cpu")


def test_other_rejections():
    rejects(r"--fp16 and --bf16 are both set", "--fp16", "--bf16", device="cuda")
    rejects(r"--no-pipeline-parallel needs --pipeline-model-parallel-size 1", "--no-pipeline-parallel",
            "--pipeline-model-parallel-size", "2", world=2)
    rejects(r'"optimizer"/"scheduler" block', template={"optimizer": {"type": "Adam"}})
    rejects(r"--data-impl lazy is not supported", "--data-impl", "lazy")


def test_missing_required():
    cfg, _ = parse_args(["--num-layers", "2"])
    with pytest.raises(ConfigError, match="--hidden-size is required"):
        resolve(cfg, world_size=1, vocab_size=10, family=GPT)


def test_derived_values():
    layout = make("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                  "--global-batch-size", "16", "--lr-warmup-fraction", "0.1", "--lr-decay-iters", "50",
                  world=8, vocab=50257, template={"zero_optimization": {"stage": 1, "reduce_bucket_size": 5}}).layout
    assert (layout.tp, layout.pp, layout.dp) == (2, 2, 2)
    assert layout.grad_accum_steps == 16 // (2 * 2)
    assert layout.padded_vocab_size == 50432  # next multiple of 128 * 2 above 50257
    assert layout.lr_warmup_iters == 5 and layout.lr_decay_iters == 50
    ds = layout.ds_config
    assert ds["train_batch_size"] == 16 and ds["train_micro_batch_size_per_gpu"] == 2
    assert ds["gradient_accumulation_steps"] == 4
    assert ds["zero_optimization"] == {"stage": 1, "reduce_bucket_size": 5}  # JSON knobs kept
    assert ds["bf16"]["enabled"] is False and ds["fp16"]["enabled"] is False


def test_fp16_loss_scale_knobs_come_from_the_json_only():
    # Megatron-DeepSpeed's get_megatron_optimizer() returns before building its grad scaler under
    # --deepspeed (megatron/optimizer/__init__.py), so --loss-scale & co have no effect; DeepSpeed's
    # engine reads the JSON's fp16 block (its own defaults fill the rest).
    template = {"fp16": {"enabled": "auto", "loss_scale_window": 500}}
    run = make("--fp16", "--loss-scale", "4096", "--loss-scale-window", "100", template=template, device="cuda")
    notes = run.notes
    assert run.layout.ds_config["fp16"] == {"enabled": True, "loss_scale_window": 500}
    assert any('--loss-scale 4096 has no effect with DeepSpeed' in n and 'default "fp16.loss_scale" = 0' in n
               for n in notes)
    assert any('--loss-scale-window 100' in n and 'JSON "fp16.loss_scale_window" = 500' in n for n in notes)
    cfg, _ = parse_args(BASE + ["--bf16", "--loss-scale", "12"])  # universal_checkpointing/run_bf16.sh
    assert megatron_overrides(cfg, None)[2] == [
        "--loss-scale 12 has no effect without --fp16 (as in Megatron-DeepSpeed)"]


def test_sequence_parallel_turns_off_pipeline_partitioning():
    # DeepSpeed's pipe/grad partitioning assumes TP ranks hold the same activation
    sp = make("--tensor-model-parallel-size", "2", "--sequence-parallel", world=2).layout.ds_config["pipeline"]
    plain = make("--tensor-model-parallel-size", "2", world=2).layout.ds_config["pipeline"]
    assert sp == {"pipe_partitioned": False, "grad_partitioned": False}
    assert plain == {"pipe_partitioned": True, "grad_partitioned": True}


def test_pad_vocab_size():
    assert pad_vocab_size(50257, 128, 1) == 50304
    assert pad_vocab_size(37, 4, 4) == 48
    assert pad_vocab_size(48, 4, 4) == 48


def test_resolve_swiglu_and_rope():
    cfg, _ = parse_args(BASE + ["--swiglu", "--use-rotary-position-embeddings", "--normalization", "RMSNorm"])
    m = resolve_model_config(cfg.model)
    assert m.ffn_hidden_size == int(4 * 64 * 2 / 3 / 64) * 64 == 128
    assert m.position_embedding_type == "rope" and m.normalization == "rmsnorm"
    assert m.num_key_value_heads == 8 and m.kv_channels == 8 and m.max_position_embeddings == 32


def _count_by_hand(h, layers, vocab, seq, ffn):
    # GPT-2: per layer 12h^2 + 13h (qkv 3h^2+3h, proj h^2+h, fc 4h^2+4h... with ffn = 4h), embeddings, final LN
    per_layer = (3 * h * h + 3 * h) + (h * h + h) + (h * ffn + ffn) + (ffn * h + h) + 4 * h
    return layers * per_layer + vocab * h + seq * h + 2 * h


def test_parameter_count_gpt2_small():
    cfg, _ = parse_args("--num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024 "
                        "--micro-batch-size 1 --train-iters 1 --lr 1".split())
    m = resolve_model_config(cfg.model)
    total, stages = count_gpt_parameters(m, 50304, 1, 1)
    assert total == _count_by_hand(768, 12, 50304, 1024, 3072)
    assert abs(total - 124.4e6) < 0.5e6  # the published GPT-2 small size (with the padded vocab)
    assert stages[0].params_per_tp_rank == total


def test_parameter_count_split_over_tp_pp():
    cfg, _ = parse_args(BASE)
    m = resolve_model_config(cfg.model)
    total, _ = count_gpt_parameters(m, 1024, 1, 1)
    _, stages = count_gpt_parameters(m, 1024, 2, 2)
    h = 64
    # each TP rank holds half of every split matrix; norms and row-parallel biases are replicated;
    # the last stage holds a copy of the tied word embeddings.
    replicated_per_layer = 4 * h + 2 * h
    split_per_layer = (_count_by_hand(h, 1, 0, 0, 4 * h) - 2 * h - replicated_per_layer)
    stage0 = 2 * (split_per_layer // 2 + replicated_per_layer) + 1024 * h // 2 + 32 * h
    stage1 = 2 * (split_per_layer // 2 + replicated_per_layer) + 2 * h + 1024 * h // 2
    assert [s.params_per_tp_rank for s in stages] == [stage0, stage1]
    assert total == 4 * (split_per_layer + replicated_per_layer) + 1024 * h + 32 * h + 2 * h


def test_sequence_parallel_at_tp1_is_turned_off_with_a_note():
    # Megatron-DeepSpeed's validate_args: "if args.tensor_model_parallel_size == 1: args.sequence_parallel = False"
    cfg, _ = parse_args(BASE + ["--sequence-parallel"])
    overridden, _, notes = megatron_overrides(cfg, None)
    assert overridden.parallel.sequence_parallel is False and "--sequence-parallel is turned off" in notes[0]
    assert cfg.parallel.sequence_parallel is True  # a new value: the parsed flags stay as given
    assert make("--sequence-parallel").layout.sequence_parallel is False
    cfg, _ = parse_args(BASE + ["--sequence-parallel", "--tensor-model-parallel-size", "2"])
    overridden, _, notes = megatron_overrides(cfg, None)
    assert notes == [] and overridden == cfg and overridden.parallel.sequence_parallel is True


def test_rampup_with_interleaving_refused():
    # BASE trains by iterations; ramp-up needs --train-samples (Megatron's rule), so swap them.
    cfg, _ = parse_args([a for a in BASE if a not in ("--train-iters", "10")] + [
        "--train-samples", "640", "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
        "--global-batch-size", "8", "--rampup-batch-size", "4", "4", "64"])
    with pytest.raises(ConfigError, match="--rampup-batch-size cannot be combined with the interleaved"):
        resolve(cfg, world_size=2, vocab_size=1000, family=GPT)


def test_run_is_frozen_and_the_flags_are_never_edited():
    import dataclasses

    cfg, _ = parse_args(BASE + ["--sequence-parallel", "--activations-checkpoint-method", "uniform",
                                "--fp16", "--loss-scale", "8"])
    before = cfg.to_dict()
    run = resolve(cfg, world_size=1, vocab_size=1000, device_type="cuda", family=GPT)
    assert cfg.to_dict() == before  # the overrides made new values
    # ... which the run records (what a checkpoint saves) and reads
    assert run.record["parallel"]["sequence_parallel"] is False and run.record["training"]["loss_scale"] is None
    assert run.layout.recompute == "full" and not run.layout.sequence_parallel
    for obj, name in ((run, "layout"), (run.layout, "tp"), (run.training, "seed"), (cfg.training, "seed")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, name, 1)


ULYSSES = ["--no-pipeline-parallel", "--ds-sequence-parallel-size"]


def test_ulysses_layout():
    """world 8 = TP 2 x SP 2 x DP 2: the data parallel size (and so the batch) counts sequences, not ranks."""
    layout = make("--tensor-model-parallel-size", "2", *ULYSSES, "2", "--global-batch-size", "8", world=8).layout
    assert (layout.tp, layout.pp, layout.sp, layout.dp) == (2, 1, 2, 2)
    assert layout.grad_accum_steps == 2  # 8 / (micro 2 x DP 2)
    assert "TP 2 x PP 1 x SP 2 (DeepSpeed-Ulysses) x DP 2" in layout.summary()


@pytest.mark.parametrize("extra,world,match", [
    (["--ds-sequence-parallel-size", "2"], 2, r"runs on DeepSpeed's plain engine.*add --no-pipeline-parallel"),
    (["--pipeline-model-parallel-size", "2", "--ds-sequence-parallel-size", "2"], 4, r"add --no-pipeline-parallel"),
    ([*ULYSSES, "2", "--tensor-model-parallel-size", "2", "--sequence-parallel"], 4,
     r"cannot be combined with Megatron's --sequence-parallel"),
    # 8 heads over TP 2 x SP 8; GQA: 2 key/value groups cannot go to 4 ranks
    ([*ULYSSES, "8", "--tensor-model-parallel-size", "2"], 16,
     r"--num-attention-heads 8 is not divisible by TP 2 x --ds-sequence-parallel-size 8"),
    ([*ULYSSES, "4", "--num-key-value-heads", "2"], 4,
     r"--num-key-value-heads 2 is not divisible by TP 1 x --ds-sequence-parallel-size 4"),
    ([*ULYSSES, "2", "--seq-length", "31", "--max-position-embeddings", "32"], 2,
     r"--seq-length 31 is not divisible by --ds-sequence-parallel-size 2"),
    ([*ULYSSES, "2"], 3, r"world size 3 is not divisible by TP x PP x SP = 1 x 1 x 2 = 2"),
])
def test_ulysses_refusals(extra, world, match):
    rejects(match, *extra, world=world)
