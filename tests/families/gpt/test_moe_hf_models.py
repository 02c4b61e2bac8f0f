"""Hugging Face MoE classes both ways on Megatron-LM's MoE layer (``families/gpt/moe_hf.py``): Mixtral (top-2,
renormalized), Qwen2-MoE (shared expert with its sigmoid gate, norm_topk_prob false = --moe-router-pre-softmax,
q/k/v biases, a dense layer by decoder_sparse_step), Qwen3-MoE (per-head q/k norms, norm_topk_prob true, a
dense layer by mlp_only_layers), OLMoE (q/k norms over the whole projections, norm_topk_prob false, a router
z-loss coefficient), DeepSeek-V3 (sigmoid scores with a random e_score_correction_bias, group-limited
top-k, scaling, a shared expert, first_k_dense_replace) and DeepSeek-V2 (softmax top-k probabilities,
group_limited_greedy, YaRN). Tiny random transformers models built here. Qwen3-MoE's and DeepSeek-V3's configs
carry a router_z_loss_coef too (not their classes' field: transformers keeps it), which must come back as
--moe-z-loss-coeff and leave again on export, as OLMoE's.

- import (from_hf's import_hf): our logits equal transformers' at every position; the printed flags, parsed as
  pretrain_gpt.py parses them, give the imported model config (Megatron-LM's MoE flags);
- export (to_hf) of the imported checkpoint: transformers loads the same class with the same MoE config fields
  and the same tensors (bitwise), hence the same logits;
- Qwen2-MoE's, DeepSeek-V3's and OLMoE's imported checkpoints train 3 steps at TP 2 with the losses of one process
  (OLMoE's: its q/k norm weights split over TP from the TP 1 checkpoint, their statistic summed over TP);
- fields without an equivalent (OLMoE's clip_qkv) are refused in one line;
- group-limited routing itself: tests/model/test_mlm_moe_groups.py.

Logits: fp32 both, the same routing (the same fp32 softmax over the same logits: a different choice of expert
would move a logit by ~1e-1), other summation orders: atol 1e-5 as tests/families/gpt/test_hf_models.py.
"""
import shlex

import pytest
import torch

from tests.distributed import run_distributed
from tests.training.common import train_losses

transformers = pytest.importorskip("transformers")
from megatron_ds.cli import to_hf  # noqa: E402
from megatron_ds.errors import ConfigError  # noqa: E402
from megatron_ds.families.gpt.gpt_family import GPT  # noqa: E402
from megatron_ds.families.gpt.gpt_hf_import import import_hf  # noqa: E402
from tests.config.test_moe import dry_run  # noqa: E402
from tests.families.gpt.test_hf_models import _ours, _printed_flags, hf_import_cache  # noqa: E402

LOGIT_TOL = dict(rtol=1e-5, atol=1e-5)
VOCAB, SEQ = 128, 16
_SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=SEQ, rms_norm_eps=1e-6, initializer_range=0.2,
              tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
_YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0,
             beta_slow=1.0, mscale=0.707, mscale_all_dim=0.707)
MODELS = {
    "mixtral": lambda: transformers.MixtralConfig(**_SMALL, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        **_SMALL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=40,
        norm_topk_prob=False, decoder_sparse_step=2, router_aux_loss_coef=0.01),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **_SMALL, head_dim=16, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=16, norm_topk_prob=True,
        mlp_only_layers=[0], router_z_loss_coef=0.002),  # (not a Qwen3MoeConfig field: kept, written back)
    # group-limited (4 groups of 2, top 2 groups: k / topk_group = 2, transformers' and Megatron-LM's group score
    # agree), sigmoid scores with a random e_score_correction_bias, scaled by 2.5, one shared expert, a dense layer
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **{**_SMALL, "num_key_value_heads": 4}, q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=6, n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2,
        first_k_dense_replace=1, n_shared_experts=1, moe_intermediate_size=16, routed_scaling_factor=2.5,
        router_z_loss_coef=0.003),
    # softmax probabilities as they are (--moe-router-pre-softmax), group_limited_greedy (a group scored by its
    # largest probability: Megatron-LM's top k / group_topk = 1), two shared experts, no query latent, YaRN as
    # DeepSeek-V2-Lite's (tests/families/gpt/test_deepseek_hf.py)
    "deepseek_v2": lambda: transformers.DeepseekV2Config(
        **{**_SMALL, "num_key_value_heads": 4, "rope_parameters": _YARN}, q_lora_rank=None, kv_lora_rank=12,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=6, n_routed_experts=8, num_experts_per_tok=3,
        topk_method="group_limited_greedy", n_group=4, topk_group=3, first_k_dense_replace=1, n_shared_experts=2,
        moe_intermediate_size=12, routed_scaling_factor=1.5),
    # q/k norms over the whole projections (k: 2 kv heads x 8), top 3 of 6 not renormalized, with a z-loss
    "olmoe": lambda: transformers.OlmoeConfig(
        **_SMALL, num_experts=6, num_experts_per_tok=3, norm_topk_prob=False, router_aux_loss_coef=0.02,
        router_z_loss_coef=0.001),
}
CLASSES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
           "deepseek_v3": "DeepseekV3ForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM", "olmoe": "OlmoeForCausalLM"}
