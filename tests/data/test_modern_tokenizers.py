"""The tokenizers of today's open models (Llama 2/3.x, Qwen2.5/3, Mistral) under Megatron-LM's names,
each against an independent reference built from the same tiny local files: transformers'
AutoTokenizer (HuggingFaceTokenizer; Megatron-LM core_v0.19.0 HuggingFaceTokenizer.text_to_ids is
``AutoTokenizer(text).input_ids``), sentencepiece itself (Llama2Tokenizer: legacy
megatron/training/tokenizer/tokenizer.py _Llama2Tokenizer.tokenize prepends bos), tiktoken itself
(TikTokenizer: core_v0.19.0 tiktoken_tokenizer.py; Llama3Tokenizer: Meta's llama3 llama/tokenizer.py),
with their BOS/EOD; then preprocess_data.py end to end and the HF export's tokenizer files."""
import base64
import json

import numpy as np
import pytest

from megatron_ds.cli import preprocess_data
from megatron_ds.config.schema import DataConfig
from megatron_ds.data.indexed_dataset import MMapIndexedDataset
from megatron_ds.data.tokenizer import TokenizerError, build_tokenizer, build_tokenizer_for
from tests.data.test_tokenizer import VARIED

TEXTS = VARIED[:14] + ["", "special <|end_of_text|> and </s> and <|endoftext|> inline", "tail"]
# Meta's Llama 3 pattern as transformers' TikTokenConverter spells it (its default pattern)
LLAMA3_PAT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
# Megatron-LM's _PATTERN_TIKTOKEN_V1 (tiktoken_tokenizer.py), copied
MEGATRON_V1 = r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"
MERGES = [b"th", b"he", b"in", b"an", b"er", b" t", b" th", b"the", b" the", b"ing", b"re", b"on", b" a", b"and",
          b" and", b"\xe6\x97", b"\xe6\x97\xa5", b"ou", b"you", b" you", b"  ", b"    ", b"\n\n"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("modern")
    ranks = {bytes([i]): i for i in range(256)}
    for token in MERGES:  # every merge joins two earlier tokens: a valid BPE rank file
        assert any(token[:k] in ranks and token[k:] in ranks for k in range(1, len(token)))
        ranks[token] = len(ranks)
    # Meta's format: "base64 rank" per line
    (d / "tokenizer.model").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    # Megatron-LM's TikTokenizer format: a JSON list of {rank, token_bytes, token_str}
    (d / "tik.json").write_text(json.dumps([{"rank": r, "token_bytes": base64.b64encode(t).decode(),
                                             "token_str": t.decode("utf-8", "replace")} for t, r in ranks.items()]))
    import sentencepiece as spm

    corpus = [t for t in VARIED if t.strip()] * 20
    spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus), model_prefix=str(d / "sp"), vocab_size=600,
                                   model_type="bpe", character_coverage=1.0, bos_id=1, eos_id=2, unk_id=0,
                                   minloglevel=2, byte_fallback=True, normalization_rule_name="identity",
                                   remove_extra_whitespaces=False, split_digits=True)  # Llama 2's settings
    return {"dir": d, "ranks": ranks, "llama3": str(d / "tokenizer.model"), "tik": str(d / "tik.json"),
            "sp": str(d / "sp.model"), "hf_llama3": _hf_dir(d / "hf_llama3", "llama3"), "hf_qwen": _hf_dir(d / "hf_qwen", "qwen")}


