"""Megatron-DeepSpeed flags accepted, warned or refused with the reason; the DeepSpeed JSON checked by
DeepSpeed's own parser."""
import pytest

from megatron_ds.config import parse_args
from megatron_ds.config.deepspeed_json import validate_with_deepspeed
from megatron_ds.config.megatron_overrides import megatron_overrides
from megatron_ds.data.tokenizer import MockTokenizer, build_tokenizer_for
from megatron_ds.errors import ConfigError


def refused(argv, capsys) -> str:
    with pytest.raises(SystemExit):
        parse_args(argv)
    return capsys.readouterr().err


def test_num_experts_takes_one_value_or_a_list():
    """Megatron-DeepSpeed's --num-experts: type=int, nargs='+', default [1] (megatron/arguments.py); MoE is
    accepted (layer placement and checks: tests/config/test_moe.py)."""
    assert parse_args([])[0].model.num_experts == (1,)
    assert parse_args(["--num-experts", "8"])[0].model.num_experts == (8,)
    assert parse_args(["--num-experts", "64", "128"])[0].model.num_experts == (64, 128)


def test_num_experts_switch_is_refused_naming_deepspeed_moe(capsys):
    assert "--num-experts N --topk 1" in refused(["--num-experts-switch", "8"], capsys)


def test_zero_bubble_flags_are_accepted():
    # the schedule itself: tests/parallel/test_zbh1_schedule.py, tests/pipeline/test_zbh1.py
    par = parse_args(["--enable-zbh1-pipeline", "--enable-zbh1-exact-semantics"])[0].parallel
    assert par.enable_zbh1_pipeline and par.enable_zbh1_exact_semantics


def test_universal_checkpoint_is_accepted():
    # Megatron-DeepSpeed: megatron/arguments.py `--universal-checkpoint` (store_true); loading is
    # tested in tests/checkpoint/test_universal.py
    cfg, _ = parse_args(["--universal-checkpoint", "--load", "ckpt"])
    assert cfg.checkpoint.universal_checkpoint and not parse_args([])[0].checkpoint.universal_checkpoint


def test_old_and_new_spellings():
    cfg, ignored = parse_args(["--activations-checkpoint-method", "uniform", "--activations-checkpoint-num-layers",
                               "2", "--distribute-checkpointed-activations", "--wandb-name", "run1"])
    assert not cfg.training.checkpoint_activations
    cfg, _, _ = megatron_overrides(cfg, None)
    # old Megatron-LM: the method alone turned on full recomputation (transformer.py ran
    # _checkpointed_forward whenever activations_checkpoint_method was set)
    assert cfg.training.checkpoint_activations and cfg.training.recompute_method == "uniform"
    assert cfg.training.recompute_num_layers == 2
    assert ignored == ["--distribute-checkpointed-activations"] and cfg.logging.wandb_exp_name == "run1"
    cfg, _ = parse_args(["--wandb-exp-name", "run2"])  # deepspeedai/Megatron-DeepSpeed's spelling
    assert cfg.logging.wandb_exp_name == "run2"


def test_tokenizer_defaults_to_gpt2_bpe(tmp_path):
    """pretrain_gpt.py in Megatron-DeepSpeed: pretrain(..., args_defaults={'tokenizer_type': 'GPT2BPETokenizer'})."""
    cfg, _ = parse_args(["--vocab-file", str(tmp_path / "missing.json"), "--merge-file", str(tmp_path / "m.txt")])
    with pytest.raises(ConfigError, match="GPT2BPETokenizer"):  # it tried the GPT-2 BPE files
        build_tokenizer_for(cfg.data, log=lambda *a: None)
    cfg, _ = parse_args(["--mock-data"])  # synthetic data alone still needs no tokenizer files
    assert isinstance(build_tokenizer_for(cfg.data, log=lambda *a: None), MockTokenizer)


def _ds(**extra) -> dict:
    return {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, **extra}


@pytest.mark.parametrize("extra,message", [
    ({"zero_optimization": {"stage": 1, "overlap_com": True}}, r"DeepSpeed refuses x.json: .*overlap_com"),
    ({"curriculum_learning": {"enabled": True}},
     r"Legacy top-level 'curriculum_learning' has been removed"),  # resolve takes it out (config/curriculum.py)
    ({"data_efficiency": {"enabled": True, "data_sampling": {"curriculum_learning": {"enabled": True}}}},
     r"needs DeepSpeed's data-efficiency sampler .* use the legacy top-level \"curriculum_learning\" block"),
])
def test_deepspeed_parser_refusals(extra, message):
    with pytest.raises(ConfigError, match=message):
        validate_with_deepspeed(_ds(**extra), "x.json")


def test_deepspeed_parser_accepts_a_merged_config():
    # train_batch_size is left to the layout (it knows DP): 8 != 2 x 2 x world 1 must not be refused here
    validate_with_deepspeed(_ds(zero_optimization={"stage": 1}, bf16={"enabled": True}), "x.json")


def test_deepspeeds_checkpoint_writers_are_refused_other_checkpoint_keys_kept():
    with pytest.raises(ConfigError, match=r'checkpoint.writer .* remove the "writer" block'):
        validate_with_deepspeed(_ds(checkpoint={"writer": {"type": "python", "decoupled": True}}), "x.json")
    validate_with_deepspeed(_ds(checkpoint={"tag_validation": "Warn"}), "x.json")


def test_top_level_keys_deepspeed_ignores_are_refused_with_the_closest_one():
    # DeepSpeed's own parser accepts this JSON and trains without ZeRO: the key is never read
    from megatron_ds.ds_compat import parse_deepspeed_config

    misspelt = _ds(zero_optimisation={"stage": 2})
    assert "zero_optimisation" not in parse_deepspeed_config({**misspelt, "train_batch_size": 4})
    with pytest.raises(ConfigError, match=r"^x.json: DeepSpeed ignores the key 'zero_optimisation' \(did you mean "
                                          r"'zero_optimization'\?\); fix or remove it$"):
        validate_with_deepspeed(misspelt, "x.json")
    with pytest.raises(ConfigError, match=r"ignores the key 'flops_profile' \(did you mean 'flops_profiler'\?\) "
                                          r"\(also unknown: 'zzz'\)"):
        validate_with_deepspeed(_ds(flops_profile={"enabled": False}, zzz=1), "x.json")
    validate_with_deepspeed(_ds(flops_profiler={"enabled": False}, steps_per_print=5, prescale_gradients=False), "x.json")
