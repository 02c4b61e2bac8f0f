"""BERT (``families/bert/bert_model.py``) to and from Hugging Face transformers, both ways with equal logits.

Two targets, chosen by where the residual is taken:

- ``MegatronBertForPreTraining`` (Megatron's BERT, the default here): pre-LN layers with a final
  norm, no embedding norm -- transformers' class for exactly Megatron's model (its
  ``convert_megatron_bert_checkpoint`` reads Megatron's own checkpoints into it).
- ``BertForPreTraining`` (the original BERT) with ``--apply-residual-connection-post-layernorm``:
  post-LN BERT (``x = LN(x + f(x))``, an embedding LayerNorm) is Megatron's layer with the
  residual taken after each norm, with every norm moved one place: our layer i's input norm is
  HF's embedding norm (i = 1) or layer i-1's output norm, its post-attention norm is HF layer i's
  attention output norm, and our final norm is HF's last output norm. The two compute the same
  function, tensor for tensor.

Both have token-type embeddings, a pooler and a sentence-relationship head. A model built with
--bert-no-binary-head exports one all-zero token type and zero pooler / binary head (only the MLM
logits mean anything); importing a model with one token type folds that row into the positions
(it is added to every token). The padded vocabulary rows are dropped on export and zero on import.
Names without a layer prefix refer to ``build_sequential_bert``'s state dict: ``tied_modules.embed.``,
``<i>.`` for transformer layer i (1..N), ``<N+1>.`` final norm, ``<N+2>.`` heads, ``<N+4>.`` MLM bias.
"""
from __future__ import annotations

import contextlib
import json
import os
from typing import Callable

import torch

from megatron_ds.checkpoint.hf_files import fuse_qkv, split_qkv
from megatron_ds.config.family import ModelFamily
from megatron_ds.config.layout import resolve_model_config
from megatron_ds.config.schema import ModelConfig
from megatron_ds.ds_compat import torchao_import_quiet
from megatron_ds.errors import ConfigError

BERT, MEGATRON_BERT = "BertForPreTraining", "MegatronBertForPreTraining"
_ACTIVATIONS = {"gelu": False, "gelu_new": True, "gelu_pytorch_tanh": True}  # hidden_act -> --openai-gelu
EMBED = "tied_modules.embed."


def bert_architecture(m: ModelConfig) -> str:
    """The transformers class that expresses ``m`` exactly; ConfigError naming what cannot."""
    problems = []
    if m.squared_relu:
        problems.append("--squared-relu (BERT's activation is GeLU)")
    if not m.add_bias_linear:
        problems.append("--disable-bias-linear (BERT's linear layers have biases)")
    if m.num_key_value_heads != m.num_attention_heads or m.kv_channels * m.num_attention_heads != m.hidden_size:
        problems.append("grouped-query attention or --kv-channels (BERT: heads x head size = hidden)")
    if problems:
        raise ConfigError("BERT exports as (Megatron)BertForPreTraining, which cannot express " + "; ".join(problems))
    return BERT if m.apply_residual_connection_post_layernorm else MEGATRON_BERT


def _norm_names(arch: str, m: ModelConfig) -> dict[str, str]:
    """Our norm prefixes -> HF's (see the module docstring for the post-LN shift)."""
    n, out = m.num_layers, {}
    for i in range(1, n + 1):
        p = f"bert.encoder.layer.{i - 1}."
        if arch == BERT:
            out[f"{i}.input_layernorm"] = "bert.embeddings.LayerNorm" if i == 1 else \
                f"bert.encoder.layer.{i - 2}.output.LayerNorm"
            out[f"{i}.post_attention_layernorm"] = p + "attention.output.LayerNorm"
        else:
            out[f"{i}.input_layernorm"], out[f"{i}.post_attention_layernorm"] = p + "attention.ln", p + "ln"
    out[f"{n + 1}.final_layernorm"] = f"bert.encoder.layer.{n - 1}.output.LayerNorm" if arch == BERT else \
        "bert.encoder.ln"
    return out


