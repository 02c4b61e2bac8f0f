"""Multi-latent attention (megatron_ds/model/mla.py) against two independent computations, fp32, one process:

- the DeepSeek-V2 paper's formulas (arXiv 2405.04434, section 2.1.2-2.1.3, eq. 9-19) written out below with
  DeepSeek's own YaRN (its released modeling_deepseek.py: ``yarn_find_correction_range``, ``yarn_linear_ramp_mask``,
  ``yarn_get_mscale``; rotary pairs (2i, 2i+1) rotated as complex numbers, as the paper's RoPE);
- transformers' DeepseekV3Attention (models/deepseek_v3/modeling_deepseek_v3.py, its YaRN from
  modeling_rope_utils ``_compute_yarn_parameters``) with the same weights.

With and without a query latent (--q-lora-rank None: DeepSeek-V2-Lite), YaRN's factor 40 with mscale 0.707
(DeepSeek-V2's) and plain RoPE; tolerance 1e-5: fp32 summation orders differ (SDPA vs explicit softmax).
"""
from __future__ import annotations

import math

import pytest
import torch

from megatron_ds.config.layout import resolve_model_config
from megatron_ds.config.schema import ModelConfig
from megatron_ds.model.kv_cache import KVCache
from megatron_ds.model.mla import MLASelfAttention

H, HEADS, SEQ, BATCH = 32, 4, 12, 2
QK, ROPE, V, KV_RANK = 8, 8, 6, 10
YARN = dict(rotary_scaling_factor=40.0, mscale=0.707, mscale_all_dim=0.707)


def _cfg(q_lora_rank, **over):
    return resolve_model_config(ModelConfig(
        num_layers=2, hidden_size=H, num_attention_heads=HEADS, seq_length=SEQ, multi_latent_attention=True,
        q_lora_rank=q_lora_rank, kv_lora_rank=KV_RANK, qk_head_dim=QK, qk_pos_emb_head_dim=ROPE, v_head_dim=V,
        normalization="rmsnorm", layernorm_epsilon=1e-6, add_bias_linear=False, attention_dropout=0.0,
        init_method_std=0.2, rope_theta=10000.0, **over))


def _module(cfg):
    torch.manual_seed(0)
    mla = MLASelfAttention(cfg)
    with torch.no_grad():  # norms away from 1, so a missing norm would show
        for norm in (mla.q_layernorm, mla.kv_layernorm):
            if norm is not None:
                norm.weight.uniform_(0.5, 1.5)
    return mla.eval()


# ------------------------------------------------------------------ the paper's formulas
def _yarn_reference(dim, base, factor, mscale, mscale_all_dim, original=4096, beta_fast=32, beta_slow=1):
    """DeepSeek's DeepseekV2YarnRotaryEmbedding: (inverse frequencies, cos/sin multiplier)."""
    def correction_dim(rot):
        return (dim * math.log(original / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = max(math.floor(correction_dim(beta_fast)), 0), min(math.ceil(correction_dim(beta_slow)), dim - 1)
    extra = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    inter = 1.0 / (factor * base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 0.001)).clamp(0, 1)
    inv_freq = inter * ramp + extra * (1 - ramp)

    def get_mscale(scale, m):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
    return inv_freq, get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)


def _rope_pairs(t, inv_freq, attention_factor):
    """The paper's RoPE on channel pairs (2i, 2i+1): a complex rotation by position x frequency i."""
    angles = torch.arange(t.shape[-2], dtype=torch.float32)[:, None] * inv_freq  # [s, dim/2]
    rot = torch.polar(torch.full_like(angles, attention_factor), angles)
    return torch.view_as_real(torch.view_as_complex(t.reshape(*t.shape[:-1], -1, 2)) * rot).flatten(-2)


