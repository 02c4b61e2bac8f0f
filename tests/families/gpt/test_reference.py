"""The GPT model (TP = 1, one process) against a dense GPT written here from the math.

The reference uses none of the model's code: explicit softmax attention with a boolean mask,
norms/GeLU/SiLU from their formulas, rotary embeddings as complex rotations, per-head Q/K/V
matrices cut out of the fused projection, and a log-sum-exp loss. Its weights are differentiable
views of the model's parameters, so one autograd call gives reference gradients on the very same
tensors. The Llama-style model is also checked against Hugging Face's LlamaForCausalLM, which pins
the rotary convention and the grouping of query heads onto key/value heads to the common standard.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from megatron_ds.config.layout import resolve_model_config
from megatron_ds.config.schema import ModelConfig
from megatron_ds.families.gpt.gpt_model import build_sequential_gpt, gpt_layer_specs
from megatron_ds.families.gpt.gpt_params import count_gpt_parameters
from megatron_ds.model.kernels import describe_kernels
from megatron_ds.model.language_model import document_ids
from megatron_ds.parallel.random import set_parallel_seeds

VOCAB = 96  # padded vocabulary
SEQ = 12
EOD = 0

# fp32 throughout; model and reference sum the same products in different orders (fused QKV vs
# per-head matmuls, SDPA vs explicit softmax, rotate-half vs complex multiply), so they agree to a
# few ulps of the largest intermediate (activations O(1), 2-3 layers deep): 1e-5 absolute/relative
# is ~100 ulps of headroom and still far below any real bug (wrong layout/mask/scale is O(0.1)).
TOL = dict(rtol=1e-5, atol=1e-5)


def gpt2_config(**over) -> ModelConfig:
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=SEQ,
                      max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0,
                      init_method_std=0.2)  # large std: attention far from uniform, so layout bugs show
    return resolve_model_config(dataclasses.replace(cfg, **over))


def llama_config(**over) -> ModelConfig:
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                      ffn_hidden_size=48, seq_length=SEQ, use_rotary_position_embeddings=True,
                      rope_theta=500.0, swiglu=True, normalization="rmsnorm", add_bias_linear=False,
                      untie_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0,
                      init_method_std=0.2)
    return resolve_model_config(dataclasses.replace(cfg, **over))


def batch(seed: int = 0, eod_every: int | None = None):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, VOCAB - 10, (2, SEQ), generator=g)  # below VOCAB: padded ids stay unused
    if eod_every:
        tokens[0, 3::eod_every] = EOD
        tokens[1, 5] = EOD
    labels = torch.randint(1, VOCAB - 10, (2, SEQ), generator=g)
    loss_mask = (torch.rand(2, SEQ, generator=g) > 0.2).float()
    position_ids = torch.arange(SEQ).expand(2, SEQ)
    return tokens, position_ids, labels, loss_mask


# ----------------------------------------------------------------------------- dense reference


def _norm(x, w, b, kind, eps):
    if kind == "layernorm":
        mean = x.mean(-1, keepdim=True)
        var = ((x - mean) ** 2).mean(-1, keepdim=True)
        return (x - mean) / torch.sqrt(var + eps) * w + b
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _rope(x, rot, theta):
    """x [b, s, heads, d]: rotate channel pairs (i, i + rot/2), i < rot/2, by angle pos * theta^(-2i/rot)."""
    s = x.shape[1]
    half = rot // 2
    freq = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / rot)
    angle = torch.arange(s, dtype=torch.float64)[:, None] * freq[None, :]
    z = torch.complex(x[..., :half].double(), x[..., half:rot].double())
    z = z * torch.polar(torch.ones_like(angle), angle)[None, :, None, :]
    return torch.cat([z.real.to(x.dtype), z.imag.to(x.dtype), x[..., rot:]], dim=-1)


def _megatron_mask(tokens, reset_attention_mask):
    """[b, s, s] bool, True = may attend: causal, and (with reset) nothing before an EOD's successor
    may see up to that EOD (Megatron's get_ltor_masks_and_position_ids, as a loop)."""
    b, s = tokens.shape
    allowed = torch.ones(b, s, s, dtype=torch.bool).tril()
    if reset_attention_mask:
        for i in range(b):
            for pos in (tokens[i] == EOD).nonzero().flatten().tolist():
                allowed[i, pos + 1:, :pos + 1] = False
    return allowed


def dense_weights(model, cfg: ModelConfig) -> dict:
    """Per-layer dense matrices as views of the model's parameters (by state-dict name)."""
    p = dict(model.named_parameters())
    tied = not cfg.untie_embeddings_and_output_weights
    emb = "tied_modules.embed." if tied else "0."
    nq, nkv, d, h = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.kv_channels, cfg.hidden_size
    qpg = nq // nkv
    w = {"wte": p[emb + "word_embeddings.weight"], "layers": []}
    if cfg.position_embedding_type == "learned_absolute":
        w["wpe"] = p[emb + "position_embeddings.weight"]
    for i in range(1, cfg.num_layers + 1):
        g = lambda name: p.get(f"{i}.{name}")  # noqa: E731
        qkv = g("self_attention.query_key_value.weight").view(nkv, qpg + 2, d, h)
        qkv_b = g("self_attention.query_key_value.bias")
        qkv_b = None if qkv_b is None else qkv_b.view(nkv, qpg + 2, d)
        layer = {
            "ln1": (g("input_layernorm.weight"), g("input_layernorm.bias")),
            "ln2": (g("post_attention_layernorm.weight"), g("post_attention_layernorm.bias")),
            "wq": qkv[:, :qpg].reshape(nq * d, h), "wk": qkv[:, qpg].reshape(nkv * d, h),
            "wv": qkv[:, qpg + 1].reshape(nkv * d, h),
            "bq": None if qkv_b is None else qkv_b[:, :qpg].reshape(-1),
            "bk": None if qkv_b is None else qkv_b[:, qpg].reshape(-1),
            "bv": None if qkv_b is None else qkv_b[:, qpg + 1].reshape(-1),
            "wo": g("self_attention.dense.weight"), "bo": g("self_attention.dense.bias"),
            "w1": g("mlp.dense_h_to_4h.weight"), "b1": g("mlp.dense_h_to_4h.bias"),
            "w2": g("mlp.dense_4h_to_h.weight"), "b2": g("mlp.dense_4h_to_h.bias"),
        }
        w["layers"].append(layer)
    n = cfg.num_layers + 1
    w["lnf"] = (p[f"{n}.final_layernorm.weight"], p.get(f"{n}.final_layernorm.bias"))
    w["wout"] = w["wte"] if tied else p[f"{n + 1}.output_layer.weight"]
    return w


def _linear(x, weight, bias):
    y = x @ weight.t()
    return y if bias is None else y + bias


def dense_gpt(w, cfg: ModelConfig, tokens, position_ids, labels, loss_mask, reset_attention_mask=False):
    """Logits [b, s, V] and mean masked loss of a GPT, from the math."""
    b, s = tokens.shape
    nq, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.kv_channels
    kind, eps = cfg.normalization, cfg.layernorm_epsilon
    if cfg.apply_layernorm_1p and kind == "layernorm":  # Megatron's LayerNorm(apply_layernorm_1p): 1 + weight
        norm = lambda x, wb: _norm(x, wb[0] + 1, wb[1], kind, eps)  # noqa: E731
    else:
        norm = lambda x, wb: _norm(x, *wb, kind, eps)  # noqa: E731
    post = cfg.apply_residual_connection_post_layernorm  # residual = the norm's output (Megatron's layer)
    x = w["wte"][tokens]
    if "wpe" in w:
        x = x + w["wpe"][position_ids]
    allowed = _megatron_mask(tokens, reset_attention_mask)[:, None]  # [b, 1, s, s]
    kv_of_head = torch.arange(nq) // (nq // nkv)
    for L in w["layers"]:
        y = norm(x, L["ln1"])
        q = _linear(y, L["wq"], L["bq"]).view(b, s, nq, d)
        k = _linear(y, L["wk"], L["bk"]).view(b, s, nkv, d)
        v = _linear(y, L["wv"], L["bv"]).view(b, s, nkv, d)
        if cfg.position_embedding_type == "rope":
            rot = int(d * cfg.rotary_percent)
            q, k = _rope(q, rot, cfg.rope_theta), _rope(k, rot, cfg.rope_theta)
        k, v = k[:, :, kv_of_head], v[:, :, kv_of_head]
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        ctx = torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, nq * d)
        x = (y if post else x) + _linear(ctx, L["wo"], L["bo"])
        y = norm(x, L["ln2"])
        z = _linear(y, L["w1"], L["b1"])
        if cfg.swiglu:
            gate, up = z.split(cfg.ffn_hidden_size, dim=-1)  # TP = 1 layout: [gate; up]
            a = gate * torch.sigmoid(gate) * up
        elif cfg.openai_gelu:  # Megatron's openai_gelu / GPT-2's gelu_new
            a = 0.5 * z * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (z + 0.044715 * z ** 3)))
        elif cfg.squared_relu:
            a = torch.where(z > 0, z * z, torch.zeros_like(z))
        else:
            a = 0.5 * z * (1.0 + torch.erf(z / math.sqrt(2.0)))
        x = (y if post else x) + _linear(a, L["w2"], L["b2"])
    x = norm(x, w["lnf"])
    logits = x @ w["wout"].t()
    nll = torch.logsumexp(logits, -1) - logits.gather(-1, labels[..., None])[..., 0]
    return logits, (nll * loss_mask).sum() / loss_mask.sum()