def _linear_names(m: ModelConfig) -> dict[str, str]:
    """Our linear layers (other than QKV) -> HF's, weight and bias alike."""
    n, heads = m.num_layers, m.num_layers + 2
    out = {f"{heads}.lm_dense": "cls.predictions.transform.dense",
           f"{heads}.lm_layernorm": "cls.predictions.transform.LayerNorm",
           f"{heads}.pooler": "bert.pooler.dense", f"{heads}.binary_head": "cls.seq_relationship"}
    for i in range(1, n + 1):
        p = f"bert.encoder.layer.{i - 1}."
        out.update({f"{i}.self_attention.dense": p + "attention.output.dense", f"{i}.mlp.dense_h_to_4h":
                    p + "intermediate.dense", f"{i}.mlp.dense_4h_to_h": p + "output.dense"})
    return out


def _one_plus(m: ModelConfig) -> float:
    """--apply-layernorm-1p: our transformer norms scale by 1 + weight, HF's by weight."""
    return 1.0 if m.apply_layernorm_1p else 0.0


def bert_to_hf(arch: str, m: ModelConfig, state: dict[str, torch.Tensor], vocab: int) -> dict[str, torch.Tensor]:
    """Our full (unsharded) BERT state dict -> HF tensors of ``arch`` with a ``vocab``-row vocabulary."""
    h, n = m.hidden_size, m.num_layers
    word = state[EMBED + "word_embeddings.weight"][:vocab]
    types = state.get(EMBED + "tokentype_embeddings.weight", torch.zeros(1, h))
    out = {"bert.embeddings.word_embeddings.weight": word, "cls.predictions.decoder.weight": word,
           "bert.embeddings.position_embeddings.weight": state[EMBED + "position_embeddings.weight"],
           "bert.embeddings.token_type_embeddings.weight": types}
    bias = state[f"{n + 4}.lm_head.bias"][:vocab]
    out["cls.predictions.bias"] = out["cls.predictions.decoder.bias"] = bias
    for ours, theirs in _norm_names(arch, m).items():
        out[theirs + ".weight"] = state[ours + ".weight"] + _one_plus(m)
        out[theirs + ".bias"] = state[ours + ".bias"]
    for ours, theirs in _linear_names(m).items():
        for suffix in ("weight", "bias"):
            default = torch.zeros(2 if "binary" in ours else h, *((h,) if suffix == "weight" else ()))
            out[f"{theirs}.{suffix}"] = state.get(f"{ours}.{suffix}", default)  # no binary head: zeros
    for i in range(1, n + 1):
        p = f"bert.encoder.layer.{i - 1}.attention.self."
        for suffix in ("weight", "bias"):
            q, k, v = split_qkv(state[f"{i}.self_attention.query_key_value.{suffix}"], m)
            out[f"{p}query.{suffix}"], out[f"{p}key.{suffix}"], out[f"{p}value.{suffix}"] = q, k, v
    return out


def bert_from_hf(arch: str, m: ModelConfig, get: Callable[[str], torch.Tensor],
                 padded_vocab_size: int) -> dict[str, torch.Tensor]:
    """HF tensors (``get(name)``) -> our BERT state dict (``m`` from ``bert_config_from_hf``)."""
    n = m.num_layers
    word = get("bert.embeddings.word_embeddings.weight")
    pad = padded_vocab_size - word.shape[0]
    state = {EMBED + "word_embeddings.weight": torch.cat([word, word.new_zeros(pad, word.shape[1])])}
    positions = get("bert.embeddings.position_embeddings.weight")
    types = get("bert.embeddings.token_type_embeddings.weight")
    if m.bert_binary_head:
        state[EMBED + "tokentype_embeddings.weight"] = types
    else:  # one token type: its row is added to every token, as a position row is
        positions = positions + types[0]
    state[EMBED + "position_embeddings.weight"] = positions
    bias = get("cls.predictions.bias")
    state[f"{n + 4}.lm_head.bias"] = torch.cat([bias, bias.new_zeros(pad)])
    for ours, theirs in _norm_names(arch, m).items():
        state[ours + ".weight"] = get(theirs + ".weight") - _one_plus(m)
        state[ours + ".bias"] = get(theirs + ".bias")
    for ours, theirs in _linear_names(m).items():
        if m.bert_binary_head or not ours.endswith(("pooler", "binary_head")):
            state[ours + ".weight"], state[ours + ".bias"] = get(theirs + ".weight"), get(theirs + ".bias")
    for i in range(1, n + 1):
        p = f"bert.encoder.layer.{i - 1}.attention.self."
        for suffix in ("weight", "bias"):
            state[f"{i}.self_attention.query_key_value.{suffix}"] = fuse_qkv(
                get(f"{p}query.{suffix}"), get(f"{p}key.{suffix}"), get(f"{p}value.{suffix}"), m)
    return state


