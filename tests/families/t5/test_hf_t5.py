"""Our T5 <-> Hugging Face's T5ForConditionalGeneration (families/t5/t5_hf.py), both directions.

Export: our T5 in the variant HF's code can compute (relative position biases or none, RMS norms,
no biases; GeLU, --openai-gelu, --swiglu, --squared-relu, --relu or --geglu MLP), written as safetensors +
config.json and read back by transformers' own ``from_pretrained``: its logits equal ours on a
padded batch.
Import: transformers builds a T5 from a T5Config (its own initialisation, random relative position
bias tables, non-default bucket count and distance so that a wrong bucket shows), converted into our
model: our logits equal HF's, with HF's ``scale_decoder_outputs`` folded into the decoder's final
norm. What HF cannot express (or what ours cannot) is refused in one line.

Tolerance 1e-5 absolute on logits of size ~1-10 in fp32: the two models sum the same products in
different orders (fused vs separate q/k/v, SDPA vs matmul-softmax) and one side multiplies the
query by 1/sqrt(d_kv) where the other divides the scores; that is ~1e-7 relative per operation
over a few layers. A wrong mapping (a swapped head, a missing scale) moves logits by 1e-2 or more.
"""
import dataclasses

import pytest
import torch

from megatron_ds.config.schema import ModelConfig
from megatron_ds.errors import ConfigError
from megatron_ds.families.t5 import t5_hf
from megatron_ds.families.t5.t5_model import build_sequential_t5

transformers = pytest.importorskip("transformers")

VOCAB, PADDED = 61, 64
ATOL = 1e-5  # see the module docstring


def _variant(**kw) -> ModelConfig:
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=4, ffn_hidden_size=48,
                kv_channels=8, seq_length=12, max_position_embeddings=None, position_embedding_type="none",
                normalization="rmsnorm", add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
                layernorm_epsilon=1e-6)
    base.update(kw)
    return ModelConfig(**base)


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    enc = torch.randint(2, VOCAB, (2, 12), generator=g)
    dec = torch.randint(2, VOCAB, (2, 7), generator=g)
    ef = torch.ones(2, 12, dtype=torch.long)
    ef[1, 9:] = 0
    df = torch.ones(2, 7, dtype=torch.long)
    df[0, 5:] = 0
    return enc * ef, dec * df, ef, df


def _ours(m, decoder_layers=3):
    model = build_sequential_t5(m, decoder_num_layers=decoder_layers, padded_vocab_size=PADDED, seed=7,
                                vocab_size=VOCAB).eval()
    with torch.no_grad():  # norms start at one, bias tables at 0.02: make them matter
        for name, p in model.named_parameters():
            if "layernorm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            if "relative_attention_bias" in name:
                p.normal_(0, 1.0)
    return model


def _hf_logits(hf, enc, dec, ef, df):
    with torch.no_grad():
        return hf(input_ids=enc, attention_mask=ef, decoder_input_ids=dec, decoder_attention_mask=df).logits


@pytest.mark.parametrize("act", [{}, {"swiglu": True}, {"openai_gelu": True}, {"squared_relu": True},
                                 {"relu": True, "position_embedding_type": "relative"},
                                 {"geglu": True, "position_embedding_type": "relative",
                                  "relative_attention_num_buckets": 8, "relative_attention_max_distance": 10}])
def test_export_gives_our_logits(tmp_path, act):
    m = _variant(**act)
    model = _ours(m)
    tensors = t5_hf.to_hf(model.state_dict(), m, decoder_num_layers=3, vocab_size=VOCAB)
    t5_hf.write_hf(str(tmp_path), tensors, t5_hf.hf_config(m, decoder_num_layers=3, vocab_size=VOCAB))
    hf = transformers.T5ForConditionalGeneration.from_pretrained(str(tmp_path)).eval()
    batch = _batch()
    with torch.no_grad():
        ours = model(batch)[..., :VOCAB]
    theirs = _hf_logits(hf, *batch)
    real = batch[3].bool()  # padding positions' logits are nobody's business (no loss there)
    assert torch.allclose(ours[real], theirs[real], atol=ATOL, rtol=0), (ours[real] - theirs[real]).abs().max()
    assert ours.abs().max() > 0.1  # not trivially equal


@pytest.mark.parametrize("proj,tie", [("gated-silu", None), ("gelu", False), ("relu", None), ("gated-gelu", None)])
def test_hf_model_imports_with_its_logits(proj, tie):
    """Buckets 8 / max distance 10 over 12 encoder positions: exact, logarithmic and clamped buckets
    all occur in both directions (HF's defaults 32 / 128 would leave these lengths all exact)."""
    extra = {} if tie is None else {"tie_word_embeddings": tie}
    cfg = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=3,
                                num_heads=4, feed_forward_proj=proj, dropout_rate=0.0, relative_attention_num_buckets=8,
                                relative_attention_max_distance=10, **extra)
    torch.manual_seed(3)
    hf = transformers.T5ForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # HF initialises the tables at std d_model^-0.5: make the biases large
        for block in (hf.encoder.block[0], hf.decoder.block[0]):
            block.layer[0].SelfAttention.relative_attention_bias.weight.normal_(0, 1.0)
    d = cfg.to_dict()
    state = {k: v.float() for k, v in hf.state_dict().items()}
    ours_state = t5_hf.from_hf(lambda n: state[n], d, padded_vocab_size=PADDED)
    m, decoder_layers = t5_hf.model_config_from_hf(d)
    model = build_sequential_t5(dataclasses.replace(m, seq_length=12), decoder_num_layers=decoder_layers,
                                padded_vocab_size=PADDED, seed=1, vocab_size=VOCAB).eval()
    model.load_state_dict(ours_state, strict=True)
    batch = _batch(1)
    with torch.no_grad():
        ours = model(batch)[..., :VOCAB]
    theirs = _hf_logits(hf, *batch)
    real = batch[3].bool()
    assert torch.allclose(ours[real], theirs[real], atol=ATOL, rtol=0), (ours[real] - theirs[real]).abs().max()


def test_what_hf_cannot_express_is_refused():
    with pytest.raises(ConfigError, match="relative position buckets"):
        t5_hf.check_representable(_variant(position_embedding_type="learned_absolute", max_position_embeddings=12))
    with pytest.raises(ConfigError, match="RMS"):
        t5_hf.check_representable(_variant(normalization="layernorm"))
    with pytest.raises(ConfigError, match="--disable-bias-linear"):
        t5_hf.check_representable(_variant(add_bias_linear=True))
    with pytest.raises(ConfigError, match="'gated-relu' MLP"):
        t5_hf.model_config_from_hf(transformers.T5Config(feed_forward_proj="gated-relu").to_dict())


def test_relative_position_bucket_is_hfs():
    """Our transcription against transformers' own ``T5Attention._relative_position_bucket``."""
    from transformers.models.t5.modeling_t5 import T5Attention

    from megatron_ds.families.t5.t5_model import relative_position_bucket

    position = torch.arange(300)[None, :] - torch.arange(300)[:, None]
    for bidirectional in (True, False):
        for buckets, distance in ((32, 128), (8, 10), (16, 40)):
            ours = relative_position_bucket(position, bidirectional=bidirectional, num_buckets=buckets,
                                            max_distance=distance)
            theirs = T5Attention._relative_position_bucket(position, bidirectional=bidirectional,
                                                           num_buckets=buckets, max_distance=distance)
            assert torch.equal(ours, theirs), (bidirectional, buckets, distance)