# ----------------------------------------------------------------------------- tests


def _model_and_reference(cfg, reset_attention_mask=False, **batch_kw):
    set_parallel_seeds(1234, 0)
    model = build_sequential_gpt(cfg, padded_vocab_size=VOCAB, seed=7, reset_attention_mask=reset_attention_mask,
                                 eod_token=EOD if reset_attention_mask else None)
    tokens, position_ids, labels, loss_mask = batch(**batch_kw)
    logits = model((tokens, position_ids))
    loss = model.loss_fn(logits, (labels, loss_mask))
    params = [p for p in model.parameters()]
    grads = torch.autograd.grad(loss, params)
    ref_logits, ref_loss = dense_gpt(dense_weights(model, cfg), cfg, tokens, position_ids, labels, loss_mask,
                                     reset_attention_mask)
    ref_grads = torch.autograd.grad(ref_loss, params, allow_unused=True)
    return model, (logits, loss, grads), (ref_logits, ref_loss, ref_grads)


@pytest.mark.parametrize("style,cfg,reset", [
    ("gpt2", gpt2_config(), False),
    ("gpt2-reset-attention-mask", gpt2_config(), True),
    ("gpt2-no-positions-untied", gpt2_config(position_embedding_type="none",
                                             untie_embeddings_and_output_weights=True), False),
    ("llama", llama_config(), False),
    ("llama-partial-rotary-mha-reset", llama_config(rotary_percent=0.5, num_key_value_heads=4), True),
    # Megatron-DeepSpeed's variants
    ("gpt2-openai-gelu", gpt2_config(openai_gelu=True), False),
    ("gpt2-squared-relu", gpt2_config(squared_relu=True), False),
    ("gpt2-layernorm-1p", gpt2_config(apply_layernorm_1p=True), False),
    ("gpt2-post-layernorm-residual", gpt2_config(apply_residual_connection_post_layernorm=True), False),
    ("llama-post-layernorm-residual-1p", llama_config(apply_residual_connection_post_layernorm=True,
                                                      apply_layernorm_1p=True), False),  # 1p: LayerNorm only
])
def test_model_matches_dense_reference(style, cfg, reset):
    model, (logits, loss, grads), (ref_logits, ref_loss, ref_grads) = _model_and_reference(
        cfg, reset_attention_mask=reset, eod_every=4 if reset else None)
    assert logits.shape == (2, SEQ, VOCAB)
    torch.testing.assert_close(logits, ref_logits, **TOL)
    torch.testing.assert_close(loss, ref_loss, **TOL)
    for (name, _), g, rg in zip(model.named_parameters(), grads, ref_grads):
        assert rg is not None, f"{name} does not take part in the reference"
        torch.testing.assert_close(g, rg, **TOL, msg=lambda m: f"{style} grad of {name}: {m}")


