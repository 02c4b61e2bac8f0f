"""The attention variants of open models, one process: Llama 3.1's RoPE scaling and linear interpolation
(against Megatron-LM's formula written out here and transformers' own), --qk-layernorm and --add-qkv-bias
(an attention layer against a hand-written one), their parameters' weight decay and counts, and what
--window-size accepts.
"""
from __future__ import annotations

import math

import pytest
import torch

from megatron_ds.config.arguments import parse_args
from megatron_ds.config.layout import resolve_model_config
from megatron_ds.config.run import resolve
from megatron_ds.config.schema import ModelConfig
from megatron_ds.errors import ConfigError
from megatron_ds.families.gpt.gpt_family import GPT
from megatron_ds.families.gpt.gpt_model import build_sequential_gpt
from megatron_ds.model.param_groups import param_groups
from megatron_ds.model.rotary import RopeScaling, clear_rotary_tables, inverse_frequencies, rotary_cos_sin
from megatron_ds.model.transformer import ParallelAttention

SEQ = 16
# Qwen3-like proportions, tiny: head dim 12 with hidden 32 and 4 heads (heads x head dim 48 != 32), GQA 2
# groups, QKV bias without other biases, per-head RMSNorm of q and k, Llama 3.1 scaling whose original
# context (8) is under the sequence (16), so the scaled frequencies are the ones positions 8.. use.
FEATURES = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, kv_channels=12,
                ffn_hidden_size=48, seq_length=SEQ, max_position_embeddings=SEQ, hidden_dropout=0.0,
                attention_dropout=0.0, init_method_std=0.2, use_rotary_position_embeddings=True, swiglu=True,
                normalization="rmsnorm", add_bias_linear=False, untie_embeddings_and_output_weights=True,
                add_qkv_bias=True, qk_layernorm=True, use_rope_scaling=True,
                rope_scaling_original_max_position_embeddings=8, rope_scaling_factor=4.0)


def megatron_llama3_inv_freq(dim, theta, factor, low, high, original):
    """Megatron-LM's RotaryEmbedding._apply_scaling (megatron/core/models/common/embeddings/
    rotary_pos_embedding.py), one frequency at a time in Python floats."""
    out = []
    for i in range(0, dim, 2):
        freq = 1.0 / theta ** (i / dim)
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            out.append(freq)
        elif wavelen > original / low:
            out.append(freq / factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("factor,low,high,original", [(8.0, 1.0, 4.0, 8192), (32.0, 1.0, 4.0, 8192),
                                                      (4.0, 1.0, 4.0, 8), (8.0, 2.0, 6.0, 64)])
def test_llama3_scaled_frequencies_equal_megatrons_formula(factor, low, high, original):
    scaling = RopeScaling(factor, low, high, original)
    got = inverse_frequencies(128, 500000.0, scaling)
    want = megatron_llama3_inv_freq(128, 500000.0, factor, low, high, original)
    # fp32 against float64: a few ulps of each frequency
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)
    # all three regimes occur at the wide original contexts (kept, blended, divided)
    plain = inverse_frequencies(128, 500000.0)
    if original == 8192:
        assert (got == plain).any() and (got < plain / factor * 1.0001).any() and ((got < plain) & (got > plain / factor
                                                                                                    * 1.0001)).any()


