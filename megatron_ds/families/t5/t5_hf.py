"""Our T5 (``families/t5/t5_model.py``) to and from Hugging Face's ``T5ForConditionalGeneration``.

Megatron's T5 and HF's T5 are different models; the mapping is exact only for the variant HF's
code can compute, and anything else is refused in one line naming what HF cannot express:

=============================  =====================================  ===============================
Megatron-DeepSpeed's T5         HF T5 (transformers modeling_t5)       what is exported / imported
=============================  =====================================  ===============================
learned absolute positions      relative position buckets (layer 0)    --position-embedding-type
                                                                        relative <-> the bucket tables
                                                                        (none <-> all-zero tables)
LayerNorm (with bias)           T5LayerNorm: RMS, no bias, fp32 stats  --normalization rmsnorm
biases in every linear and the  no biases                              --disable-bias-linear (our LM
LM head (T5LMHead)                                                      head then has no bias either)
GeLU MLP                        relu, gelu, gelu_new, gated-ACT        gelu <-> "gelu", --openai-gelu
                                                                        <-> "gelu_new", --swiglu <->
                                                                        "gated-silu", --squared-relu
                                                                        <-> "relu2", --relu <-> "relu",
                                                                        --geglu <-> "gated-gelu"
scores / sqrt(d_kv)             unscaled scores                        query weights x / sqrt(d_kv)
tied LM head                    decoder output x d_model^-0.5 when     exported with
                                scale_decoder_outputs                  scale_decoder_outputs false;
                                                                        imported scale folded into
                                                                        the decoder's final norm
=============================  =====================================  ===============================

HF's T5 models import with --position-embedding-type relative (their bucket count and maximum
distance); the position-free variant (the decoder's causal mask alone) exports with zero tables.
Parameter names (ours, from ``t5_layer_specs``): spec 0 and the tied module ``tied_modules.embed``,
encoder layers ``1..E``, encoder final norm ``E+1``, decoder layers ``E+3..E+2+D``, decoder final
norm ``E+D+3``.
"""
from __future__ import annotations

import math

import torch

from megatron_ds.config.family import ModelFamily
from megatron_ds.config.schema import ModelConfig
from megatron_ds.errors import ConfigError

_ACTIVATIONS = {"gelu": "gelu", "openai_gelu": "gelu_new", "swiglu": "gated-silu", "squared_relu": "relu2",
                "relu": "relu", "geglu": "gated-gelu"}
_EMBED = "tied_modules.embed."


def activation(m: ModelConfig) -> str:
    return ("swiglu" if m.swiglu else "openai_gelu" if m.openai_gelu else
            "squared_relu" if m.squared_relu else "relu" if m.relu else "geglu" if m.geglu else "gelu")


def check_representable(m: ModelConfig) -> None:
    """ConfigError naming the first setting HF's T5 cannot compute."""
    problems = [
        (m.position_embedding_type not in ("none", "relative"),
         "learned absolute positions (HF's T5 has only relative position buckets): train with "
         "--position-embedding-type relative (or none)"),
        (m.normalization.lower() != "rmsnorm", "LayerNorm with a bias (HF's T5LayerNorm is an RMS norm): train "
                                               "with --normalization rmsnorm"),
        (m.add_bias_linear, "biases in the linear layers and the LM head (HF's T5 has none): train with "
                            "--disable-bias-linear"),
        (m.num_key_value_heads != m.num_attention_heads, "grouped-query attention"),
        (m.apply_layernorm_1p, "--apply-layernorm-1p"),
        (m.apply_residual_connection_post_layernorm, "--apply-residual-connection-post-layernorm"),
    ]
    for bad, what in problems:
        if bad:
            raise ConfigError(f"Hugging Face's T5 cannot express {what}")


