"""An all-dense DeepseekV3ForCausalLM (first_k_dense_replace = num_hidden_layers) both ways: a tiny random
transformers model built here, imported (tools/checkpoint/from_hf.py's import_hf), gives transformers' logits
at every position (fp32; atol 1e-5 as tests/families/gpt/test_hf_models.py: other kernels and summation
orders), with and without a query latent, YaRN (DeepSeek-V2's mscale) and plain RoPE; the printed flags give the
imported model; the export loads as the same class with the same tensors; greedy generation with our KV cache
equals transformers' generate; YaRN settings Megatron-LM fixes and MoE routing it cannot compute are refused by name.
"""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from megatron_ds.errors import ConfigError  # noqa: E402
from megatron_ds.families.gpt.gpt_family import GPT  # noqa: E402
from megatron_ds.families.gpt.gpt_hf_export import export_hf  # noqa: E402
from megatron_ds.families.gpt.gpt_hf_import import import_hf  # noqa: E402

VOCAB, SEQ = 128, 24
_SMALL = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=2, first_k_dense_replace=2,
              num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=8,
              v_head_dim=6, max_position_embeddings=SEQ, rms_norm_eps=1e-6, initializer_range=0.2,
              tie_word_embeddings=False)
_YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0,
             beta_slow=1.0, mscale=0.707, mscale_all_dim=0.707)
MODELS = {"v2_lite_yarn": dict(q_lora_rank=None, rope_parameters=_YARN),
          "v3_query_latent_rope": dict(q_lora_rank=16, rope_parameters={"rope_type": "default", "rope_theta": 1e4})}


def _hf_model(name, **over):
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**{**_SMALL, **MODELS[name], **over}))
    with torch.no_grad():  # norms away from 1: a swapped or missing norm must show
        for pname, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    return model.eval()


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    cache = {}

    def get(name):
        if name not in cache:
            root = tmp_path_factory.mktemp(name)
            _hf_model(name).save_pretrained(str(root / "hf"))
            lines = []
            import_hf(str(root / "hf"), str(root / "ckpt"), family=GPT, log=lines.append)
            cache[name] = root, "\n".join(lines)
        return cache[name]
    return get


def _ours(ckpt):
    from megatron_ds.checkpoint import load_consolidated
    from megatron_ds.families.gpt.gpt_model import build_sequential_gpt

    c = load_consolidated(ckpt, log=lambda *a: None, family=GPT)
    model = build_sequential_gpt(c.model, padded_vocab_size=c.padded_vocab_size, vocab_size=c.vocab_size, seed=0)
    model.load_state_dict(c.state_dict)
    return c, model.eval()


@pytest.mark.parametrize("name", list(MODELS))
def test_import_gives_transformers_logits_and_flags(imported, name):
    from megatron_ds.config import parse_args
    from megatron_ds.config.layout import resolve_model_config

    root, text = imported(name)
    c, ours = _ours(str(root / "ckpt"))
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = _hf_model(name)(input_ids=tokens).logits
        got = ours((tokens, torch.arange(SEQ).expand_as(tokens)))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    flags = text.split("train it with\n  ")[1].split("\n")[0]
    cfg, _ = parse_args(flags.split() + ["--mock-data", "--micro-batch-size", "1", "--train-iters", "1"])
    printed = resolve_model_config(cfg.model)
    for field in ("multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
                  "v_head_dim", "rope_type", "rotary_scaling_factor", "mscale", "mscale_all_dim", "rope_theta",
                  "ffn_hidden_size", "untie_embeddings_and_output_weights", "normalization", "swiglu"):
        assert getattr(printed, field) == getattr(c.model, field), field


@pytest.mark.parametrize("name", list(MODELS))
def test_export_loads_as_the_same_class_with_the_same_tensors(imported, name, tmp_path):
    root, _ = imported(name)
    assert export_hf(str(root / "ckpt"), str(tmp_path), family=GPT, log=lambda *a: None) == "DeepseekV3ForCausalLM"
    want = _hf_model(name)
    got = transformers.DeepseekV3ForCausalLM.from_pretrained(str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    for field in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_interleave"):
        assert config[field] == getattr(want.config, field), field
    assert {k: v for k, v in config["rope_parameters"].items()} == want.config.rope_parameters
    theirs = want.state_dict()
    assert sorted(got.state_dict()) == sorted(theirs)
    for k, v in got.state_dict().items():
        assert torch.equal(v, theirs[k]), k


def test_greedy_generation_equals_transformers(imported):
    from megatron_ds.checkpoint import load_consolidated
    from megatron_ds.inference.generate import SamplingConfig, generate
    from megatron_ds.inference.model import ModelWeights, build_inference_model

    root, _ = imported("v2_lite_yarn")
    c = load_consolidated(str(root / "ckpt"), log=lambda *a: None, family=GPT)
    model = build_inference_model(ModelWeights(c.model, c.padded_vocab_size, c.vocab_size, c.state_dict), family=GPT)
    prompt = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(1))
    ours = generate(model, prompt.tolist(), SamplingConfig(max_new_tokens=12, greedy=True, stop_at_eod=False), eod=0)
    with torch.no_grad():
        theirs = _hf_model("v2_lite_yarn").generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None,
                                                     pad_token_id=0)
    assert ours.tokens[0] == theirs[0, 6:].tolist()


@pytest.mark.parametrize("over,says", [
    # DeepSeek's MoE layers import (tests/families/gpt/test_moe_hf_models.py) where Megatron-LM's router computes them
    (dict(first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2),
     "transformers scores a group by its top 2 experts, Megatron-LM's --moe-router-group-topk by its top"),
    (dict(first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, norm_topk_prob=False, n_group=1),
     "norm_topk_prob False with num_experts_per_tok 2"),
    (dict(rope_parameters={**_YARN, "original_max_position_embeddings": 8192}), "fixes YaRN's original context"),
    (dict(rope_interleave=False), "rope_interleave false"),
])
def test_what_has_no_equivalent_is_refused_by_name(tmp_path, over, says):
    _hf_model("v2_lite_yarn", **over).save_pretrained(str(tmp_path / "hf"))
    with pytest.raises(ConfigError, match=says):
        import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"), family=GPT, log=lambda *a: None)


def test_other_classes_refuse_multi_latent_attention():
    from megatron_ds.config.layout import resolve_model_config
    from megatron_ds.config.schema import ModelConfig
    from megatron_ds.families.gpt import gpt_hf as hf

    m = resolve_model_config(ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                                         multi_latent_attention=True, position_embedding_type="rope", swiglu=True,
                                         normalization="rmsnorm", add_bias_linear=False))
    assert hf.choose_architecture(m) == hf.DEEPSEEK_V3
    with pytest.raises(ConfigError, match="cannot express --multi-latent-attention"):
        hf.choose_architecture(m, asked="LlamaForCausalLM")
    with pytest.raises(ConfigError, match="MixtralForCausalLM, which cannot express .*--multi-latent-attention"):
        hf.choose_architecture(resolve_model_config(ModelConfig(**{**m.__dict__, "num_experts": (2,)})))