def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _paper_mla(mla, x, cfg):
    """Eq. 9-19 for ``x`` [b, s, h] with the module's weights, batch first, heads explicit."""
    b, s, _ = x.shape
    if cfg.q_lora_rank is None:
        q = x @ mla.linear_q_proj.weight.T
    else:
        c_q = _rms(x @ mla.linear_q_down_proj.weight.T, mla.q_layernorm.weight)  # eq. 12
        q = c_q @ mla.linear_q_up_proj.weight.T  # eq. 13-14 (W^UQ and W^QR stacked per head)
    q = q.view(b, s, HEADS, QK + ROPE).transpose(1, 2)
    down = x @ mla.linear_kv_down_proj.weight.T
    c_kv, k_r = _rms(down[..., :KV_RANK], mla.kv_layernorm.weight), down[..., KV_RANK:]  # eq. 9, 15
    kv = (c_kv @ mla.linear_kv_up_proj.weight.T).view(b, s, HEADS, QK + V).transpose(1, 2)  # eq. 10-11
    if (cfg.rope_type or "yarn") == "yarn":
        inv_freq, factor = _yarn_reference(ROPE, 10000.0, cfg.rotary_scaling_factor, cfg.mscale, cfg.mscale_all_dim)
    else:
        inv_freq, factor = 1.0 / 10000.0 ** (torch.arange(0, ROPE, 2, dtype=torch.float32) / ROPE), 1.0
    q_r = _rope_pairs(q[..., QK:], inv_freq, factor)  # eq. 14
    k_r = _rope_pairs(k_r[:, None], inv_freq, factor).expand(-1, HEADS, -1, -1)  # eq. 15: shared by the heads
    q, k, v = torch.cat((q[..., :QK], q_r), -1), torch.cat((kv[..., :QK], k_r), -1), kv[..., QK:]  # eq. 16-17
    mscale = 1.0 if cfg.rotary_scaling_factor <= 1 else 0.1 * cfg.mscale_all_dim * math.log(cfg.rotary_scaling_factor) + 1
    scores = q @ k.transpose(-1, -2) * mscale * mscale / math.sqrt(QK + ROPE)  # eq. 18, DeepSeek's softmax_scale
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, HEADS * V)
    return out @ mla.dense.weight.T  # eq. 19


@pytest.mark.parametrize("q_lora_rank", [None, 12])
@pytest.mark.parametrize("rope", [YARN, dict(rope_type="rope")], ids=["yarn", "rope"])
def test_matches_the_paper(q_lora_rank, rope):
    cfg = _cfg(q_lora_rank, **rope)
    mla = _module(cfg)
    x = torch.randn(BATCH, SEQ, H)
    with torch.no_grad():
        out, _ = mla(x.transpose(0, 1))
        torch.testing.assert_close(out.transpose(0, 1), _paper_mla(mla, x, cfg), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ transformers' DeepseekV3Attention
@pytest.mark.parametrize("q_lora_rank", [None, 12])
def test_matches_transformers_deepseek_v3(q_lora_rank):
    modeling = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
    from transformers import DeepseekV3Config

    cfg = _cfg(q_lora_rank, **YARN)
    mla = _module(cfg)
    hf_cfg = DeepseekV3Config(
        hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=HEADS, q_lora_rank=q_lora_rank,
        kv_lora_rank=KV_RANK, qk_nope_head_dim=QK, qk_rope_head_dim=ROPE, v_head_dim=V, rms_norm_eps=1e-6,
        attention_bias=False, max_position_embeddings=163840, rope_interleave=True,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096,
                             beta_fast=32.0, beta_slow=1.0, mscale=0.707, mscale_all_dim=0.707))
    hf_cfg._attn_implementation = "eager"
    hf = modeling.DeepseekV3Attention(hf_cfg, layer_idx=0).eval()
    names = {"o_proj": mla.dense, "kv_a_proj_with_mqa": mla.linear_kv_down_proj, "kv_a_layernorm": mla.kv_layernorm,
             "kv_b_proj": mla.linear_kv_up_proj}
    names.update({"q_proj": mla.linear_q_proj} if q_lora_rank is None else
                 {"q_a_proj": mla.linear_q_down_proj, "q_a_layernorm": mla.q_layernorm, "q_b_proj": mla.linear_q_up_proj})
    with torch.no_grad():
        for hf_name, ours in names.items():
            getattr(hf, hf_name).weight.copy_(ours.weight)
        x = torch.randn(BATCH, SEQ, H)
        position_ids = torch.arange(SEQ)[None].expand(BATCH, -1)
        cos_sin = modeling.DeepseekV3RotaryEmbedding(hf_cfg)(x, position_ids)
        mask = torch.zeros(SEQ, SEQ).masked_fill(torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1), float("-inf"))
        want, _ = hf(x, cos_sin, mask[None, None].expand(BATCH, 1, -1, -1))
        got, _ = mla(x.transpose(0, 1))
    torch.testing.assert_close(got.transpose(0, 1), want, rtol=1e-5, atol=1e-5)


