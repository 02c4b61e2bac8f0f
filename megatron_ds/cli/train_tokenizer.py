"""Train a tokenizer on your own JSONL corpus, offline.

    # GPT-2 style byte-level BPE: writes OUT/vocab.json + OUT/merges.txt
    python tools/train_tokenizer.py --input corpus/ --type bpe --vocab-size 32000 --output-dir tok/
    # SentencePiece: writes OUT/tokenizer.model (+ tokenizer.vocab)
    python tools/train_tokenizer.py --input corpus/ --type sentencepiece --vocab-size 32000 --output-dir tok/
    # BERT WordPiece (for BERT and T5): writes OUT/vocab.txt, one token a line
    python tools/train_tokenizer.py --input corpus/ --type wordpiece --vocab-size 30522 --output-dir tok/

The BPE files use GPT-2's exact layout (ids: the 256 byte symbols in GPT-2's order, then one token
per merge in merge order, then <|endoftext|>), so `--tokenizer-type GPT2BPETokenizer --vocab-file
tok/vocab.json --merge-file tok/merges.txt` reads them like GPT-2's own files, fast path included.
The WordPiece vocab.txt starts with [PAD] [UNK] [CLS] [SEP] [MASK] (ids 0-4: [PAD] must be 0, T5's
attention masks treat id 0 as padding, as Megatron does) and is read with `--tokenizer-type
BertWordPieceLowerCase` (or BertWordPieceCase when trained with --cased).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from itertools import islice

from megatron_ds.cli.preprocess_data import PreprocessError, iter_json_texts, resolve_inputs
from megatron_ds.data.bpe_reference import bytes_to_unicode

EOD = "<|endoftext|>"


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", required=True, help="a .jsonl/.jsonl.gz file, a glob, or a directory of them")
    p.add_argument("--json-keys", nargs="+", default=["text"])
    p.add_argument("--type", choices=["bpe", "sentencepiece", "wordpiece"], default="bpe")
    p.add_argument("--cased", action="store_true",
                   help="wordpiece: keep case and accents (for BertWordPieceCase; default: lower-cased)")
    p.add_argument("--vocab-size", type=int, required=True, help="total size, special tokens included")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--min-frequency", type=int, default=2, help="bpe: a pair must occur this often to be merged")
    p.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe", help="sentencepiece algorithm")
    p.add_argument("--character-coverage", type=float, default=0.9995, help="sentencepiece")
    p.add_argument("--byte-fallback", action="store_true", help="sentencepiece: unknown characters become byte pieces")
    p.add_argument("--max-docs", type=int, default=None, help="train on at most this many documents")
    args = p.parse_args(argv)
    if args.type == "bpe" and args.vocab_size < 257:
        p.error(f"--vocab-size {args.vocab_size} is too small: byte-level BPE needs 256 byte tokens + {EOD}")
    return args


def _texts(args):
    texts = (text for _, text in iter_json_texts(resolve_inputs(args.input), args.json_keys))
    return islice(texts, args.max_docs) if args.max_docs else texts


def gpt2_layout(merges):
    """vocab (token -> id) in GPT-2's layout for these merges. A merge whose result already exists
    keeps its place in merges.txt but adds no token."""
    vocab = {ch: i for i, ch in enumerate(sorted(bytes_to_unicode().values()))}
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    vocab[EOD] = len(vocab)
    return vocab


def _say_if_smaller(size: int, args, log) -> None:
    """A small corpus runs out of merges (BPE: pairs below --min-frequency) or pieces (SentencePiece,
    trained with hard_vocab_limit off) before --vocab-size: the model's vocabulary is what was
    trained, so say it, with the number to pass on."""
    if size < args.vocab_size:
        log(f"WARNING: the trained vocabulary has {size} tokens, fewer than --vocab-size {args.vocab_size}: the "
            f"corpus has too few distinct {'pairs' if args.type == 'bpe' else 'pieces'} for more (more data"
            f"{', or a lower --min-frequency' if args.type == 'bpe' else ''}); the model's vocabulary is {size}")


def train_bpe(args, log):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab_size - 1,  # the last id is <|endoftext|>, added below
        min_frequency=args.min_frequency,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=sys.stderr.isatty(),
    )
    tok.train_from_iterator(_texts(args), trainer=trainer)
    raw = json.loads(tok.to_str())["model"]["merges"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in raw]
    vocab = gpt2_layout(merges)
    os.makedirs(args.output_dir, exist_ok=True)
    vocab_path, merges_path = os.path.join(args.output_dir, "vocab.json"), os.path.join(args.output_dir, "merges.txt")
    with open(vocab_path, "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(merges_path, "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n")
        f.writelines(f"{a} {b}\n" for a, b in merges)
    log(f"> trained byte-level BPE: {len(vocab)} tokens ({len(merges)} merges)")
    _say_if_smaller(len(vocab), args, log)
    log(f"> use: --tokenizer-type GPT2BPETokenizer --vocab-file {vocab_path} --merge-file {merges_path}")
    return vocab_path, merges_path


def train_sentencepiece(args, log):
    import sentencepiece as spm

    def sentences():
        # SentencePiece trains on lines; it skips lines over max_sentence_length on its own.
        for text in _texts(args):
            yield from (line for line in text.split("\n") if line.strip())

    os.makedirs(args.output_dir, exist_ok=True)
    prefix = os.path.join(args.output_dir, "tokenizer")
    spm.SentencePieceTrainer.train(
        sentence_iterator=sentences(),
        model_prefix=prefix,
        vocab_size=args.vocab_size,
        model_type=args.model_type,
        character_coverage=args.character_coverage,
        byte_fallback=args.byte_fallback,
        hard_vocab_limit=False,  # a small demo corpus gets a smaller vocabulary, not an error
        minloglevel=1,
    )
    sp = spm.SentencePieceProcessor(model_file=prefix + ".model")
    log(f"> trained SentencePiece ({args.model_type}): {sp.get_piece_size()} pieces")
    _say_if_smaller(sp.get_piece_size(), args, log)
    log(f"> use: --tokenizer-type SentencePieceTokenizer --tokenizer-model {prefix}.model")
    return (prefix + ".model",)


BERT_SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def train_wordpiece(args, log):
    """A BERT vocab.txt trained with HF tokenizers' WordPiece trainer on text normalized and split as
    BertWordPieceLowerCase / BertWordPieceCase tokenize it. The trainer numbers `##` pieces in
    hash-map order, so two trainings on the same corpus may order (and, at tied merges, choose) a
    few tokens differently: train once and keep the file with the data made from it."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    lower = not args.cased
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=lower,
                                                lowercase=lower)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(vocab_size=args.vocab_size, min_frequency=args.min_frequency,
                                        special_tokens=list(BERT_SPECIAL_TOKENS), continuing_subword_prefix="##",
                                        show_progress=sys.stderr.isatty())
    tok.train_from_iterator(_texts(args), trainer=trainer)
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    os.makedirs(args.output_dir, exist_ok=True)
    path = os.path.join(args.output_dir, "vocab.txt")
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(f"{token}\n" for token, _ in vocab)
    log(f"> trained WordPiece: {len(vocab)} tokens")
    _say_if_smaller(len(vocab), args, log)
    kind = "BertWordPieceCase" if args.cased else "BertWordPieceLowerCase"
    log(f"> use: --tokenizer-type {kind} --vocab-file {path}")
    return (path,)


def main(argv=None) -> int:
    args = get_args(argv)
    log = lambda msg: print(msg, file=sys.stderr)  # noqa: E731
    train = {"bpe": train_bpe, "sentencepiece": train_sentencepiece, "wordpiece": train_wordpiece}[args.type]
    try:
        train(args, log)
    except PreprocessError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