def hf_config(m: ModelConfig, *, decoder_num_layers: int, vocab_size: int, pad: int | None = 0,
              eos: int | None = 1, decoder_start: int | None = None, dtype: torch.dtype = torch.float32) -> dict:
    """config.json of ``T5ForConditionalGeneration`` for our model (see the module docstring)."""
    from transformers import T5Config  # noqa: PLC0415

    check_representable(m)
    cfg = T5Config(vocab_size=vocab_size, d_model=m.hidden_size, d_kv=m.kv_channels, d_ff=m.ffn_hidden_size,
                   num_layers=m.num_layers, num_decoder_layers=decoder_num_layers, num_heads=m.num_attention_heads,
                   layer_norm_epsilon=m.layernorm_epsilon, feed_forward_proj=_ACTIVATIONS[activation(m)],
                   relative_attention_num_buckets=m.relative_attention_num_buckets,
                   relative_attention_max_distance=m.relative_attention_max_distance,
                   dropout_rate=m.hidden_dropout, pad_token_id=pad, eos_token_id=eos,
                   decoder_start_token_id=decoder_start if decoder_start is not None else pad,
                   tie_word_embeddings=False, architectures=["T5ForConditionalGeneration"])
    d = cfg.to_dict()
    # transformers 5 reads scale_decoder_outputs; 4.x reads "no tie" as "no scale" (and an lm_head of its own)
    d.update(scale_decoder_outputs=False, tie_word_embeddings=False, torch_dtype=str(dtype).split(".")[-1])
    return d


def _q_scale(m: ModelConfig) -> float:
    return 1.0 / math.sqrt(m.kv_channels)


def _split_self_qkv(w: torch.Tensor, m: ModelConfig):
    """Our fused [q_h; k_h; v_h] per head (multi-head) -> q, k, v ``[heads * d, h]``."""
    per = w.view(m.num_attention_heads, 3, m.kv_channels, -1)
    return tuple(per[:, j].reshape(m.num_attention_heads * m.kv_channels, -1) for j in range(3))


def _split_kv(w: torch.Tensor, m: ModelConfig):
    per = w.view(m.num_attention_heads, 2, m.kv_channels, -1)
    return tuple(per[:, j].reshape(m.num_attention_heads * m.kv_channels, -1) for j in range(2))


def _mlp_to_hf(prefix: str, t: dict, m: ModelConfig, out: str) -> dict:
    w = t[prefix + "mlp.dense_h_to_4h.weight"]
    res = {out + "wo.weight": t[prefix + "mlp.dense_4h_to_h.weight"]}
    if m.swiglu or m.geglu:
        gate, up = w.chunk(2, dim=0)
        res.update({out + "wi_0.weight": gate, out + "wi_1.weight": up})
    else:
        res[out + "wi.weight"] = w
    return res


def to_hf(state: dict[str, torch.Tensor], m: ModelConfig, *, decoder_num_layers: int,
          vocab_size: int) -> dict[str, torch.Tensor]:
    """HF tensors from our full (TP 1) state dict; the vocabulary's padding rows are dropped."""
    check_representable(m)
    E, D, scale = m.num_layers, decoder_num_layers, _q_scale(m)
    words = state[_EMBED + "word_embeddings.weight"][:vocab_size]
    hf = {"shared.weight": words, "lm_head.weight": words}
    zeros = torch.zeros(m.relative_attention_num_buckets, m.num_attention_heads, dtype=words.dtype)
    for side, first, n, blocks in (("encoder", 1, E, 2), ("decoder", E + 3, D, 3)):
        relative = m.position_embedding_type == "relative"
        hf[f"{side}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"] = (
            state[_EMBED + f"{side}_relative_attention_bias.weight"] if relative else zeros)
        for i in range(n):
            p, o = f"{first + i}.", f"{side}.block.{i}.layer."
            q, k, v = _split_self_qkv(state[p + "self_attention.query_key_value.weight"], m)
            hf.update({o + "0.layer_norm.weight": state[p + "input_layernorm.weight"],
                       o + "0.SelfAttention.q.weight": q * scale, o + "0.SelfAttention.k.weight": k,
                       o + "0.SelfAttention.v.weight": v,
                       o + "0.SelfAttention.o.weight": state[p + "self_attention.dense.weight"],
                       o + "1.layer_norm.weight": state[p + "post_attention_layernorm.weight"]})
            if side == "decoder":
                k, v = _split_kv(state[p + "inter_attention.key_value.weight"], m)
                hf.update({o + "1.EncDecAttention.q.weight": state[p + "inter_attention.query.weight"] * scale,
                           o + "1.EncDecAttention.k.weight": k, o + "1.EncDecAttention.v.weight": v,
                           o + "1.EncDecAttention.o.weight": state[p + "inter_attention.dense.weight"],
                           o + "2.layer_norm.weight": state[p + "post_inter_attention_layernorm.weight"]})
            hf.update(_mlp_to_hf(p, state, m, o + f"{blocks - 1}.DenseReluDense."))
    hf["encoder.final_layer_norm.weight"] = state[f"{E + 1}.final_layernorm.weight"]
    hf["decoder.final_layer_norm.weight"] = state[f"{E + D + 3}.final_layernorm.weight"]
    return {k: v.contiguous() for k, v in hf.items()}


