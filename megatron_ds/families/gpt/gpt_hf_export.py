"""Export a GPT checkpoint (any layout) to a Hugging Face transformers directory.

Writes ``config.json``, ``generation_config.json``, ``model.safetensors`` (or shards of at most
``max_shard_bytes`` with ``model.safetensors.index.json``) and the tokenizer files. Layers are
read, converted and written one at a time, so memory stays near one shard plus one layer.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Callable

from megatron_ds.checkpoint.consolidate import iter_consolidated_layers
from megatron_ds.checkpoint.files import CheckpointFiles, layer_prefixes, open_checkpoint
from megatron_ds.checkpoint.hf_files import ShardWriter
from megatron_ds.config.family import ModelFamily
from megatron_ds.config.schema import DataConfig
from megatron_ds.data.tokenizer import build_tokenizer_for, canonical_tokenizer_type, resolved_tokenizer_type
from megatron_ds.errors import ConfigError
from megatron_ds.families.gpt import gpt_hf as hf
from megatron_ds.parallel.utils import PRECISION_DTYPES
from megatron_ds.progress import track


def _data_config(ckpt: CheckpointFiles, overrides: dict) -> DataConfig:
    """The saved run's data section with the tool's flags over it. Checkpoints from before the run
    recorded its resolved tokenizer say null where the default GPT-2 BPE was used with the recorded
    --vocab-file: the training run's own rule (``resolved_tokenizer_type``) tells it again. Without
    recorded files (--mock-data alone, an import without tokenizer files) there is no tokenizer."""
    saved = {k: v for k, v in ckpt.config.get("data", {}).items() if k in DataConfig.__dataclass_fields__}
    saved.update({k: v for k, v in overrides.items() if v is not None})
    data = DataConfig(**saved)
    if data.tokenizer_type is None and not (data.vocab_file or data.merge_file):
        return data
    return dataclasses.replace(data, tokenizer_type=resolved_tokenizer_type(data))


def _tokenizer(data: DataConfig, log: Callable):
    """Our tokenizer for the saved run (None for mock data / NullTokenizer: no files to export)."""
    if data.tokenizer_type in (None, "NullTokenizer"):
        why = "records no tokenizer (--mock-data alone, or imported without tokenizer files)" \
            if data.tokenizer_type is None else "was trained with NullTokenizer"
        log(f"NOTE: no tokenizer files written, and no bos/eos token ids: the checkpoint {why}; pass "
            f"--tokenizer-type with --vocab-file/--merge-file or --tokenizer-model to export one")
        return None
    try:
        return build_tokenizer_for(data, log=lambda *a: None)
    except ConfigError as exc:
        raise ConfigError(f"the checkpoint's tokenizer cannot be loaded ({exc}); pass its files with "
                          f"--vocab-file/--merge-file or --tokenizer-model") from None


def save_tokenizer(data: DataConfig, eod: int, out_dir: str, log: Callable) -> None:
    """Tokenizer files transformers' AutoTokenizer loads, from the files the run was trained with."""
    kind = canonical_tokenizer_type(data.tokenizer_type)  # HuggingFaceTokenizer is HFTokenizer
    if kind == "GPT2BPETokenizer":
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # noqa: PLC0415
        from transformers import PreTrainedTokenizerFast  # noqa: PLC0415

        # GPT-2's pipeline (as megatron_ds.data.tokenizer builds it): byte-level BPE, no prefix
        # space, no post-processor; <|endoftext|> is bos, eos and unk, as in GPT-2's own files.
        tok = Tokenizer(models.BPE.from_file(data.vocab_file, data.merge_file))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                unk_token="<|endoftext|>").save_pretrained(out_dir)
    elif kind == "HFTokenizer":
        src = data.tokenizer_model
        src_dir = src if os.path.isdir(src) else os.path.dirname(src)
        # copyfile, not copy: the export's files follow the umask, not the source's mode
        shutil.copyfile(os.path.join(src, "tokenizer.json") if os.path.isdir(src) else src,
                        os.path.join(out_dir, "tokenizer.json"))
        for name in ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
            if os.path.isfile(os.path.join(src_dir, name)):
                shutil.copyfile(os.path.join(src_dir, name), os.path.join(out_dir, name))
    elif kind == "SentencePieceTokenizer":
        shutil.copyfile(data.tokenizer_model, os.path.join(out_dir, "tokenizer.model"))
        with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
            json.dump({"tokenizer_class": "LlamaTokenizer", "add_bos_token": False, "add_eos_token": False}, f)
        log("NOTE: Megatron's SentencePieceTokenizer appends special ids (<EOD> ...) after the model's pieces; "
            "transformers' tokenizer does not know them")
    elif kind in ("GPTSentencePieceTokenizer", "Llama2Tokenizer", "TikTokenizer", "Llama3Tokenizer"):
        from megatron_ds.data.tokenizer_export import save_hf_tokenizer  # noqa: PLC0415

        log("wrote " + save_hf_tokenizer(build_tokenizer_for(data, log=None), out_dir, data.tokenizer_model))
    else:
        log(f"NOTE: no tokenizer files written (tokenizer type {kind})")
        return
    log(f"wrote {kind} tokenizer files (eod id {eod})")


