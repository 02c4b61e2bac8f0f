"""Hugging Face tokenizer files for the tokenizers whose own files transformers does not read as they
are (Llama2Tokenizer's and GPTSentencePieceTokenizer's SentencePiece model, TikTokenizer's and
Llama 3's tiktoken files): written so
that ``AutoTokenizer.from_pretrained(out_dir)(text).input_ids`` equals our ``tokenize(text)``,
BOS included (tests/data/test_modern_tokenizers.py checks it)."""
from __future__ import annotations

import json
import os
import shutil


def save_hf_tokenizer(tok, out_dir: str, model_file: str) -> str:
    """Write ``tok``'s files into ``out_dir``; returns what was written, for the log line."""
    name = tok.name
    if name in ("Llama2Tokenizer", "GPTSentencePieceTokenizer"):
        return _save_sentencepiece(tok, out_dir, model_file, add_bos=name == "Llama2Tokenizer")
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    backend = tok.hf_tokenizer_object()
    inv = {i: t for t, i in tok._specials.items()}
    if name == "Llama3Tokenizer":
        bos = inv[tok.bos]
        # Meta's own HF files prepend <|begin_of_text|> with this post-processor
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.bos)])
        special = {"bos_token": bos, "eos_token": inv[tok.eod]}
    else:  # TikTokenizer: its special ids, nothing added around the text
        special = {"bos_token": inv[tok.bos], "eos_token": inv[tok.eod], "unk_token": inv[tok.unk],
                   "pad_token": inv[tok.pad]}
    PreTrainedTokenizerFast(tokenizer_object=backend, **special).save_pretrained(out_dir)
    return f"tokenizer.json converted from the tiktoken ranks ({', '.join(f'{k} {v}' for k, v in special.items())})"


def _save_sentencepiece(tok, out_dir: str, model_file: str, add_bos: bool) -> str:
    """transformers converts the SentencePiece model (LlamaTokenizer); its Metaspace pre-tokenizer
    ("first" prepend scheme) drops a space of a leading run that SentencePiece's dummy prefix keeps,
    so the pipeline Meta's Llama 2 tokenizer.json has (Prepend + Replace normalizer, no pre-tokenizer)
    replaces it. Special-token strings in text still become their ids there, unlike SentencePiece."""
    import tempfile

    from tokenizers import normalizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    sp = tok._sp
    names = {"bos_token": sp.id_to_piece(sp.bos_id()), "eos_token": sp.id_to_piece(sp.eos_id()),
             **({"unk_token": sp.id_to_piece(sp.unk_id())} if sp.unk_id() >= 0 else {})}
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copyfile(model_file, os.path.join(tmp, "tokenizer.model"))
        with open(os.path.join(tmp, "tokenizer_config.json"), "w") as f:
            json.dump({"tokenizer_class": "LlamaTokenizer", "add_bos_token": add_bos, "add_eos_token": False, **names}, f)
        backend = AutoTokenizer.from_pretrained(tmp, local_files_only=True).backend_tokenizer
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    backend.pre_tokenizer = None
    PreTrainedTokenizerFast(tokenizer_object=backend, **names).save_pretrained(out_dir)
    shutil.copyfile(model_file, os.path.join(out_dir, "tokenizer.model"))
    return f"tokenizer.json converted from the SentencePiece model ({'BOS' if add_bos else 'nothing'} added) " \
           f"and tokenizer.model"