def model_config_from_hf(d: dict) -> tuple[ModelConfig, int]:
    """(our resolved ModelConfig, decoder layers) of an HF T5 config.json; ConfigError for what our
    T5 cannot compute (other MLPs)."""
    proj = d.get("feed_forward_proj", "relu")
    act = {v: k for k, v in _ACTIVATIONS.items()}.get(proj)
    if act is None:
        raise ConfigError(f"our T5 has no {proj!r} MLP (GeLU, --openai-gelu, --swiglu, --squared-relu, --relu, "
                          f"--geglu): only gelu, gelu_new, gated-silu, relu2, relu and gated-gelu T5 models import")
    # HF's T5 has no length limit (relative positions); its configs' legacy n_positions (512 in the
    # original T5's) stands for the encoder length until --encoder-seq-length sets a run's
    m = ModelConfig(num_layers=d["num_layers"], hidden_size=d["d_model"], num_attention_heads=d["num_heads"],
                    seq_length=d.get("n_positions", 512),
                    num_key_value_heads=d["num_heads"], ffn_hidden_size=d["d_ff"], kv_channels=d["d_kv"],
                    position_embedding_type="relative", max_position_embeddings=None, normalization="rmsnorm",
                    relative_attention_num_buckets=d.get("relative_attention_num_buckets", 32),
                    relative_attention_max_distance=d.get("relative_attention_max_distance", 128),
                    layernorm_epsilon=d.get("layer_norm_epsilon", 1e-6), add_bias_linear=False,
                    swiglu=act == "swiglu", openai_gelu=act == "openai_gelu", squared_relu=act == "squared_relu",
                    relu=act == "relu", geglu=act == "geglu",
                    hidden_dropout=d.get("dropout_rate", 0.1), attention_dropout=d.get("dropout_rate", 0.1))
    return m, d.get("num_decoder_layers") or d["num_layers"]


def scales_decoder_output(d: dict) -> bool:
    """Whether HF multiplies the decoder output by d_model^-0.5 before the LM head (transformers 5's
    ``scale_decoder_outputs``; older configs: unless ``tie_word_embeddings`` is false)."""
    if "scale_decoder_outputs" in d:
        return bool(d["scale_decoder_outputs"])
    return d.get("tie_word_embeddings", True) is not False