def hf_bert_config(arch: str, m: ModelConfig, vocab: int, *, pad_token_id: int = 0, dtype=torch.float32):
    """The transformers config of ``arch`` for our model ``m``."""
    import transformers  # noqa: PLC0415 - optional dependency, needed only here

    cls = transformers.BertConfig if arch == BERT else transformers.MegatronBertConfig
    return cls(vocab_size=vocab, hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
               num_attention_heads=m.num_attention_heads, intermediate_size=m.ffn_hidden_size,
               hidden_act="gelu_new" if m.openai_gelu else "gelu", hidden_dropout_prob=m.hidden_dropout,
               attention_probs_dropout_prob=m.attention_dropout, max_position_embeddings=m.max_position_embeddings,
               type_vocab_size=2 if m.bert_binary_head else 1, initializer_range=m.init_method_std,
               layer_norm_eps=m.layernorm_epsilon, pad_token_id=pad_token_id, tie_word_embeddings=True,
               dtype=dtype, architectures=[arch])


def bert_config_from_hf(d: dict) -> tuple[str, ModelConfig]:
    """(architecture, our resolved ModelConfig) from a BERT / Megatron-BERT ``config.json`` dict."""
    kind = d.get("model_type")
    if kind not in ("bert", "megatron-bert"):
        raise ConfigError(f"model_type {kind!r}: only bert and megatron-bert models import as BERT")
    act = d.get("hidden_act", "gelu")
    if act not in _ACTIVATIONS:
        raise ConfigError(f"hidden_act {act!r}: only BERT models with hidden_act {', '.join(_ACTIVATIONS)} import")
    if d.get("position_embedding_type", "absolute") != "absolute":
        raise ConfigError(f"position_embedding_type {d['position_embedding_type']!r}: only absolute positions import")
    types = d.get("type_vocab_size", 2)
    if types not in (1, 2):
        raise ConfigError(f"type_vocab_size {types}: BERT here has 2 token types (binary head) or none")
    positions = d["max_position_embeddings"]
    m = ModelConfig(num_layers=d["num_hidden_layers"], hidden_size=d["hidden_size"],
                    num_attention_heads=d["num_attention_heads"], ffn_hidden_size=d["intermediate_size"],
                    seq_length=positions, max_position_embeddings=positions,
                    layernorm_epsilon=d.get("layer_norm_eps", 1e-12), openai_gelu=_ACTIVATIONS[act],
                    hidden_dropout=d.get("hidden_dropout_prob", 0.1),
                    attention_dropout=d.get("attention_probs_dropout_prob", 0.1),
                    init_method_std=d.get("initializer_range", 0.02), bert_binary_head=types == 2,
                    apply_residual_connection_post_layernorm=kind == "bert")
    return (BERT if kind == "bert" else MEGATRON_BERT), resolve_model_config(m)


def bert_model_flags(m: ModelConfig) -> list[str]:
    """pretrain_bert.py flags that give model ``m`` (printed by the import tool)."""
    f = [f"--num-layers {m.num_layers}", f"--hidden-size {m.hidden_size}",
         f"--num-attention-heads {m.num_attention_heads}", f"--ffn-hidden-size {m.ffn_hidden_size}",
         f"--seq-length {m.seq_length}", f"--max-position-embeddings {m.max_position_embeddings}",
         f"--layernorm-epsilon {m.layernorm_epsilon:g}"]
    if m.apply_residual_connection_post_layernorm:
        f.append("--apply-residual-connection-post-layernorm")
    if m.openai_gelu:
        f.append("--openai-gelu")
    if not m.bert_binary_head:
        f.append("--bert-no-binary-head")
    return f


