"""Megatron-DeepSpeed's model variants: --openai-gelu, --squared-relu, --apply-layernorm-1p,
--apply-residual-connection-post-layernorm. Their numerics are checked against the dense reference
(tests/families/gpt/test_reference.py); here: each changes the model (the reference check is not vacuous),
1p starts from zero weights, the Hugging Face export expresses what GPT2LMHeadModel can (its logits equal
ours: transformers' own GPT-2 is an independent implementation) and refuses the rest in one line."""
from __future__ import annotations

import pytest
import torch

from megatron_ds.config import parse_args, resolve
from megatron_ds.errors import ConfigError
from megatron_ds.families.gpt import gpt_hf as hf
from megatron_ds.families.gpt.gpt_family import GPT
from megatron_ds.families.gpt.gpt_model import build_sequential_gpt
from tests.families.gpt.test_reference import TOL, VOCAB, batch, gpt2_config

VARIANTS = {"openai_gelu": True, "squared_relu": True, "apply_layernorm_1p": True,
            "apply_residual_connection_post_layernorm": True}


def _logits(cfg, model=None):
    model = model or build_sequential_gpt(cfg, padded_vocab_size=VOCAB, seed=7)
    tokens, positions, _, _ = batch()
    with torch.no_grad():
        return model((tokens, positions))


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_variant_changes_the_model(variant):
    base = build_sequential_gpt(gpt2_config(), padded_vocab_size=VOCAB, seed=7)
    cfg = gpt2_config(**{variant: True})
    model = build_sequential_gpt(cfg, padded_vocab_size=VOCAB, seed=7)
    if variant == "apply_layernorm_1p":  # same function at initialisation (1 + 0 = 1): compare from base's weights
        model.load_state_dict({k: v - 1 if k.endswith("layernorm.weight") else v for k, v in base.state_dict().items()})
        torch.testing.assert_close(_logits(cfg, model), _logits(gpt2_config(), base), **TOL)
        model.load_state_dict(base.state_dict())  # now weights 1 mean a scale of 2
    assert (_logits(cfg, model) - _logits(gpt2_config(), base)).abs().max() > 1e-4


def test_layernorm_1p_weights_start_at_zero():
    model = build_sequential_gpt(gpt2_config(apply_layernorm_1p=True), padded_vocab_size=VOCAB, seed=7)
    norms = {k: v for k, v in model.state_dict().items() if k.endswith("layernorm.weight")}
    assert len(norms) == 5 and all(torch.equal(v, torch.zeros_like(v)) for v in norms.values())


def _to_hf_state(model, cfg) -> dict:
    """Our single-process state dict in transformers' GPT-2 names, through the export's own mapping."""
    n, state = cfg.num_layers, model.state_dict()
    out = {}
    for i in range(1, n + 1):  # layer specs 1..n are the transformer layers
        out.update(hf.layer_to_hf(hf.GPT2, cfg, i - 1, {k[len(f"{i}."):]: v for k, v in state.items()
                                                           if k.startswith(f"{i}.")}))
    names = hf.embedding_names(hf.GPT2)
    rest = {k.split(".", 2)[-1] if k.startswith("tied_modules.") else k.split(".", 1)[1]: v
            for k, v in state.items() if k.startswith(("tied_modules.", f"{n + 1}."))}
    out.update(hf.one_plus(cfg, {names[k]: v for k, v in rest.items()}))
    return out


@pytest.mark.parametrize("variant", ["openai_gelu", "squared_relu", "apply_layernorm_1p"])
def test_gpt2_export_expresses_the_variant(variant):
    transformers = pytest.importorskip("transformers")
    cfg = gpt2_config(**{variant: True})
    model = build_sequential_gpt(cfg, padded_vocab_size=VOCAB, seed=7)
    with torch.no_grad():  # 1p: weights away from zero so the +1 matters
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight"):
                p.uniform_(-0.5, 0.5)
    theirs = transformers.GPT2LMHeadModel(hf.hf_config(hf.GPT2, cfg, VOCAB, bos=None, eos=None, dtype=torch.float32))
    missing, unexpected = theirs.load_state_dict(_to_hf_state(model, cfg), strict=False)
    assert not unexpected and all(k.endswith(("attn.bias", "attn.masked_bias", "lm_head.weight")) for k in missing)
    tokens, _, _, _ = batch()
    with torch.no_grad():
        torch.testing.assert_close(theirs.eval()(input_ids=tokens).logits, _logits(cfg, model), **TOL)
    # and back: the import reads the activation from the config
    _, imported = hf.model_config_from_hf(theirs.config.to_dict())
    assert (imported.openai_gelu, imported.squared_relu) == (cfg.openai_gelu, cfg.squared_relu)


def test_post_layernorm_residual_export_is_refused():
    with pytest.raises(ConfigError, match="--apply-residual-connection-post-layernorm: neither"):
        hf.choose_architecture(gpt2_config(apply_residual_connection_post_layernorm=True))


@pytest.mark.parametrize("flags", [["--openai-gelu", "--swiglu"], ["--squared-relu", "--swiglu"],
                                   ["--openai-gelu", "--squared-relu"]])
def test_one_activation_at_a_time(flags):
    cfg, _ = parse_args("--num-layers 2 --hidden-size 8 --num-attention-heads 2 --seq-length 8 --micro-batch-size 1 "
                        "--lr 1e-3 --train-iters 2".split() + flags)
    with pytest.raises(ConfigError, match="each choose the MLP's activation; pass one"):
        resolve(cfg, world_size=1, vocab_size=64, device_type="cpu", family=GPT)


def test_summary_names_the_activation():
    cfg, _ = parse_args("--num-layers 2 --hidden-size 8 --num-attention-heads 2 --seq-length 8 --micro-batch-size 1 "
                        "--lr 1e-3 --train-iters 2 --squared-relu".split())
    assert "squared-relu" in resolve(cfg, world_size=1, vocab_size=64, device_type="cpu", family=GPT).layout.summary()