def from_hf(get, d: dict, *, padded_vocab_size: int) -> dict[str, torch.Tensor]:
    """Our full (TP 1) state dict from HF tensors (``get(name)``) and config ``d``."""
    m, D = model_config_from_hf(d)
    E, scale = m.num_layers, 1.0 / _q_scale(m)
    words = get("shared.weight")
    if not scales_decoder_output(d):
        lm = get("lm_head.weight") if _has(get, "lm_head.weight") else words
        if not torch.equal(lm, words):
            raise ConfigError("Hugging Face's T5 has an LM head apart from its word embeddings: ours is tied")
    padded = torch.zeros(padded_vocab_size, words.shape[1], dtype=words.dtype)
    padded[:words.shape[0]] = words
    out = {_EMBED + "word_embeddings.weight": padded}
    for side in ("encoder", "decoder"):  # block 0's table serves the whole stack (HF's has_relative_attention_bias)
        table = get(f"{side}.block.0.layer.0.SelfAttention.relative_attention_bias.weight")
        out[_EMBED + f"{side}_relative_attention_bias.weight"] = table
    for side, first, n, blocks in (("encoder", 1, E, 2), ("decoder", E + 3, D, 3)):
        for i in range(n):
            p, o = f"{first + i}.", f"{side}.block.{i}.layer."
            heads = [get(o + f"0.SelfAttention.{x}.weight") for x in "qkv"]
            heads[0] = heads[0] * scale
            fused = torch.stack([h.view(m.num_attention_heads, m.kv_channels, -1) for h in heads], dim=1)
            out.update({p + "input_layernorm.weight": get(o + "0.layer_norm.weight"),
                        p + "self_attention.query_key_value.weight": fused.reshape(-1, m.hidden_size),
                        p + "self_attention.dense.weight": get(o + "0.SelfAttention.o.weight"),
                        p + "post_attention_layernorm.weight": get(o + "1.layer_norm.weight")})
            if side == "decoder":
                kv = torch.stack([get(o + f"1.EncDecAttention.{x}.weight").view(m.num_attention_heads, m.kv_channels, -1)
                                  for x in "kv"], dim=1)
                out.update({p + "inter_attention.query.weight": get(o + "1.EncDecAttention.q.weight") * scale,
                            p + "inter_attention.key_value.weight": kv.reshape(-1, m.hidden_size),
                            p + "inter_attention.dense.weight": get(o + "1.EncDecAttention.o.weight"),
                            p + "post_inter_attention_layernorm.weight": get(o + "2.layer_norm.weight")})
            ff = o + f"{blocks - 1}.DenseReluDense."
            gated = m.swiglu or m.geglu
            w = torch.cat([get(ff + "wi_0.weight"), get(ff + "wi_1.weight")]) if gated else get(ff + "wi.weight")
            out.update({p + "mlp.dense_h_to_4h.weight": w, p + "mlp.dense_4h_to_h.weight": get(ff + "wo.weight")})
    out[f"{E + 1}.final_layernorm.weight"] = get("encoder.final_layer_norm.weight")
    final = get("decoder.final_layer_norm.weight")
    # HF's d_model^-0.5 on the decoder output only feeds the LM head: fold it into the final norm
    out[f"{E + D + 3}.final_layernorm.weight"] = final * m.hidden_size ** -0.5 if scales_decoder_output(d) else final
    return out


def _has(get, name: str) -> bool:
    try:
        get(name)
    except KeyError:
        return False
    return True