FLAGS = {"mixtral": ["--num-experts 4", "--moe-router-topk 2", "--moe-ffn-hidden-size 48"],
         "qwen2_moe": ["--moe-router-pre-softmax", "--moe-shared-expert-intermediate-size 40",
                       "--moe-shared-expert-gate",
                       "--moe-layer-freq '[0,1]'", "--add-qkv-bias", "--moe-aux-loss-coeff 0.01"],
         "qwen3_moe": ["--num-experts 8", "--moe-router-topk 3", "--qk-layernorm", "--moe-layer-freq '[0,1]'",
                       "--kv-channels 16", "--moe-z-loss-coeff 0.002"],
         "deepseek_v3": ["--multi-latent-attention", "--moe-router-score-function sigmoid",
                         "--moe-router-enable-expert-bias", "--moe-router-num-groups 4", "--moe-router-group-topk 2",
                         "--moe-router-topk-scaling-factor 2.5", "--moe-shared-expert-intermediate-size 16",
                         "--moe-layer-freq '[0,1]'", "--moe-router-dtype fp32", "--moe-z-loss-coeff 0.003"],
         "deepseek_v2": ["--multi-latent-attention", "--moe-router-pre-softmax", "--moe-router-num-groups 4",
                         "--moe-router-group-topk 3", "--moe-router-topk-scaling-factor 1.5",
                         "--moe-shared-expert-intermediate-size 24", "--moe-layer-freq '[0,1]'", "--rope-type yarn",
                         "--rotary-scaling-factor 40"],
         "olmoe": ["--num-experts 6", "--moe-router-topk 3", "--moe-router-pre-softmax", "--qk-layernorm",
                   "--qk-layernorm-scope projection", "--moe-ffn-hidden-size 48", "--moe-aux-loss-coeff 0.02",
                   "--moe-z-loss-coeff 0.001"]}
MOE_FIELDS = ("num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
              "shared_expert_intermediate_size", "intermediate_size", "qkv_bias", "n_routed_experts", "n_group",
              "topk_group", "routed_scaling_factor", "n_shared_experts", "first_k_dense_replace", "topk_method",
              "router_aux_loss_coef", "router_z_loss_coef", "clip_qkv")


def _hf_model(name):
    """Random weights everywhere (transformers starts norms at 1, biases and routers at 0: a swapped one would
    pass unseen); routers large enough that the top-k margins are far above rounding."""
    torch.manual_seed(0)
    model = getattr(transformers, CLASSES[name])(MODELS[name]()).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_((1.0 if pname.endswith("norm.weight") else 0.0) + 0.3 * torch.randn_like(p))
            elif pname.endswith("gate.weight") or "gate_up_proj" in pname or "down_proj" in pname:
                p.normal_(0.0, 0.3)
        for bname, b in model.named_buffers():  # DeepSeek's expert bias: moves the choice, not the weights
            if bname.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.2)
    return model


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    return hf_import_cache(tmp_path_factory, _hf_model)


def _tokens():
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", list(MODELS))
def test_import_gives_transformers_logits_and_flags(imported, name):
    from megatron_ds.config import parse_args
    from megatron_ds.config.layout import resolve_model_config
    from megatron_ds.model.language_model import split_moe_loss

    _, ckpt, text = imported(name)
    c, ours = _ours(ckpt)
    with torch.no_grad():
        want = _hf_model(name)(input_ids=_tokens()).logits
        got, _ = split_moe_loss(ours((_tokens(), torch.arange(SEQ).expand_as(_tokens()))))
    torch.testing.assert_close(got, want, **LOGIT_TOL)
    flags = _printed_flags(text)
    for flag in FLAGS[name]:
        assert f"{flag} " in flags + " ", (flag, flags)
    cfg, _ = parse_args(shlex.split(flags) + ["--mock-data", "--micro-batch-size", "1", "--train-iters", "1"])
    printed = resolve_model_config(cfg.model)
    for field in ("num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_layer_freq", "moe_router_pre_softmax",
                  "moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "moe_router_score_function",
                  "moe_aux_loss_coeff", "moe_router_load_balancing_type", "qk_layernorm", "add_qkv_bias",
                  "moe_router_num_groups", "moe_router_group_topk", "moe_router_enable_expert_bias",
                  "moe_router_topk_scaling_factor", "moe_router_dtype", "multi_latent_attention",
                  "kv_channels", "ffn_hidden_size", "qk_layernorm_scope", "moe_z_loss_coeff"):
        assert getattr(printed, field) == getattr(c.model, field), field
    # and pretrain_gpt.py takes them at EP 2 (the experts split over two data parallel ranks)
    rc, _, err = dry_run(shlex.split(flags) + ["--mock-data", "--micro-batch-size", "1", "--train-iters", "1",
                                               "--lr", "1e-4", "--vocab-size", str(VOCAB),
                                               "--expert-model-parallel-size", "2"], 2)
    assert rc == 0, err