def save_bert_tokenizer(data, out_dir: str, log: Callable, vocab_size: int | None = None) -> None:
    """The WordPiece vocabulary as transformers' BERT tokenizer files (vocab.txt and its config),
    with the ids Megatron's BERT tokenizer appends to the file's (``data/wordpiece.py``):
    ``[BOS]``, ``[EOS]`` where the file lacks them, then ``<extra_id_N>``, up to ``vocab_size``."""
    kind = data.tokenizer_type
    if kind not in ("BertWordPieceLowerCase", "BertWordPieceCase") or not data.vocab_file:
        log(f"NOTE: no tokenizer files written (tokenizer type {kind})")
        return
    import shutil  # noqa: PLC0415

    from transformers import BertTokenizerFast  # noqa: PLC0415

    lower = kind == "BertWordPieceLowerCase"
    try:  # transformers 5 reads the file as ``vocab``; 4 as ``vocab_file``
        tok = BertTokenizerFast(vocab=data.vocab_file, do_lower_case=lower)
    except TypeError:
        tok = BertTokenizerFast(vocab_file=data.vocab_file, do_lower_case=lower)
    appended = [t for t in ("[BOS]", "[EOS]") if t not in tok.get_vocab()]
    appended += [f"<extra_id_{i}>" for i in range(max(0, (vocab_size or 0) - len(tok) - len(appended)))]
    if vocab_size is not None and appended:
        tok.add_special_tokens({"additional_special_tokens": appended[:vocab_size - len(tok)]})
    tok.save_pretrained(out_dir)
    shutil.copyfile(data.vocab_file, os.path.join(out_dir, "vocab.txt"))  # the vocabulary as trained with
    log(f"wrote {kind} tokenizer files ({data.vocab_file})")


def write_hf_bert(out_dir: str, m: ModelConfig, state: dict[str, torch.Tensor], vocab: int, *, data=None,
                  pad_token_id: int = 0, dtype=torch.float32, log: Callable = print) -> str:
    """Write our BERT's full state dict as a transformers model directory (safetensors, config,
    tokenizer); returns the architecture name."""
    import transformers  # noqa: PLC0415

    arch = bert_architecture(m)
    config = hf_bert_config(arch, m, vocab, pad_token_id=pad_token_id, dtype=dtype)
    # transformers' first model class imports its quantizers, and they import torchao wherever it is
    # installed (for FP8 runs): its warnings about CUDA kernel libraries say nothing about this export
    with torchao_import_quiet():
        model = getattr(transformers, arch)(config)
    tensors = bert_to_hf(arch, m, state, vocab)
    missing, unexpected = model.load_state_dict({k: v.to(dtype) for k, v in tensors.items()}, strict=False)
    missing = [k for k in missing if k not in tensors]
    if missing or unexpected:
        raise ConfigError(f"{arch} and the converted BERT disagree: missing {missing}, unexpected {unexpected}")
    os.makedirs(out_dir, exist_ok=True)
    with _without_progress_bars(transformers):
        model.save_pretrained(out_dir)
    if data is not None:
        save_bert_tokenizer(data, out_dir, log, vocab)
    log(f"wrote {arch} ({vocab} of {state[EMBED + 'word_embeddings.weight'].shape[0]} vocabulary rows) to {out_dir}")
    return arch