def test_kv_cache_decoding_matches_the_full_forward():
    """The prompt, then one position at a time through the KV cache (values narrower than keys), gives the
    full sequence's outputs (inference/generate's use)."""
    mla = _module(_cfg(12, **YARN))
    x = torch.randn(SEQ, BATCH, H)
    with torch.no_grad():
        full, _ = mla(x)
        cache, prompt, steps = KVCache(SEQ), 5, []
        for start, stop in [(0, prompt)] + [(i, i + 1) for i in range(prompt, SEQ)]:
            cache.mask = torch.ones(stop - start, stop, dtype=torch.bool).tril(start)[None, None]
            out, _ = mla(x[start:stop], cache.mask, cache.layer(1))
            cache.advance(stop - start)
            steps.append(out)
    torch.testing.assert_close(torch.cat(steps), full, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ the GPT's flags, counts and refusals
def _run(*extra, world_size=1):
    from megatron_ds.config import parse_args, resolve
    from megatron_ds.families.gpt.gpt_family import GPT

    cfg, _ = parse_args(["--num-layers", "2", "--hidden-size", str(H), "--num-attention-heads", str(HEADS),
                         "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "1",
                         "--train-iters", "1", "--lr", "1e-3", "--mock-data", "--multi-latent-attention",
                         "--kv-lora-rank", str(KV_RANK), "--qk-head-dim", str(QK), "--qk-pos-emb-head-dim", str(ROPE),
                         "--v-head-dim", str(V), "--position-embedding-type", "rope", *extra])
    return resolve(cfg, world_size=world_size, vocab_size=64, family=GPT, ds_template={}, device_type="cpu")


@pytest.mark.parametrize("extra", [[], ["--q-lora-rank", "12", "--normalization", "rmsnorm", "--disable-bias-linear"]],
                         ids=["plain_query_layernorm", "query_latent_rmsnorm"])
def test_built_parameters_equal_the_count(extra):
    from megatron_ds.families.gpt.gpt_model import build_sequential_gpt

    run = _run(*extra)
    model = build_sequential_gpt(run.layout.model, padded_vocab_size=run.layout.padded_vocab_size, seed=1)
    assert sum(p.numel() for p in model.parameters()) == run.layout.total_params


def test_each_stage_and_tp_rank_holds_the_counted_parameters():
    """TP 2 x PP 2: the up projections and the output projection split over heads, the down projections and
    the latents' norms whole on each rank (and not marked tensor parallel: gradient norms count them once)."""
    from megatron_ds import ds_compat
    from megatron_ds.families.gpt.gpt_model import build_stage_gpt
    from megatron_ds.training.engine import model_kwargs

    run = _run("--q-lora-rank", "12", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
               world_size=4)
    lay = run.layout
    with ds_compat.fake_process_group(2, 0) as tp_group:
        for stage in lay.stages:
            model = build_stage_gpt(lay.model, num_stages=2, stage=stage.stage,
                                    **model_kwargs(run, tp_group, 0, device="cpu"))
            assert sum(p.numel() for p in model.parameters()) == stage.params_per_tp_rank
            params = {n.split(".", 1)[1]: p for n, p in model.named_parameters() if "self_attention" in n}
            shapes = {n: tuple(p.shape) for n, p in params.items()}
            assert shapes["self_attention.linear_q_down_proj.weight"] == (12, H)
            assert shapes["self_attention.linear_q_up_proj.weight"] == (HEADS // 2 * (QK + ROPE), 12)
            assert shapes["self_attention.linear_kv_down_proj.weight"] == (KV_RANK + ROPE, H)
            assert shapes["self_attention.linear_kv_up_proj.weight"] == (HEADS // 2 * (QK + V), KV_RANK)
            assert shapes["self_attention.dense.weight"] == (H, HEADS // 2 * V)
            assert not params["self_attention.linear_kv_down_proj.weight"].tensor_model_parallel
            assert params["self_attention.linear_kv_up_proj.weight"].tensor_model_parallel


def test_dry_run_names_it():
    summary = _run("--q-lora-rank", "12", "--rotary-scaling-factor", "40", "--mscale", "0.707",
                   "--mscale-all-dim", "0.707").describe()
    assert "multi-latent attention (q rank 12, kv rank 10, head dims qk 8 + rope 8, v 6; YaRN x40 (mscale 0.707, " \
           "all dim 0.707))" in summary


@pytest.mark.parametrize("extra,says", [
    (["--num-key-value-heads", "2"], "--group-query-attention / --num-key-value-heads"),
    (["--qk-layernorm"], "--qk-layernorm"),
    (["--use-rope-scaling"], "--use-rope-scaling"),
    (["--rotary-percent", "0.5"], "--rotary-percent other than 1"),
    (["--fp8-format", "hybrid"], "FP8"),
    (["--ds-sequence-parallel-size", "2", "--no-pipeline-parallel"], "DeepSpeed-Ulysses"),
])
def test_what_it_does_not_read_is_refused_in_one_line(extra, says):
    from megatron_ds.errors import ConfigError

    with pytest.raises(ConfigError, match=f"--multi-latent-attention does not support .*{says}.*; drop it"):
        _run(*extra, world_size=2)


def test_yarn_without_it_and_other_families_are_refused():
    from megatron_ds.config import parse_args, resolve
    from megatron_ds.errors import ConfigError
    from megatron_ds.families.bert.bert_family import BERT
    from megatron_ds.families.gpt.gpt_family import GPT

    base = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--max-position-embeddings", "16", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3",
            "--mock-data"]
    with pytest.raises(ConfigError, match="--rope-type yarn applies to --multi-latent-attention only"):
        resolve(parse_args(base + ["--rope-type", "yarn"])[0], world_size=1, vocab_size=64, family=GPT,
                ds_template={}, device_type="cpu")
    with pytest.raises(ConfigError, match="pretrain_bert.py cannot run with .*--multi-latent-attention"):
        resolve(parse_args(base + ["--multi-latent-attention"])[0], world_size=1, vocab_size=64, family=BERT,
                ds_template={}, device_type="cpu")


def test_compiled_layers_equal_eager():
    """--compile-layers (aot_eager: dynamo and AOTAutograd as inductor runs them, without building C++): one
    graph per layer, the YaRN tables entering it as inputs, and a step's loss and gradients are eager's."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from megatron_ds.families.gpt.gpt_model import build_sequential_gpt
    from megatron_ds.model import compile_layers as cl
    from tests.model.test_compile_layers import SEQ as COMPILE_SEQ
    from tests.model.test_compile_layers import TOL, VOCAB, graphs_and_breaks, one_step

    cfg = resolve_model_config(ModelConfig(
        num_layers=2, hidden_size=H, num_attention_heads=HEADS, seq_length=COMPILE_SEQ, multi_latent_attention=True,
        q_lora_rank=12, kv_lora_rank=KV_RANK, qk_head_dim=QK, qk_pos_emb_head_dim=ROPE, v_head_dim=V,
        position_embedding_type="rope", hidden_dropout=0.0, attention_dropout=0.0, fusions_on_cpu=True, **YARN))
    kw = dict(padded_vocab_size=VOCAB, seed=7)
    ref_loss, ref_grads = one_step(build_sequential_gpt(cfg, **kw))
    assert graphs_and_breaks(build_sequential_gpt(cfg, **kw)) == (1, 0)
    torch._dynamo.reset()
    model = build_sequential_gpt(cfg, **kw)
    assert cl.compile_layers(model, backend=CompileCounterWithBackend("aot_eager")) == cfg.num_layers
    loss, grads = one_step(model)
    torch.testing.assert_close(loss, ref_loss, **TOL)
    for n, g in grads.items():
        torch.testing.assert_close(g, ref_grads[n], **TOL, msg=lambda m, n=n: f"grad {n}: {m}")


def test_kv_channels_is_said_to_be_unread():
    from megatron_ds.config import parse_args
    from megatron_ds.config.layout import build_layout
    from megatron_ds.families.gpt.gpt_family import GPT

    cfg, _ = parse_args(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
                         "--max-position-embeddings", "16", "--micro-batch-size", "1", "--train-iters", "1", "--lr",
                         "1e-3", "--mock-data", "--multi-latent-attention", "--kv-channels", "128"])
    _, notes = build_layout(cfg, 1, vocab_size=64, template={}, family=GPT, device_type="cpu")
    assert any(n.startswith("--kv-channels 128 is not read by --multi-latent-attention") for n in notes)
