"""Import a local Hugging Face GPT-2, Llama, Qwen2, Qwen3, Mistral or Mixtral directory as a checkpoint of
the GPT family.

The result is a weights-only checkpoint (``DIR/global_step0``, tracker 0) in the per-layer format
of a TP 1 x PP 1 run, fp32. ``pretrain_gpt.py --load DIR`` (or ``--finetune``) at any layout
reshards it on load (``megatron_ds.checkpoint.reshard``); the model flags must match, and the
tool prints them. One layer is converted and written at a time. The checkpoint's metadata records
the class it came from (``hf_architecture``), which ``to_hf.py`` writes back where it can express
the model.
"""
from __future__ import annotations

import json
import os
from typing import Callable

import torch

from megatron_ds.checkpoint.files import layer_file_name
from megatron_ds.checkpoint.format import COMPLETENESS, META, TRACKER, atomic_write, signature, step_dir
from megatron_ds.checkpoint.hf_files import HFWeights
from megatron_ds.checkpoint.integrity import write_manifest
from megatron_ds.checkpoint.vocabulary import TOKENIZER, tokenizer_record
from megatron_ds.config.family import ModelFamily
from megatron_ds.config.schema import Config, DataConfig, ModelConfig
from megatron_ds.data.tokenizer import build_tokenizer_for
from megatron_ds.errors import ConfigError
from megatron_ds.families.gpt import gpt_hf as hf
from megatron_ds.progress import track


def _tokenizer_settings(hf_dir: str, arch: str) -> dict:
    if os.path.isfile(os.path.join(hf_dir, "tokenizer.json")):
        return dict(tokenizer_type="HFTokenizer", tokenizer_model=os.path.abspath(hf_dir))
    if os.path.isfile(os.path.join(hf_dir, "vocab.json")) and os.path.isfile(os.path.join(hf_dir, "merges.txt")):
        return dict(tokenizer_type="GPT2BPETokenizer", vocab_file=os.path.abspath(os.path.join(hf_dir, "vocab.json")),
                    merge_file=os.path.abspath(os.path.join(hf_dir, "merges.txt")))
    if os.path.isfile(os.path.join(hf_dir, "tokenizer.model")):
        return dict(tokenizer_type="GPTSentencePieceTokenizer",
                    tokenizer_model=os.path.abspath(os.path.join(hf_dir, "tokenizer.model")))
    return {}


def _tokenizer_facts(data: DataConfig) -> dict | None:
    """The directory's tokenizer as checkpoints record it (``vocabulary``), so that --load compares it
    with the run's; None without one (then only the vocabulary rows are compared)."""
    if data.tokenizer_type is None:
        return None
    try:
        tok = build_tokenizer_for(data, log=None)
    except ConfigError:  # unreadable here (a missing optional package): the rows are still compared
        return None
    try:
        eod = tok.eod
    except ConfigError:  # a tokenizer without an end-of-document token
        eod = None
    return tokenizer_record(tok, data.tokenizer_type, eod)


def _layers(arch: str, m: ModelConfig, w: HFWeights):
    """(global layer index, our layer state dict) for every layer that owns parameters."""
    names = hf.embedding_names(arch)
    embed = {"word_embeddings.weight": w.require(names["word_embeddings.weight"])}
    if arch == hf.GPT2:
        embed["position_embeddings.weight"] = w.require(names["position_embeddings.weight"])
    yield 0, embed
    for i in range(m.num_layers):
        yield i + 1, hf.layer_from_hf(arch, m, i, w.get)
    yield m.num_layers + 1, {k: w.require(names[k]) for k in names if k.startswith("final_layernorm.")
                             and (arch == hf.GPT2 or k.endswith("weight"))}
    if m.untie_embeddings_and_output_weights:
        yield m.num_layers + 2, {"output_layer.weight": w.require(names["output_layer.weight"])}


def import_hf(hf_dir: str, save_dir: str, *, family: ModelFamily, log: Callable = print) -> ModelConfig:
    """Write ``hf_dir``'s model as a checkpoint of ``family`` (the GPT's) in ``save_dir``; returns our
    model config."""
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"{hf_dir} has no config.json (a local transformers model directory is expected)")
    with open(path) as f:
        d = json.load(f)
    arch, m = hf.model_config_from_hf(d)
    vocab = d["vocab_size"]
    weights = HFWeights(hf_dir)
    tag_dir = step_dir(save_dir, 0)
    os.makedirs(tag_dir, exist_ok=True)
    n = m.num_layers + 2 + int(m.untie_embeddings_and_output_weights)
    for idx, tensors in track(_layers(arch, m, weights), n, "import", unit="layers"):
        torch.save({k: v.contiguous() for k, v in tensors.items()}, os.path.join(tag_dir, layer_file_name(idx, 0)))
    cfg = Config(model=m, data=DataConfig(**_tokenizer_settings(hf_dir, arch)))
    named = {} if family.recorded_name is None else {"model_family": family.recorded_name}
    meta = {"signature": {**signature(m, padded_vocab_size=vocab), **named}, "config": cfg.to_dict(),
            "vocab_size": vocab, "weights_only": True, "imported_from": os.path.abspath(hf_dir),
            "hf_architecture": hf.ARCHITECTURES[arch],
            COMPLETENESS[0]: COMPLETENESS[1], TOKENIZER: _tokenizer_facts(cfg.data), **named}
    atomic_write(os.path.join(tag_dir, META), json.dumps(meta, indent=2))
    write_manifest(tag_dir, 0)  # complete, and verified when loaded, like a saved checkpoint
    atomic_write(os.path.join(save_dir, TRACKER), "0")  # Megatron's tracker only: there is no DeepSpeed state
    window = hf.sliding_window(m)
    if window is not None and window < m.max_position_embeddings:
        log(f"NOTE: sliding_window {window} is narrower than max_position_embeddings {m.max_position_embeddings}: "
            f"--seq-length {m.seq_length}, where the window masks nothing (longer sequences are refused)")
    log(f"imported {hf.ARCHITECTURES[arch]} from {hf_dir} into {save_dir}; train it with\n  "
        + " ".join(hf.model_flags(m)) + f"\n  --load {save_dir} (continue) or --load {save_dir} --finetune")
    return m