def _hf_dir(d, kind):
    """A tokenizer.json trained here plus a tokenizer_config.json laid out like Llama 3's (BOS by a
    TemplateProcessing post-processor, eos <|end_of_text|>) or Qwen2.5's (no BOS, eos <|endoftext|>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"] if kind == "llama3" else \
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(VARIED * 5, trainers.BpeTrainer(vocab_size=600, special_tokens=specials,
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if kind == "llama3":
        tok.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
            special_tokens=[("<|begin_of_text|>", 0)])
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
                  "eos_token": "<|end_of_text|>"}
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        config = {"tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|endoftext|>",
                  "pad_token": "<|endoftext|>", "errors": "replace"}
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return str(d)


def _llama3_reference(files):
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    ranks = load_tiktoken_bpe(files["llama3"])  # tiktoken's own reader of a local file
    names = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
             "<|reserved_special_token_2|>", "<|reserved_special_token_3|>", "<|start_header_id|>",
             "<|end_header_id|>", "<|reserved_special_token_4|>", "<|eot_id|>"]
    names += [f"<|reserved_special_token_{i}|>" for i in range(5, 251)]
    specials = {t: len(ranks) + i for i, t in enumerate(names)}
    return tiktoken.Encoding("ref", pat_str=LLAMA3_PAT, mergeable_ranks=ranks, special_tokens=specials), specials


def test_llama3_tokenizer_against_tiktoken(files):
    enc, specials = _llama3_reference(files)
    tok = build_tokenizer("Llama3Tokenizer", tokenizer_model=files["llama3"], log=None)
    bos, eos = specials["<|begin_of_text|>"], specials["<|end_of_text|>"]
    assert (tok.bos, tok.eod, tok.vocab_size) == (bos, eos, len(files["ranks"]) + 256) == (279, 280, 535)
    expected = [[bos] + enc.encode(t, allowed_special="all") for t in TEXTS]
    assert [tok.tokenize(t) for t in TEXTS] == expected == tok.tokenize_batch(TEXTS)
    assert eos in expected[TEXTS.index(TEXTS[-2])]  # the special token inside the text is its id
    assert tok.detokenize(expected[1][1:]) == TEXTS[1]
    assert len(tok.vocab) == tok.vocab_size  # unique spellings, all ids


def _meta_split(s, max_chars, max_run):
    """Meta's llama/tokenizer.py, Tokenizer.encode's chunks and _split_whitespaces_or_nonwhitespaces, ported."""
    for i in range(0, len(s), max_chars):
        chunk = s[i:i + max_chars]
        run_len, is_space, start = 0, chunk[0].isspace() if chunk else False, 0
        for j, ch in enumerate(chunk):
            if is_space ^ ch.isspace():
                run_len, is_space = 1, ch.isspace()
            else:
                run_len += 1
                if run_len > max_run:
                    yield chunk[start:j]
                    start, run_len = j, 1
        yield chunk[start:]


def test_llama3_long_texts_cut_as_meta_does(files, monkeypatch):
    import random

    from megatron_ds.data import tiktoken_tokenizers as tt

    rng = random.Random(0)
    with monkeypatch.context() as m:  # small limits: the cutting rule itself
        m.setattr(tt, "LLAMA3_MAX_RUN_CHARS", 5)
        m.setattr(tt, "LLAMA3_MAX_ENCODE_CHARS", 12)
        for _ in range(300):
            text = "".join(rng.choice("ab \n\u3000") * rng.randrange(1, 9) for _ in range(rng.randrange(2, 12)))
            assert tt.meta_llama3_pieces(text) == list(_meta_split(text, 12, 5)), repr(text)
    enc, specials = _llama3_reference(files)
    text = " ".join(rng.choice(["the", "and", "you", "in"]) for _ in range(110_000)) + " " * 30_000 + "end"
    tok = build_tokenizer("Llama3Tokenizer", tokenizer_model=files["llama3"], log=None)
    pieces = list(_meta_split(text, 400_000, 25_000))
    assert len(pieces) == 3  # a 400,000-character chunk, then the space run cut after 25,000
    assert tok.tokenize(text) == [specials["<|begin_of_text|>"]] + [i for p in pieces for i in enc.encode(p)]


@pytest.mark.parametrize("pattern", ["v1", "v2"])
def test_tiktokenizer_against_tiktoken(files, pattern):
    import tiktoken

    n_special, n = 10, len(files["ranks"])
    tok = build_tokenizer("TikTokenizer", tokenizer_model=files["tik"], vocab_size=n + n_special,
                          tiktoken_pattern=pattern, tiktoken_num_special_tokens=n_special, log=None)
    names = ["<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>", "<SPECIAL_7>", "<SPECIAL_8>", "<SPECIAL_9>"]
    pat = MEGATRON_V1 if pattern == "v1" else tok.pattern  # v2: the ids below still come from tiktoken
    enc = tiktoken.Encoding("ref", pat_str=pat, mergeable_ranks={t: r + n_special for t, r in files["ranks"].items()},
                            special_tokens={t: i for i, t in enumerate(names)})
    assert (tok.eod, tok.bos, tok.vocab_size) == (2, 1, n + n_special)  # </s>; no BOS added
    assert tok.tokenize_batch(TEXTS) == [enc.encode(t, allowed_special="all") for t in TEXTS]
    assert tok.tokenize("a</s>b") == [ord("a") + n_special, 2, ord("b") + n_special]
    with pytest.raises(TokenizerError, match=r"holds 279 tokens; --vocab-size 131072 needs 130072 .*pass --vocab-size 1279"):
        build_tokenizer("TikTokenizer", tokenizer_model=files["tik"], log=None)
    with pytest.raises(TokenizerError, match="must be unique and include"):
        build_tokenizer("TikTokenizer", tokenizer_model=files["tik"], vocab_size=n + 10,
                        tiktoken_num_special_tokens=10, tokenizer_special_tokens=["<s>", "</s>"], log=None)
    with pytest.raises(TokenizerError, match="line 1 is not 'base64-token rank'"):
        build_tokenizer("Llama3Tokenizer", tokenizer_model=files["tik"], log=None)


def test_llama2_tokenizer_against_sentencepiece(files):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=files["sp"])
    tok = build_tokenizer("Llama2Tokenizer", tokenizer_model=files["sp"], log=None)
    assert (tok.bos, tok.eod, tok.vocab_size) == (sp.bos_id(), sp.eos_id(), sp.get_piece_size()) == (1, 2, 600)
    assert tok.tokenize_batch(TEXTS) == [[sp.bos_id()] + sp.encode(t) for t in TEXTS] == [tok.tokenize(t) for t in TEXTS]
    assert tok.detokenize(tok.tokenize(TEXTS[1])) == TEXTS[1]


@pytest.mark.parametrize("kind", ["hf_llama3", "hf_qwen"])
def test_huggingface_tokenizer_equals_auto_tokenizer(files, kind):
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(files[kind], local_files_only=True)
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=files[kind], log=None)
    assert tok.tokenize_batch(TEXTS) == [auto(t).input_ids for t in TEXTS] == [tok.tokenize(t) for t in TEXTS]
    assert tok.eod == auto.eos_token_id
    assert tok.adds_bos == (kind == "hf_llama3") and tok.tokenize("x")[0] == (0 if tok.adds_bos else tok.tokenize("x")[0])
    assert tok.bos == auto.bos_token_id  # None for Qwen
    # --tokenizer-hf-no-include-special-tokens: Megatron-LM's tokens_to_ids(tokenize(text))
    bare = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=files[kind], hf_include_special_tokens=False, log=None)
    assert bare.tokenize_batch(TEXTS) == [auto.convert_tokens_to_ids(auto.tokenize(t)) for t in TEXTS]
    assert not bare.adds_bos and bare.detokenize(tok.tokenize(TEXTS[1])) == TEXTS[1]


def _read_docs(prefix):
    ds = MMapIndexedDataset(prefix)
    return [np.concatenate(ds[int(ds.doc_idx[d]): int(ds.doc_idx[d + 1])]).tolist() for d in range(len(ds.doc_idx) - 1)]


@pytest.mark.parametrize("kind,bare", [("Llama3Tokenizer", False), ("TikTokenizer", False), ("Llama2Tokenizer", False),
                                       ("HuggingFaceTokenizer", False), ("HuggingFaceTokenizer", True)])
def test_preprocess_round_trip(files, tmp_path, kind, bare, capsys):
    model = {"Llama3Tokenizer": files["llama3"], "TikTokenizer": files["tik"], "Llama2Tokenizer": files["sp"],
             "HuggingFaceTokenizer": files["hf_llama3"]}[kind]
    extra = ["--vocab-size", "289", "--tiktoken-num-special-tokens", "10"] if kind == "TikTokenizer" else []
    extra += ["--tokenizer-hf-no-include-special-tokens"] if bare else []
    texts = [t for t in TEXTS if t] * 3
    with open(tmp_path / "in.jsonl", "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    prefix = str(tmp_path / "out")
    assert preprocess_data.main(["--input", str(tmp_path / "in.jsonl"), "--output-prefix", prefix, "--tokenizer-type",
                                 kind, "--tokenizer-model", model, "--append-eod", "--workers", "2",
                                 "--log-interval", "1", *extra]) == 0
    tok = build_tokenizer(kind, tokenizer_model=model, log=None, vocab_size=289 if kind == "TikTokenizer" else None,
                          tiktoken_num_special_tokens=10, hf_include_special_tokens=not bare)
    assert tok.adds_bos == (kind != "TikTokenizer" and not bare)
    assert _read_docs(prefix + "_text_document") == [tok.tokenize(t) + [tok.eod] for t in texts]
    err = capsys.readouterr().err
    assert f"building {tok.name} tokenizer" in err and "docs" in err


@pytest.mark.parametrize("kind", ["Llama3Tokenizer", "TikTokenizer", "Llama2Tokenizer", "GPTSentencePieceTokenizer",
                                  "HuggingFaceTokenizer"])
def test_export_writes_files_auto_tokenizer_reads(files, tmp_path, kind):
    """The to_hf export's tokenizer step (gpt_hf_export.save_tokenizer): AutoTokenizer reads what it
    wrote and gives our ids, BOS included."""
    from transformers import AutoTokenizer

    from megatron_ds.families.gpt.gpt_hf_export import save_tokenizer

    model = {"Llama3Tokenizer": files["llama3"], "TikTokenizer": files["tik"], "Llama2Tokenizer": files["sp"],
             "GPTSentencePieceTokenizer": files["sp"], "HuggingFaceTokenizer": files["hf_qwen"]}[kind]
    data = DataConfig(tokenizer_type=kind, tokenizer_model=model, vocab_size=289 if kind == "TikTokenizer" else None,
                      tiktoken_num_special_tokens=10)
    ours = build_tokenizer_for(data, log=None)
    save_tokenizer(data, ours.eod, str(tmp_path), log=lambda *a: None)
    auto = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    # SentencePiece reads "</s>" in text as text, transformers as the token (Meta's Llama 2 files too)
    sentencepiece = kind in ("Llama2Tokenizer", "GPTSentencePieceTokenizer")
    texts = [t for t in TEXTS if t and not (sentencepiece and "</s>" in t)]
    assert [auto(t).input_ids for t in texts] == ours.tokenize_batch(texts)
    assert auto.decode(ours.tokenize(TEXTS[1]), skip_special_tokens=True) == TEXTS[1]
    # the same id -> token mapping: a run resumed on the exported files with HuggingFaceTokenizer
    # passes the checkpoint's tokenizer check (checkpoint/vocabulary.py compares these digests)
    from megatron_ds.checkpoint.vocabulary import _digest

    exported = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path), log=None)
    assert _digest(exported) == _digest(ours) and exported.eod == ours.eod
    assert auto.eos_token_id == ours.eod


def test_training_records_the_tokenizer(files, tmp_path):
    """A short pretrain_gpt.py run on Llama3Tokenizer data: the vocabulary (535 ids) pads as usual and
    the checkpoint records the tokenizer (type, size, eod, digest) and its flags for later tools."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from megatron_ds.checkpoint.format import read_meta
    from megatron_ds.checkpoint.vocabulary import TOKENIZER, tokenizer_record

    repo = Path(__file__).resolve().parents[2]
    with open(tmp_path / "in.jsonl", "w") as f:
        f.writelines(json.dumps({"text": " ".join(VARIED[i % 14: i % 14 + 4])}) + "\n" for i in range(60))
    prefix = str(tmp_path / "d")
    assert preprocess_data.main(["--input", str(tmp_path / "in.jsonl"), "--output-prefix", prefix, "--tokenizer-type",
                                 "Llama3Tokenizer", "--tokenizer-model", files["llama3"], "--append-eod"]) == 0
    ckpt = str(tmp_path / "ckpt")
    argv = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
            "--micro-batch-size", "2", "--train-iters", "2", "--lr", "1e-3", "--data-path", prefix + "_text_document",
            "--split", "100,0,0", "--tokenizer-type", "Llama3Tokenizer", "--tokenizer-model", files["llama3"],
            "--num-workers", "0", "--data-cache-path", str(tmp_path / "cache"), "--save", ckpt, "--save-interval", "2",
            "--eval-iters", "0", "--log-interval", "1"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, str(repo / "pretrain_gpt.py"), *argv], capture_output=True, text=True,
                          cwd=repo, timeout=300, env=dict(env, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "building Llama3Tokenizer tokenizer: vocab size 535, eod id 280, bos id 279 prepended" in out
    meta = read_meta(os.path.join(ckpt, "global_step2"))
    assert meta["signature"]["padded_vocab_size"] == 640  # 535 up to a multiple of 128 x TP 1
    tok = build_tokenizer("Llama3Tokenizer", tokenizer_model=files["llama3"], log=None)
    assert meta[TOKENIZER] == tokenizer_record(tok, "Llama3Tokenizer", 280)
    assert meta["config"]["data"]["tokenizer_model"] == files["llama3"]
    # generation rebuilds the recorded tokenizer (no tokenizer flags): BOS before the prompt, eod stops it
    from megatron_ds.cli.generate_samples_gpt import main as generate

    gen_out = str(tmp_path / "gen.jsonl")
    assert generate(["--load", ckpt, "--greedy", "--max-new-tokens", "3", "--prompt", "the", "--output", gen_out]) == 0
    result = json.loads(open(gen_out).read().splitlines()[0])
    assert result["prompt"] == "the" and 1 <= result["new_tokens"] <= 3
    # the HF export: config bos/eos are Llama 3's, and AutoTokenizer reads the written files
    from transformers import AutoConfig, AutoTokenizer

    from megatron_ds.cli import to_hf

    hf_dir = str(tmp_path / "hf")
    assert to_hf.main(["--load", ckpt, "--out", hf_dir]) == 0
    config = AutoConfig.from_pretrained(hf_dir, local_files_only=True)
    assert (config.bos_token_id, config.eos_token_id, config.vocab_size) == (279, 280, 535)
    assert AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)("the end").input_ids == tok.tokenize("the end")