def export_hf(load_dir: str, out_dir: str, *, family: ModelFamily, iteration: int | None = None,
              dtype: str | None = None, vocab_size: int | None = None, data_overrides: dict | None = None,
              from_masters: bool = False, max_shard_bytes: int = 5 * 2**30, architecture: str | None = None,
              log: Callable = print) -> str:
    """Write the checkpoint of ``family`` (the GPT's) as a transformers model directory; returns the
    architecture name. ``from_masters``: the optimizer's fp32 master weights instead of the module's
    (bf16/fp16 runs: the bits their rounding dropped; ``megatron_ds.checkpoint.sources.MasterSource``).
    ``architecture``: the class to write (else ``gpt_hf.choose_architecture``'s rule)."""
    ckpt = open_checkpoint(load_dir, iteration, family)
    arch = hf.choose_architecture(ckpt.model, asked=architecture, recorded=ckpt.meta.get("hf_architecture"))
    data = _data_config(ckpt, data_overrides or {})
    tokenizer = _tokenizer(data, log)
    vocab = vocab_size or ckpt.vocab_size or (tokenizer.vocab_size if tokenizer else None)
    if vocab is None:
        raise ConfigError(f"{ckpt.path} does not record its real vocabulary size (older checkpoint, no "
                          f"tokenizer); pass --vocab-size")
    if vocab > ckpt.padded_vocab_size:
        raise ConfigError(f"--vocab-size {vocab} exceeds the checkpoint's {ckpt.padded_vocab_size} rows")
    torch_dtype = PRECISION_DTYPES[dtype or ckpt.precision]
    os.makedirs(out_dir, exist_ok=True)
    eod = tokenizer.eod if tokenizer else None
    log(f"exporting {ckpt.path} (TP {ckpt.tp}, PP {ckpt.pp}, {ckpt.precision}"
        f"{', fp32 master weights' if from_masters else ''}) as {hf.ARCHITECTURES[arch]} "
        f"({torch_dtype}, vocabulary {vocab} of {ckpt.padded_vocab_size} rows) to {out_dir}")
    writer = ShardWriter(out_dir, max_shard_bytes)
    n_layers = ckpt.model.num_layers
    layers = iter_consolidated_layers(ckpt, from_masters=from_masters, log=lambda *a: None)
    total = len(layer_prefixes(ckpt.model, ckpt.padded_vocab_size, family))
    for idx, tensors in track(layers, total, "export", unit="layers"):
        for name, tensor in _to_hf_layer(arch, ckpt, idx, n_layers, tensors, vocab).items():
            writer.add(name, tensor.to(torch_dtype))
    size = writer.close()
    bos = getattr(tokenizer, "bos", None)  # Llama's <s> / <|begin_of_text|>; GPT-2's is its eod
    bos = eod if bos is None else bos
    hf.hf_config(arch, ckpt.model, vocab, bos=bos, eos=eod, dtype=torch_dtype).save_pretrained(out_dir)
    from transformers import GenerationConfig  # noqa: PLC0415

    GenerationConfig(bos_token_id=bos, eos_token_id=eod, pad_token_id=eod).save_pretrained(out_dir)
    if tokenizer is not None:
        save_tokenizer(data, eod, out_dir, log)
    log(f"wrote {hf.ARCHITECTURES[arch]} ({size / 2**20:.1f} MiB of weights) to {out_dir}")
    return hf.ARCHITECTURES[arch]


def _to_hf_layer(arch: str, ckpt: CheckpointFiles, idx: int, n_layers: int, tensors: dict, vocab: int) -> dict:
    local = {name.split(".", 2)[-1] if name.startswith("tied_modules.") else name.split(".", 1)[1]: t
             for name, t in tensors.items()}
    if 1 <= idx <= n_layers:
        return hf.layer_to_hf(arch, ckpt.model, idx - 1, local)
    names = hf.embedding_names(arch)
    unknown = sorted(set(local) - set(names))
    if unknown:
        raise ConfigError(f"layer {idx} has parameters {unknown} that {hf.ARCHITECTURES[arch]} cannot hold")
    out = {}
    for name, t in local.items():
        out[names[name]] = t[:vocab] if name in ("word_embeddings.weight", "output_layer.weight") else t
    return hf.one_plus(ckpt.model, out)