def test_reset_attention_mask_changes_the_output():
    """Guard for the test above: the EOD tokens must actually cut attention (else reset would be
    vacuously equal)."""
    cfg = gpt2_config()
    tokens, position_ids, _, _ = batch(eod_every=4)
    outs = []
    for reset in (False, True):
        model = build_sequential_gpt(cfg, padded_vocab_size=VOCAB, seed=7, reset_attention_mask=reset,
                                     eod_token=EOD if reset else None)
        outs.append(model((tokens, position_ids)))
    assert (outs[0] - outs[1]).abs().max() > 1e-2
    torch.testing.assert_close(outs[0][:, :4], outs[1][:, :4], **TOL)  # first document: nothing to cut


def test_document_ids_follow_megatron_semantics():
    tokens = torch.tensor([[5, EOD, 7, 8, EOD, EOD, 9]])
    # An EOD belongs to the document it ends.
    assert document_ids(tokens, EOD).tolist() == [[0, 0, 1, 1, 1, 2, 3]]


def test_llama_style_matches_huggingface_llama():
    transformers = pytest.importorskip("transformers")
    cfg = llama_config()
    model = build_sequential_gpt(cfg, padded_vocab_size=VOCAB, seed=7)
    hf_cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, max_position_embeddings=64, rms_norm_eps=cfg.layernorm_epsilon,
        rope_theta=cfg.rope_theta, tie_word_embeddings=False, attention_bias=False, mlp_bias=False)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    hf.config._attn_implementation = "eager"
    w = dense_weights(model, cfg)
    sd = {"model.embed_tokens.weight": w["wte"], "model.norm.weight": w["lnf"][0], "lm_head.weight": w["wout"]}
    for i, L in enumerate(w["layers"]):
        pre = f"model.layers.{i}."
        gate, up = L["w1"].split(cfg.ffn_hidden_size, dim=0)
        sd.update({pre + "self_attn.q_proj.weight": L["wq"], pre + "self_attn.k_proj.weight": L["wk"],
                   pre + "self_attn.v_proj.weight": L["wv"], pre + "self_attn.o_proj.weight": L["wo"],
                   pre + "mlp.gate_proj.weight": gate, pre + "mlp.up_proj.weight": up,
                   pre + "mlp.down_proj.weight": L["w2"], pre + "input_layernorm.weight": L["ln1"][0],
                   pre + "post_attention_layernorm.weight": L["ln2"][0]})
    missing, unexpected = hf.load_state_dict({k: v.detach().clone() for k, v in sd.items()}, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    tokens, position_ids, _, _ = batch()
    with torch.no_grad():
        ours = model.eval()((tokens, position_ids))
        theirs = hf(input_ids=tokens).logits
    torch.testing.assert_close(ours, theirs, **TOL)


def _grads_after_step(cfg, recompute_granularity=None, interval=0):
    set_parallel_seeds(99, 0)
    model = build_sequential_gpt(cfg, padded_vocab_size=VOCAB, seed=7, recompute_granularity=recompute_granularity,
                                 activation_checkpoint_interval=interval)
    set_parallel_seeds(1234, 0)  # the dropout streams, identical for every variant
    tokens, position_ids, labels, loss_mask = batch()
    loss = model.loss_fn(model((tokens, position_ids)), (labels, loss_mask))
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("cfg", [gpt2_config(hidden_dropout=0.2, attention_dropout=0.2),
                                 llama_config(hidden_dropout=0.2, attention_dropout=0.2, num_layers=3)],
                         ids=["gpt2", "llama"])
def test_recompute_gives_bitwise_identical_gradients(cfg):
    """Dropout is on (attention dropout from the tensor parallel stream, hidden dropout from the
    default one); recompute replays both, so the gradients must be bit for bit the same."""
    base_loss, base = _grads_after_step(cfg)
    no_dropout_loss, _ = _grads_after_step(dataclasses.replace(cfg, hidden_dropout=0.0, attention_dropout=0.0))
    assert base_loss != no_dropout_loss  # dropout really is active
    for variant in (dict(recompute_granularity="selective"), dict(interval=1), dict(interval=2),
                    dict(recompute_granularity="selective", interval=1)):
        loss, grads = _grads_after_step(cfg, **variant)
        assert torch.equal(loss, base_loss), variant
        for name, g in grads.items():
            assert torch.equal(g, base[name]), (variant, name)


def test_initialization():
    """Same seed, same weights; each layer's weights depend only on its index and the seed; std as
    configured, output projections of each block scaled by 1/sqrt(2 * num_layers)."""
    cfg = gpt2_config(num_layers=4, hidden_size=64, init_method_std=0.02)
    a = build_sequential_gpt(cfg, padded_vocab_size=VOCAB, seed=5).state_dict()
    b = build_sequential_gpt(cfg, padded_vocab_size=VOCAB, seed=5).state_dict()
    c = build_sequential_gpt(cfg, padded_vocab_size=VOCAB, seed=6).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["1.self_attention.query_key_value.weight"], c["1.self_attention.query_key_value.weight"])
    # seed + layer index: layer 2 of seed 5 is layer 1 of seed 6
    assert torch.equal(a["2.mlp.dense_h_to_4h.weight"], c["1.mlp.dense_h_to_4h.weight"])
    # Sample std of thousands of N(0, std) draws is within a few percent of std.
    assert a["1.mlp.dense_h_to_4h.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    assert a["1.mlp.dense_4h_to_h.weight"].std().item() == pytest.approx(0.02 / math.sqrt(8), rel=0.05)
    assert a["1.self_attention.dense.weight"].std().item() == pytest.approx(0.02 / math.sqrt(8), rel=0.1)
    assert torch.equal(a["1.input_layernorm.weight"], torch.ones(64))
    assert torch.equal(a["1.mlp.dense_h_to_4h.bias"], torch.zeros(4 * 64))


@pytest.mark.parametrize("cfg", [gpt2_config(num_layers=4), llama_config(num_layers=4)], ids=["gpt2", "llama"])
@pytest.mark.parametrize("pp", [1, 2, 4])
@pytest.mark.parametrize("method", [None, "type:ParallelTransformerLayer", "uniform", "parameters"])
def test_stage_parameter_counts_match_analytic_count(cfg, pp, method):
    """Two independent computations: counting the built modules (as DeepSpeed partitions them)
    and the closed-form count of megatron_ds.config.layout, for DeepSpeed's partition methods
    (None: num_layers / pp transformer layers per stage, what the default type: method gives)."""
    model = build_sequential_gpt(cfg, padded_vocab_size=VOCAB, seed=1)
    _, stages = count_gpt_parameters(cfg, VOCAB, 1, pp, method)
    assert model.stage_parameter_counts(pp, *([method] if method else [])) == [s.params_per_tp_rank for s in stages]
    if pp == 1:
        assert model.stage_parameter_counts(1) == [sum(p.numel() for p in model.parameters())]


def test_configuration_errors_are_one_line_messages():
    with pytest.raises(ValueError, match="eod_token"):
        gpt_layer_specs(gpt2_config(), padded_vocab_size=VOCAB, reset_attention_mask=True)
    with pytest.raises(ValueError, match="resolve_model_config"):
        gpt_layer_specs(ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=SEQ),
                        padded_vocab_size=VOCAB)
    with pytest.raises(ValueError, match="num_key_value_heads 3"):
        gpt_layer_specs(llama_config(num_key_value_heads=3), padded_vocab_size=VOCAB)
    with pytest.raises(ValueError, match="rotary"):
        build_sequential_gpt(llama_config(rotary_percent=0.4), padded_vocab_size=VOCAB, seed=1)