@pytest.mark.parametrize("kind", ["Llama2Tokenizer", "TikTokenizer", "Llama3Tokenizer", "HuggingFaceTokenizer"])
def test_each_needs_its_tokenizer_model(kind):
    from megatron_ds.config import parse_args
    from megatron_ds.config.validation import missing_flags

    cfg, _ = parse_args(["--tokenizer-type", kind])
    assert f"--tokenizer-model (for {kind})" in missing_flags(cfg)
    with pytest.raises(TokenizerError, match=f"--tokenizer-type {kind} needs --tokenizer-model"):
        build_tokenizer(kind, log=None)


def test_refusals_are_one_line(files):
    with pytest.raises(TokenizerError, match="--tokenizer-special-tokens is supported with --tokenizer-type "
                                             "TikTokenizer only"):
        build_tokenizer("Llama3Tokenizer", tokenizer_model=files["llama3"], tokenizer_special_tokens=["<x>"], log=None)
    with pytest.raises(TokenizerError, match="does not exist; HuggingFaceTokenizer loads a local tokenizer.json"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model="meta-llama/Llama-3.1-8B", log=None)
    with pytest.raises(TokenizerError, match="is not a SentencePiece model .*Llama3Tokenizer"):
        build_tokenizer("Llama2Tokenizer", tokenizer_model=files["llama3"], log=None)


def test_eval_harness_takes_bos_as_hflm_does(files):
    """lm-eval's HFLM encodes without special tokens and puts the tokenizer's BOS first only as the
    prefix of an empty context; the harness keeps that rule with tokenizers that prepend a BOS."""
    from types import SimpleNamespace

    from megatron_ds.inference.harness import MegatronLM

    tok = build_tokenizer("Llama3Tokenizer", tokenizer_model=files["llama3"], log=None)
    lm = MegatronLM(SimpleNamespace(max_positions=None), tok, max_length=16)
    assert lm.prefix_token_id == tok.bos and lm.eot_token_id == tok.eod
    assert lm.tok_encode("the end") == tok.tokenize("the end")[1:]