def test_llama3_scaled_frequencies_equal_transformers():
    """transformers' rope_type "llama3" (modeling_rope_utils._compute_llama3_parameters) gives the same."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                  original_max_position_embeddings=8192)
    hf = LlamaConfig(hidden_size=256, num_attention_heads=2, head_dim=128, max_position_embeddings=131072,
                     rope_parameters=params)
    want, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    assert attention_factor == 1.0
    torch.testing.assert_close(inverse_frequencies(128, 500000.0, RopeScaling(32.0, 1.0, 4.0, 8192)), want.float(),
                               rtol=1e-6, atol=0)


def test_linear_interpolation_divides_the_positions():
    """Megatron-LM's seq_len_interpolation_factor (``seq *= 1 / factor``), HF's rope_type "linear"."""
    clear_rotary_tables()
    cos, sin = rotary_cos_sin(SEQ, 8, 10000.0, "cpu", RopeScaling(linear=4.0))
    inv = 1.0 / 10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    angles = torch.outer(torch.arange(SEQ, dtype=torch.float64) / 4.0, inv)
    angles = torch.cat((angles, angles), dim=-1)
    torch.testing.assert_close(cos[:, 0, 0].double(), angles.cos(), rtol=0, atol=1e-6)
    torch.testing.assert_close(sin[:, 0, 0].double(), angles.sin(), rtol=0, atol=1e-6)


def test_the_table_cache_tells_scalings_apart():
    clear_rotary_tables()
    plain = rotary_cos_sin(SEQ, 8, 10000.0, "cpu")[0]
    linear = rotary_cos_sin(SEQ, 8, 10000.0, "cpu", RopeScaling(linear=2.0))[0]
    llama3 = rotary_cos_sin(SEQ, 8, 10000.0, "cpu", RopeScaling(8.0, 1.0, 4.0, 4))[0]
    assert not torch.equal(plain, linear) and not torch.equal(plain, llama3) and not torch.equal(linear, llama3)
    assert rotary_cos_sin(SEQ, 8, 10000.0, "cpu")[0] is plain


def _rms(x, weight, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _reference_attention(attn, cfg, x):
    """The layer written out: fused QKV with bias in its per-group layout, each head's q and k RMS-normalised
    with the shared weight, rotated (Megatron-LM's scaled frequencies, rotate-half), causal softmax with
    each key/value group serving its query heads, output projection [heads x head dim -> hidden]."""
    s, b, _ = x.shape
    d, groups, hpg = cfg.kv_channels, cfg.num_key_value_heads, cfg.num_attention_heads // cfg.num_key_value_heads
    qkv = x @ attn.query_key_value.weight.T + attn.query_key_value.bias
    qkv = qkv.view(s, b, groups, hpg + 2, d)
    q = qkv[:, :, :, :hpg].reshape(s, b, groups * hpg, d)
    k, v = qkv[:, :, :, hpg], qkv[:, :, :, hpg + 1]
    q = _rms(q, attn.q_layernorm.weight, cfg.layernorm_epsilon)
    k = _rms(k, attn.k_layernorm.weight, cfg.layernorm_epsilon)
    inv = megatron_llama3_inv_freq(d, cfg.rope_theta, cfg.rope_scaling_factor, cfg.rope_scaling_low_freq_factor,
                                   cfg.rope_scaling_high_freq_factor,
                                   cfg.rope_scaling_original_max_position_embeddings).float()
    angles = torch.outer(torch.arange(s, dtype=torch.float32), inv)
    cos, sin = torch.cat((angles, angles), -1).cos()[:, None, None], torch.cat((angles, angles), -1).sin()[:, None, None]

    def rotate(t):
        t1, t2 = t[..., :d // 2], t[..., d // 2:]
        return t * cos + torch.cat((-t2, t1), -1) * sin

    q, k = rotate(q), rotate(k)
    out = torch.empty(s, b, groups * hpg, d)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    for h in range(groups * hpg):
        g = h // hpg
        for i in range(b):
            scores = (q[:, i, h] @ k[:, i, g].T) / math.sqrt(d)
            out[:, i, h] = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v[:, i, g]
    return out.reshape(s, b, groups * hpg * d) @ attn.dense.weight.T


def test_qk_layernorm_and_qkv_bias_attention_equals_the_hand_written_one():
    cfg = resolve_model_config(ModelConfig(**FEATURES))
    torch.manual_seed(0)
    attn = ParallelAttention(cfg)
    assert attn.dense.weight.shape == (32, 48) and attn.dense.bias is None
    assert attn.query_key_value.bias.shape == ((4 + 2 * 2) * 12,)
    assert attn.q_layernorm.weight.shape == attn.k_layernorm.weight.shape == (12,)
    with torch.no_grad():  # the defaults (zero bias, unit weights) would hide a missing term
        for p in (attn.query_key_value.bias, attn.q_layernorm.weight, attn.k_layernorm.weight):
            p.copy_(torch.randn_like(p))
    x = torch.randn(SEQ, 2, 32)
    out, bias = attn(x)
    assert bias is None
    # fp32, the same products summed in other orders: ulps of O(1) values
    torch.testing.assert_close(out, _reference_attention(attn, cfg, x), rtol=1e-5, atol=1e-5)


def test_without_the_scaling_the_output_differs():
    """The scaled frequencies reach the layer (positions past the original context move)."""
    cfg = resolve_model_config(ModelConfig(**FEATURES))
    plain = resolve_model_config(ModelConfig(**{**FEATURES, "use_rope_scaling": False}))
    torch.manual_seed(0)
    x = torch.randn(SEQ, 1, 32)
    torch.manual_seed(1)
    scaled_out = ParallelAttention(cfg)(x)[0]
    torch.manual_seed(1)
    plain_out = ParallelAttention(plain)(x)[0]
    assert torch.equal(scaled_out[0], plain_out[0])  # position 0 does not rotate
    assert not torch.allclose(scaled_out[-1], plain_out[-1])


@pytest.mark.parametrize("apply_wd", [False, True])
def test_qk_norm_weights_decay_only_with_the_flag(apply_wd):
    """Megatron-LM's get_param_groups (megatron/core/optimizer/__init__.py): without
    --apply-wd-to-qk-layernorm the q/k norm weights are 1-D and skip weight decay like the other norms."""
    cfg = resolve_model_config(ModelConfig(**FEATURES, apply_wd_to_qk_layernorm=apply_wd))
    model = build_sequential_gpt(cfg, padded_vocab_size=64, seed=1)
    names = {id(p): n for n, p in model.named_parameters()}
    decay, no_decay = ([names[id(p)] for p in g["params"]] for g in param_groups(model, 0.1))
    qk = [n for n in names.values() if "q_layernorm" in n or "k_layernorm" in n]
    assert len(qk) == 2 * cfg.num_layers
    assert set(qk) <= set(decay if apply_wd else no_decay)
    assert any(n.endswith("query_key_value.bias") for n in no_decay)  # biases never decay


def _run(*extra, world_size=4):
    cfg, _ = parse_args(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length",
                         str(SEQ), "--max-position-embeddings", str(SEQ), "--micro-batch-size", "1", "--train-iters",
                         "1", "--lr", "1e-3", "--mock-data", *extra])
    return resolve(cfg, world_size=world_size, vocab_size=64, family=GPT, ds_template={}, device_type="cpu")


def test_built_parameters_equal_the_count():
    """Every new parameter (QKV bias, q/k norms, the [heads x head dim -> hidden] projection) is counted:
    the analytic total equals the built model's."""
    flags = ["--num-key-value-heads", "2", "--kv-channels", "12", "--ffn-hidden-size", "48",
             "--use-rotary-position-embeddings", "--swiglu", "--normalization", "rmsnorm", "--disable-bias-linear",
             "--untie-embeddings-and-output-weights", "--add-qkv-bias", "--qk-layernorm"]
    for norm in ("rmsnorm", "layernorm"):
        run = _run(*flags, "--normalization", norm, world_size=1)
        model = build_sequential_gpt(run.layout.model, padded_vocab_size=run.layout.padded_vocab_size, seed=1)
        assert sum(p.numel() for p in model.parameters()) == run.layout.total_params


def test_each_stage_and_tp_rank_holds_the_counted_parameters():
    """TP 2 x PP 2: each stage's rank builds what the layout counts for it (the QKV bias split with the
    weight's rows, the q/k norms whole on every rank, the output projection's [heads x head dim / TP ->
    hidden] shard), as --dry-run's meta-device build compares."""
    from megatron_ds import ds_compat
    from megatron_ds.families.gpt.gpt_model import build_stage_gpt
    from megatron_ds.training.engine import model_kwargs

    run = _run("--num-key-value-heads", "2", "--kv-channels", "12", "--use-rotary-position-embeddings",
               "--normalization", "rmsnorm", "--disable-bias-linear", "--add-qkv-bias", "--qk-layernorm",
               "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2")
    lay = run.layout
    with ds_compat.fake_process_group(2, 0) as tp_group:
        for stage in lay.stages:
            model = build_stage_gpt(lay.model, num_stages=2, stage=stage.stage,
                                    **model_kwargs(run, tp_group, 0, device="cpu"))
            assert sum(p.numel() for p in model.parameters()) == stage.params_per_tp_rank
            shapes = {n.split(".", 1)[1]: p.shape for n, p in model.named_parameters() if "self_attention" in n}
            assert shapes["self_attention.query_key_value.bias"] == ((4 + 2 * 2) * 12 // 2,)
            assert shapes["self_attention.q_layernorm.weight"] == (12,)
            assert shapes["self_attention.dense.weight"] == (32, 4 * 12 // 2)


def test_projection_qk_norms_are_counted_and_split_with_the_heads():
    """--qk-layernorm-scope projection (OLMo 2 / OLMoE): one RMSNorm weight of heads x head dim for q and of
    key/value heads x head dim for k, split over TP like the projection: counted as built at TP 1 and on each
    TP 2 x PP 2 rank, named on the model line."""
    from megatron_ds import ds_compat
    from megatron_ds.families.gpt.gpt_model import build_stage_gpt
    from megatron_ds.training.engine import model_kwargs

    flags = ["--num-key-value-heads", "2", "--kv-channels", "12", "--use-rotary-position-embeddings",
             "--normalization", "RMSNorm", "--disable-bias-linear", "--qk-layernorm", "--qk-layernorm-scope",
             "projection"]
    run = _run(*flags, world_size=1)
    model = build_sequential_gpt(run.layout.model, padded_vocab_size=run.layout.padded_vocab_size, seed=1)
    assert sum(p.numel() for p in model.parameters()) == run.layout.total_params
    assert "QK rmsnorm over the whole projection" in run.describe()
    run = _run(*flags, "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2")
    with ds_compat.fake_process_group(2, 0) as tp_group:
        for stage in run.layout.stages:
            model = build_stage_gpt(run.layout.model, num_stages=2, stage=stage.stage,
                                    **model_kwargs(run, tp_group, 0, device="cpu"))
            assert sum(p.numel() for p in model.parameters()) == stage.params_per_tp_rank
            shapes = {n.split(".", 1)[1]: p.shape for n, p in model.named_parameters() if "self_attention" in n}
            assert shapes["self_attention.q_layernorm.weight"] == (4 * 12 // 2,)
            assert shapes["self_attention.k_layernorm.weight"] == (2 * 12 // 2,)


@pytest.mark.parametrize("flags,says", [
    (["--qk-layernorm-scope", "projection"], "--qk-layernorm-scope projection chooses what --qk-layernorm "
                                              "normalizes; add --qk-layernorm or drop it"),
    (["--qk-layernorm", "--qk-layernorm-scope", "projection"],
     "--qk-layernorm-scope projection is an RMSNorm .* with --normalization layernorm use --qk-layernorm-scope head"),
])
def test_projection_qk_norm_refusals(flags, says):
    with pytest.raises(ConfigError, match=says) as e:
        _run(*flags, world_size=1)
    assert "\n" not in str(e.value)


def test_a_window_covering_the_sequence_is_accepted_and_said_to_mask_nothing():
    summary = _run("--window-size", f"({SEQ - 1},0)").describe()
    assert f"window ({SEQ - 1}, 0) covers seq {SEQ}: masks nothing" in summary
    assert "masks nothing" in _run("--window-size", "(4095,0)").describe()
    assert "masks nothing" in _run("--window-size", "(-1,0)").describe()  # Transformer Engine's "no limit"


@pytest.mark.parametrize("window", [f"({SEQ - 2},0)", f"({SEQ - 1},1)", "(-1,-1)"])
def test_a_narrower_window_is_refused_in_one_line(window):
    with pytest.raises(ConfigError, match=r"sliding-window attention narrower than --seq-length is not supported; "):
        _run("--window-size", window)


def test_dry_run_names_the_variants():
    summary = _run("--kv-channels", "12", "--use-rotary-position-embeddings", "--normalization", "rmsnorm",
                   "--disable-bias-linear", "--add-qkv-bias", "--qk-layernorm", "--use-rope-scaling",
                   "--rope-scaling-factor", "32", "--rotary-seq-len-interpolation-factor", "2").describe()
    for words in ("head dim 12 (heads x head dim 48 != hidden 32)", "QKV bias", "QK rmsnorm per head (no weight decay)",
                  "RoPE llama3 scaling x32 (low 1, high 4, original 8192 positions)", "RoPE positions / 2 (linear)"):
        assert words in summary


@pytest.mark.parametrize("build,scope", [({}, "head"), (dict(activation_checkpoint_interval=1), "head"),
                                         ({}, "projection")])
def test_compiled_layers_equal_eager_in_one_graph(build, scope):
    """--compile-layers with the fusions on (--fusions-on-cpu): each layer, q/k norms and scaled tables
    included, is one graph without breaks (the tables enter it as inputs: their cache key holds the
    scaling), and a step's loss and gradients are eager's, under full recompute too. aot_eager runs
    dynamo and AOTAutograd as inductor does, without building C++ (tests/model/test_compile_layers.py
    runs inductor itself). --qk-layernorm-scope projection's norms too (at TP 1 their all-reduce is no op)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from megatron_ds.model import compile_layers as cl
    from tests.model.test_compile_layers import SEQ as COMPILE_SEQ
    from tests.model.test_compile_layers import TOL, VOCAB, graphs_and_breaks, one_step

    assert COMPILE_SEQ == SEQ
    cfg = resolve_model_config(ModelConfig(**FEATURES, fusions_on_cpu=True, qk_layernorm_scope=scope))
    kw = dict(padded_vocab_size=VOCAB, seed=7, **build)
    ref_loss, ref_grads = one_step(build_sequential_gpt(cfg, **kw))
    assert graphs_and_breaks(build_sequential_gpt(cfg, **kw)) == (1, 0)
    torch._dynamo.reset()
    model = build_sequential_gpt(cfg, **kw)
    assert cl.compile_layers(model, backend=CompileCounterWithBackend("aot_eager")) == cfg.num_layers
    loss, grads = one_step(model)
    torch.testing.assert_close(loss, ref_loss, **TOL)
    for n, g in grads.items():
        torch.testing.assert_close(g, ref_grads[n], **TOL, msg=lambda m, n=n: f"grad {n}: {m}")


@pytest.mark.parametrize("flag", [["--qk-layernorm"], ["--add-qkv-bias"], ["--use-rope-scaling"],
                                  ["--window-size", f"({SEQ - 1},0)"]])
def test_bert_and_t5_refuse_the_gpts_attention_variants(flag):
    """Their attention (T5's own, BERT's Hugging Face mapping) has none of these: refused, not ignored."""
    from megatron_ds.families.bert.bert_family import BERT
    from megatron_ds.families.t5.t5_family import T5

    cfg, _ = parse_args(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length",
                         str(SEQ), "--max-position-embeddings", str(SEQ), "--micro-batch-size", "1",
                         "--train-iters", "1", "--lr", "1e-3", "--mock-data", *flag])
    for family, script in ((BERT, "pretrain_bert.py"), (T5, "pretrain_t5.py")):
        with pytest.raises(ConfigError, match=f"{script} cannot run with .*--qk-layernorm"):
            resolve(cfg, world_size=1, vocab_size=64, family=family, ds_template={}, device_type="cpu")


@pytest.mark.parametrize("scope", ["head", "projection"])
def test_checkpoints_split_projection_qk_norms_and_replicate_per_head_ones(scope):
    """The resharding rule (checkpoint/tp.py) and what ds_to_universal is told (universal.py) agree with the
    layer: per-head q/k norm weights are replicated over TP, whole-projection ones split along dim 0; the
    checkpoint signature names the scope only where it is not the default (older checkpoints still match)."""
    import re

    from megatron_ds.checkpoint import tp as tp_rules
    from megatron_ds.checkpoint.format import signature
    from megatron_ds.checkpoint.universal import checkpoint_info

    m = resolve_model_config(ModelConfig(**{**FEATURES, "add_qkv_bias": False, "kv_channels": 8},
                                         qk_layernorm_scope=scope))
    sig = signature(m, padded_vocab_size=64, tp=2)
    assert sig.get("qk_layernorm_scope") == (None if scope == "head" else "projection")
    replicated = checkpoint_info(sig, 64)["tp_replicated_parameter_patterns"]
    for name in ("3.self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"):
        assert tp_rules.partition(name, m, GPT) == (None if scope == "head" else (0, 1))
        assert any(re.match(p, name) for p in replicated) == (scope == "head")