def test_describe_kernels_names_every_piece():
    kernels = describe_kernels()
    assert set(kernels) == {"layernorm", "rmsnorm", "attention", "grouped_query_attention", "elementwise fusions",
                            "output layer + loss", "cross_entropy"}
    assert all(isinstance(v, str) and v for v in kernels.values())


@pytest.mark.parametrize("cfg", [gpt2_config(), llama_config()], ids=["gpt2", "llama"])
def test_bf16_model_tracks_fp32(cfg):
    """DeepSpeed's bf16 mode casts the whole module; rotary tables, norms, attention and the loss
    must cope. bf16 keeps 8 mantissa bits (relative step 2^-8 = 0.4%); rounding weights and every
    activation through two layers leaves the logits within a few percent of the largest logit,
    so 3% of it separates that from breakage (a wrong rotary table or norm is off by O(1))."""
    set_parallel_seeds(1234, 0)
    model = build_sequential_gpt(cfg, padded_vocab_size=VOCAB, seed=7)
    tokens, position_ids, labels, loss_mask = batch()
    ref = model((tokens, position_ids)).detach()
    model.to(torch.bfloat16)
    logits = model((tokens, position_ids))
    assert logits.dtype == torch.bfloat16
    loss = model.loss_fn(logits, (labels, loss_mask))
    loss.backward()
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    error = (logits.float() - ref).abs().max() / ref.abs().max()
    assert error < 0.03, error