@contextlib.contextmanager
def _without_progress_bars(transformers):
    """transformers 5 draws a "Writing model shards" bar while it saves, in a log a line of
    carriage-return frames around the one file written; the export's own "wrote ..." line follows."""
    hf_logging = transformers.utils.logging
    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def export_hf_bert(load_dir: str, out_dir: str, *, family: ModelFamily, iteration: int | None = None,
                   dtype: str | None = None, vocab_size: int | None = None, vocab_file: str | None = None,
                   log: Callable = print) -> str:
    """A pretrain_bert.py checkpoint (any TP / PP / DP) as a transformers model directory."""
    from megatron_ds.checkpoint.consolidate import load_consolidated  # noqa: PLC0415
    from megatron_ds.config.schema import DataConfig  # noqa: PLC0415
    from megatron_ds.parallel.utils import PRECISION_DTYPES  # noqa: PLC0415

    c = load_consolidated(load_dir, iteration, family=family, log=log)
    vocab = vocab_size or c.vocab_size
    if vocab is None:
        raise ConfigError(f"{load_dir} does not record its real vocabulary size; pass --vocab-size")
    saved = {k: v for k, v in c.config.get("data", {}).items() if k in DataConfig.__dataclass_fields__}
    if vocab_file:  # moved since training
        saved["vocab_file"] = vocab_file
    return write_hf_bert(out_dir, c.model, c.state_dict, vocab, data=DataConfig(**saved),
                         dtype=PRECISION_DTYPES[dtype or "fp32"], log=log)


def _tokenizer_data(hf_dir: str, data_config):
    """The data section naming the directory's WordPiece vocabulary (none without a vocab.txt)."""
    vocab_txt = os.path.join(hf_dir, "vocab.txt")
    if not os.path.isfile(vocab_txt):
        return data_config()
    lower = True
    tok_config = os.path.join(hf_dir, "tokenizer_config.json")
    if os.path.isfile(tok_config):
        with open(tok_config) as f:
            lower = json.load(f).get("do_lower_case", True)
    return data_config(tokenizer_type="BertWordPieceLowerCase" if lower else "BertWordPieceCase",
                       vocab_file=os.path.abspath(vocab_txt))


def import_hf_bert(hf_dir: str, save_dir: str, *, family: ModelFamily, log: Callable = print) -> ModelConfig:
    """Write ``hf_dir``'s (Megatron)BertForPreTraining as a weights-only pretrain_bert.py checkpoint
    (TP 1 x PP 1 layer files, fp32; ``--load`` at any layout reshards it); returns our model config."""
    from megatron_ds.checkpoint.files import layer_file_name, layer_prefixes  # noqa: PLC0415
    from megatron_ds.checkpoint.format import (COMPLETENESS, META, TRACKER, atomic_write,  # noqa: PLC0415
                                               signature, step_dir)
    from megatron_ds.checkpoint.hf_files import HFWeights  # noqa: PLC0415
    from megatron_ds.checkpoint.integrity import write_manifest  # noqa: PLC0415
    from megatron_ds.config.schema import Config, DataConfig  # noqa: PLC0415
    from megatron_ds.parallel.utils import pad_vocab_size  # noqa: PLC0415

    with open(os.path.join(hf_dir, "config.json")) as f:
        d = json.load(f)
    arch, m = bert_config_from_hf(d)
    vocab = d["vocab_size"]
    padded = pad_vocab_size(vocab, m.make_vocab_size_divisible_by, 1)
    state = bert_from_hf(arch, m, HFWeights(hf_dir).require, padded)
    tag_dir = step_dir(save_dir, 0)
    os.makedirs(tag_dir, exist_ok=True)
    for idx, prefix in layer_prefixes(m, padded, family):
        tensors = {k[len(prefix):]: v.contiguous() for k, v in state.items() if k.startswith(prefix)}
        torch.save(tensors, os.path.join(tag_dir, layer_file_name(idx, 0)))
    data = _tokenizer_data(hf_dir, DataConfig)
    meta = {"signature": {**signature(m, padded_vocab_size=padded), "model_family": family.name},
            "config": Config(model=m, data=data).to_dict(),
            "vocab_size": vocab, "model_family": family.name, "weights_only": True,
            "imported_from": os.path.abspath(hf_dir), COMPLETENESS[0]: COMPLETENESS[1]}
    atomic_write(os.path.join(tag_dir, META), json.dumps(meta, indent=2))
    write_manifest(tag_dir, 0)
    atomic_write(os.path.join(save_dir, TRACKER), "0")
    log(f"imported {arch} from {hf_dir} into {save_dir}; train it with pretrain_bert.py\n  "
        + " ".join(bert_model_flags(m)) + f"\n  --load {save_dir} (continue) or --load {save_dir} --finetune")
    return m