@pytest.mark.parametrize("name", list(MODELS))
def test_export_loads_as_the_same_class_with_the_same_tensors(imported, name, tmp_path):
    _, ckpt, _ = imported(name)
    out = str(tmp_path / "out")
    assert to_hf.main(["--load", ckpt, "--out", out]) == 0
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert type(theirs).__name__ == CLASSES[name]
    assert not any(info.values()), info
    original = _hf_model(name)
    for field in MOE_FIELDS:
        assert getattr(theirs.config, field, None) == getattr(original.config, field, None), field
    # the same layers with experts (the export spells Qwen2-MoE's decoder_sparse_step 2 as mlp_only_layers [0])
    assert [type(layer.mlp).__name__ for layer in theirs.model.layers] == \
        [type(layer.mlp).__name__ for layer in original.model.layers]
    got, want = theirs.state_dict(), original.state_dict()
    assert sorted(got) == sorted(want)
    for key in want:
        assert torch.equal(got[key], want[key]), key
    with torch.no_grad():
        torch.testing.assert_close(theirs.eval()(input_ids=_tokens()).logits, original(input_ids=_tokens()).logits,
                                   **LOGIT_TOL)


TRAIN = ("--micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --train-iters 3 --mock-data "
         f"--vocab-size {VOCAB} --make-vocab-size-divisible-by 4 --hidden-dropout 0 --attention-dropout 0 "
         "--log-interval 1 --eval-interval 1000 --eval-iters 1 --num-workers 0 --seed 1234").split()


@pytest.mark.parametrize("name", ["qwen2_moe", "deepseek_v3", "olmoe"])
def test_imported_moe_trains_alike_at_tp2(imported, name, tmp_path):
    """DeepSeek-V3's: with group-limited routing and the expert bias moving after every step (auxiliary-loss-free
    balancing). OLMoE's runs save, and the TP 2 checkpoint's merged weights (its split q/k norm weights
    concatenated back: checkpoint/tp.py) are the TP 1 run's."""
    from megatron_ds.checkpoint import load_consolidated

    _, ckpt, text = imported(name)
    base = shlex.split(_printed_flags(text)) + TRAIN + ["--load", ckpt]
    # (--adam-eps 1e-4 as test_attention_variant_layouts.py: a gradient that is zero in exact arithmetic must not
    # turn rounding noise into lr-sized updates of the weights compared)
    saves = {tp: ["--save", str(tmp_path / f"tp{tp}"), "--save-interval", "3", "--adam-eps", "1e-4"]
             if name == "olmoe" else [] for tp in (1, 2)}
    losses = {tp: run_distributed(train_losses, tp, [*base, "--tensor-model-parallel-size", str(tp),
                                                               "--expert-tensor-parallel-size", "1", *saves[tp]],
                                  timeout=600)
              for tp in (1, 2)}
    assert [it for it, _ in losses[1][0]] == [1, 2, 3] and losses[2][0] == losses[2][1]
    # rtol 2e-5 as tests/families/gpt/test_parity.py: TP splits the attention's and dense MLP's sums
    assert [x for _, x in losses[2][0]] == pytest.approx([x for _, x in losses[1][0]], rel=2e-5)
    if name == "olmoe":
        want, got = (load_consolidated(str(tmp_path / f"tp{tp}"), None, log=lambda *a: None, family=GPT).state_dict
                     for tp in (1, 2))
        assert sorted(got) == sorted(want) and any("k_layernorm" in n for n in want)
        for key, tensor in want.items():  # Adam's drift from other summation orders (test_attention_variant_layouts)
            torch.testing.assert_close(got[key], tensor, rtol=1e-5, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}")