def write_hf(out_dir: str, tensors: dict[str, torch.Tensor], config: dict, *,
             dtype: torch.dtype = torch.float32) -> None:
    """``config.json`` and ``model.safetensors`` of a T5 for ``T5ForConditionalGeneration.from_pretrained``."""
    import json  # noqa: PLC0415
    import os  # noqa: PLC0415

    from safetensors.torch import save_file  # noqa: PLC0415

    os.makedirs(out_dir, exist_ok=True)
    # lm_head.weight is shared.weight: safetensors refuses tensors sharing memory, so the head gets a copy
    save_file({k: v.detach().to(dtype).clone().contiguous() for k, v in tensors.items()},
              os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


def read_hf(hf_dir: str):
    """(config dict, ``get(name)``) of an HF T5 directory's single or sharded safetensors."""
    import glob  # noqa: PLC0415
    import json  # noqa: PLC0415
    import os  # noqa: PLC0415

    from safetensors import safe_open  # noqa: PLC0415

    with open(os.path.join(hf_dir, "config.json")) as f:
        config = json.load(f)
    files = sorted(glob.glob(os.path.join(hf_dir, "*.safetensors")))
    if not files:
        raise ConfigError(f"{hf_dir} has no .safetensors files")
    where = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            where.update({name: path for name in f.keys()})

    def get(name: str) -> torch.Tensor:
        if name not in where:
            raise KeyError(name)
        with safe_open(where[name], framework="pt") as f:
            return f.get_tensor(name).float()

    return config, get


def save_t5_tokenizer(data, tokenizer, out_dir: str, log) -> None:
    """The WordPiece vocabulary with the run's added tokens (<extra_id_k> sentinels, T5's start and
    end where the file lacks them) as transformers' BERT tokenizer files, ids as in training."""
    kind = data.tokenizer_type
    if kind not in ("BertWordPieceLowerCase", "BertWordPieceCase") or not data.vocab_file or tokenizer is None:
        log(f"NOTE: no tokenizer files written (tokenizer type {kind})")
        return
    import inspect  # noqa: PLC0415

    from transformers import BertTokenizerFast  # noqa: PLC0415

    # transformers 5 takes the vocabulary as ``vocab`` and silently ignores a ``vocab_file`` keyword
    # (a 5-token vocabulary results); 4.x takes ``vocab_file``
    key = "vocab" if "vocab" in inspect.signature(BertTokenizerFast.__init__).parameters else "vocab_file"
    hf = BertTokenizerFast(**{key: data.vocab_file}, do_lower_case=kind == "BertWordPieceLowerCase")
    with open(data.vocab_file, encoding="utf-8") as f:
        in_file = sum(1 for line in f if line.rstrip("\n"))
    if len(hf.get_vocab()) != in_file:
        raise ConfigError(f"transformers read {len(hf.get_vocab())} of the {in_file} tokens of {data.vocab_file}")
    added = [tokenizer.inv_vocab[i] for i in range(in_file, tokenizer.vocab_size)]
    hf.add_special_tokens({"additional_special_tokens": added})
    if hf.convert_tokens_to_ids(added) != list(range(in_file, tokenizer.vocab_size)):
        raise ConfigError("the exported tokenizer would number the added T5 tokens differently from training")
    hf.save_pretrained(out_dir)
    log(f"wrote {kind} tokenizer files ({data.vocab_file} + {len(added)} added tokens)")


def export_hf_t5(load_dir: str, out_dir: str, *, family: ModelFamily, iteration: int | None = None,
                 dtype: str | None = None, vocab_size: int | None = None, vocab_file: str | None = None,
                 log=print) -> None:
    """A pretrain_t5.py checkpoint (any TP / PP / DP) as a ``T5ForConditionalGeneration`` directory
    (model.safetensors, config.json, tokenizer files)."""
    import dataclasses  # noqa: PLC0415

    from megatron_ds.checkpoint.consolidate import load_consolidated  # noqa: PLC0415
    from megatron_ds.config.schema import DataConfig  # noqa: PLC0415
    from megatron_ds.data.tokenizer import build_tokenizer_for  # noqa: PLC0415
    from megatron_ds.families.t5.t5_params import decoder_layers  # noqa: PLC0415
    from megatron_ds.parallel.utils import PRECISION_DTYPES  # noqa: PLC0415

    c = load_consolidated(load_dir, iteration, family=family, log=log)
    check_representable(c.model)
    vocab = vocab_size or c.vocab_size
    if vocab is None:
        raise ConfigError(f"{load_dir} does not record its real vocabulary size; pass --vocab-size")
    saved = {k: v for k, v in c.config.get("data", {}).items() if k in DataConfig.__dataclass_fields__}
    data = DataConfig(**saved)
    if vocab_file:  # moved since training
        data = dataclasses.replace(data, vocab_file=vocab_file)
    tokenizer = None
    if data.vocab_file and not data.mock_data:
        extra = c.config.get("masked_lm", {}).get("vocab_extra_ids", 0)
        tokenizer = build_tokenizer_for(data, log=lambda *a: None, vocab_extra_ids=extra)
    ids = {}
    if tokenizer is not None:  # the decoder starts from T5's BOS (t5_dataset.py), pads with [PAD]
        ids = dict(pad=tokenizer.pad, eos=tokenizer.eos_token_id, decoder_start=tokenizer.bos_token_id)
    dt = PRECISION_DTYPES[dtype or "fp32"]
    d = decoder_layers(c.model)
    write_hf(out_dir, to_hf(c.state_dict, c.model, decoder_num_layers=d, vocab_size=vocab),
             hf_config(c.model, decoder_num_layers=d, vocab_size=vocab, dtype=dt, **ids), dtype=dt)
    save_t5_tokenizer(data, tokenizer, out_dir, log)
    log(f"wrote T5ForConditionalGeneration ({vocab} of {c.padded_vocab_size} vocabulary rows) to {out_dir}")


def import_hf_t5(hf_dir: str, save_dir: str, *, family: ModelFamily, log=print) -> ModelConfig:
    """Write ``hf_dir``'s T5ForConditionalGeneration as a weights-only pretrain_t5.py checkpoint (TP 1 x
    PP 1 layer files, fp32; ``--load`` at any layout reshards it); returns our model config."""
    import json  # noqa: PLC0415
    import os  # noqa: PLC0415

    from megatron_ds.checkpoint.files import layer_file_name, layer_prefixes  # noqa: PLC0415
    from megatron_ds.checkpoint.format import COMPLETENESS, META, TRACKER, atomic_write, signature, step_dir  # noqa: PLC0415
    from megatron_ds.checkpoint.integrity import write_manifest  # noqa: PLC0415
    from megatron_ds.config.schema import Config  # noqa: PLC0415
    from megatron_ds.parallel.utils import pad_vocab_size  # noqa: PLC0415

    d, get = read_hf(hf_dir)
    m, decoder = model_config_from_hf(d)
    import dataclasses  # noqa: PLC0415

    m = dataclasses.replace(m, decoder_num_layers=decoder)
    vocab = d["vocab_size"]
    padded = pad_vocab_size(vocab, m.make_vocab_size_divisible_by, 1)
    state = from_hf(get, d, padded_vocab_size=padded)
    tag_dir = step_dir(save_dir, 0)
    os.makedirs(tag_dir, exist_ok=True)
    for idx, prefix in layer_prefixes(m, padded, family):
        tensors = {k[len(prefix):]: v.contiguous() for k, v in state.items() if k.startswith(prefix)}
        torch.save(tensors, os.path.join(tag_dir, layer_file_name(idx, 0)))
    meta = {"signature": {**signature(m, padded_vocab_size=padded), "model_family": family.name},
            "config": Config(model=m).to_dict(),
            "vocab_size": vocab, "model_family": family.name, "weights_only": True,
            "imported_from": os.path.abspath(hf_dir), COMPLETENESS[0]: COMPLETENESS[1]}
    atomic_write(os.path.join(tag_dir, META), json.dumps(meta, indent=2))
    write_manifest(tag_dir, 0)
    atomic_write(os.path.join(save_dir, TRACKER), "0")
    log(f"imported T5ForConditionalGeneration from {hf_dir} into {save_dir}; train it with pretrain_t5.py "
        f"--num-layers {m.num_layers} --decoder-num-layers {decoder} --hidden-size {m.hidden_size} "
        f"--num-attention-heads {m.num_attention_heads} --kv-channels {m.kv_channels} --ffn-hidden-size "
        f"{m.ffn_hidden_size} --position-embedding-type relative --relative-attention-num-buckets "
        f"{m.relative_attention_num_buckets} --relative-attention-max-distance {m.relative_attention_max_distance} "
        f"--normalization rmsnorm --disable-bias-linear "
        f"--layernorm-epsilon {m.layernorm_epsilon}{' --' + activation(m).replace('_', '-') if activation(m) != 'gelu' else ''} "
        f"--load {save_dir}")
    return m