def test_dense_deepseek_v2_both_ways(tmp_path):
    """All layers dense (first_k_dense_replace = layers): V2's attention is V3's; it exports back as V2."""
    from megatron_ds.model.language_model import split_moe_loss

    torch.manual_seed(0)
    config = MODELS["deepseek_v2"]()
    want = transformers.DeepseekV2ForCausalLM(type(config)(**{**config.to_dict(), "first_k_dense_replace": 2})).eval()
    want.save_pretrained(str(tmp_path / "hf"))
    import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"), family=GPT, log=lambda *a: None)
    _, ours = _ours(str(tmp_path / "ckpt"))
    with torch.no_grad():
        got, _ = split_moe_loss(ours((_tokens(), torch.arange(SEQ).expand_as(_tokens()))))
        torch.testing.assert_close(got, want(input_ids=_tokens()).logits, **LOGIT_TOL)
    assert to_hf.main(["--load", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out")]) == 0
    assert type(transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))).__name__ == \
        "DeepseekV2ForCausalLM"


@pytest.mark.parametrize("name,over,says", [
    ("olmoe", dict(clip_qkv=8.0), "clip_qkv 8.0: OlmoeForCausalLM with this value has no equivalent here"),
    ("qwen2_moe", dict(use_sliding_window=True, sliding_window=8, max_window_layers=2), "use_sliding_window True"),
    ("deepseek_v2", dict(topk_group=1, n_group=4), "transformers scores a group by its largest probability"),
    ("deepseek_v2", dict(topk_method="noaux_tc"), "topk_method 'noaux_tc'"),
])
def test_what_has_no_equivalent_is_refused_in_one_line(tmp_path, name, over, says):
    config = MODELS[name]()
    model = getattr(transformers, CLASSES[name])(type(config)(**{**config.to_dict(), **over}))
    model.save_pretrained(str(tmp_path / "hf"))
    with pytest.raises(ConfigError, match=says) as e:
        import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"), family=GPT, log=lambda *a: None)
    assert "\n" not in str(e.value)


def test_export_refuses_what_the_class_cannot_express():
    import dataclasses

    from megatron_ds.config.layout import resolve_model_config
    from megatron_ds.config.schema import ModelConfig
    from megatron_ds.families.gpt import gpt_hf as hf

    m = resolve_model_config(ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                                         position_embedding_type="rope", swiglu=True, normalization="rmsnorm",
                                         add_bias_linear=False, num_experts=(4,), moe_router_topk=2))
    assert hf.choose_architecture(m) == hf.MIXTRAL
    shared = dataclasses.replace(m, moe_shared_expert_intermediate_size=32, moe_shared_expert_gate=True)
    assert hf.choose_architecture(shared) == hf.QWEN2_MOE
    assert hf.choose_architecture(dataclasses.replace(m, qk_layernorm=True)) == hf.QWEN3_MOE
    bad = dataclasses.replace(m, moe_router_score_function="sigmoid", moe_layer_freq="[0,1]",
                              moe_expert_capacity_factor=1.0)
    with pytest.raises(ConfigError) as e:
        hf.choose_architecture(bad)
    for reason in ("--moe-router-score-function sigmoid", "--moe-layer-freq [0,1]", "--moe-expert-capacity-factor 1"):
        assert reason in str(e.value)
    top1 = dataclasses.replace(m, moe_router_topk=1, moe_router_pre_softmax=True)  # weighted p: Mixtral's is 1
    with pytest.raises(ConfigError, match="--moe-router-pre-softmax"):
        hf.choose_architecture(top1)
    assert hf.choose_architecture(dataclasses.replace(top1, qk_layernorm=True)) == hf.QWEN3_MOE  # norm_topk_prob false
    olmo = dataclasses.replace(m, qk_layernorm=True, qk_layernorm_scope="projection")
    assert hf.choose_architecture(olmo) == hf.OLMOE
    with pytest.raises(ConfigError, match=r"--qk-layernorm-scope projection \(Qwen3MoeForCausalLM normalizes each "):
        hf.choose_architecture(olmo, asked="Qwen3MoeForCausalLM")
    with pytest.raises(ConfigError, match=r"--qk-layernorm-scope head \(OlmoeForCausalLM normalizes the whole"):
        hf.choose_architecture(dataclasses.replace(m, qk_layernorm=True), asked="OlmoeForCausalLM")
    with pytest.raises(ConfigError, match="--kv-channels 16 .*q_norm is of hidden size"):
        hf.choose_architecture(dataclasses.replace(olmo, kv_channels=16))
    with pytest.raises(ConfigError, match="no --moe-shared-expert-intermediate-size"):
        hf.choose_architecture(m, asked="Qwen2MoeForCausalLM")
    with pytest.raises(ConfigError, match="LlamaForCausalLM has no mixture of experts"):
        hf.choose_architecture(m, asked="LlamaForCausalLM")
