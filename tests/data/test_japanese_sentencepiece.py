"""--tokenizer-type JapaneseSentencePiece against transcriptions of the forks' two definitions, on
SentencePiece models trained here.

Transcribed from megatron/tokenizer/tokenizer.py ``_JapaneseSentencePiece``:
  kojimano/Megatron-DeepSpeed-ABCI (HEAD a3fbb95; also llm-jp/Megatron-DeepSpeed ef71207 on its July 2023
  branches): eod = piece_to_id("<|endoftext|>"), pad = piece_to_id("<|padding|>"), eol "<|endofline|>";
  tokenize replaces "\\n" then "\\r\\n" by eol and encodes; detokenize decodes and turns eol back into "\\n".
  llm-jp/Megatron-DeepSpeed main (c30dba5 "feat: tokenizer-v2"): eod "</s>", pad "<pad>", eol "\\n";
  detokenize is the plain decode. Both: vocab_size = the processor's vocab_size().
"""
from __future__ import annotations

import json

import pytest

from megatron_ds.data.tokenizer import TokenizerError, build_tokenizer
from tests.data.test_tokenizer import VARIED, _tool, fuzz_texts, training_corpus

TEXTS = VARIED + fuzz_texts(200, seed=7) + ["一行目\n二行目\r\n三行目\n\n", "<|endofline|> と <|endoftext|>"]


class Transcribed:
    def __init__(self, model_file, eod, pad, eol, restore_eol):
        import sentencepiece

        self.tokenizer = sentencepiece.SentencePieceProcessor(model_file=model_file)
        self.eod_id, self.pad_id = self.tokenizer.piece_to_id(eod), self.tokenizer.piece_to_id(pad)
        self.eol_symbol, self.restore_eol = eol, restore_eol

    @property
    def vocab_size(self):
        return self.tokenizer.vocab_size()

    def tokenize(self, text):
        text = text.replace("\n", self.eol_symbol)
        text = text.replace("\r\n", self.eol_symbol)
        return self.tokenizer.encode(text)

    def detokenize(self, ids):
        text = self.tokenizer.decode(ids)
        return text.replace(self.eol_symbol, "\n") if self.restore_eol else text


def _train(tmp_path, name, **options):
    import sentencepiece as spm

    corpus = training_corpus(tmp_path / f"{name}.jsonl")
    lines = [json.loads(line)["text"] for line in corpus.read_text(encoding="utf-8").splitlines()]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines + ["日本語の文です。"] * 50),
                                   model_prefix=str(tmp_path / name), vocab_size=600, hard_vocab_limit=False,
                                   character_coverage=1.0, minloglevel=2, **options)
    return str(tmp_path / f"{name}.model")


def train_abci_recipe(directory) -> str:
    """A small model by the ABCI fork's recipe (kojimano/Megatron-DeepSpeed-ABCI abci/tokenizer/README.md,
    its "identity" model): unigram, byte fallback, <unk> 0, no bos/eos/pad, the three specials as
    user-defined symbols, identity normalization, no dummy prefix."""
    return _train(directory, "abci", model_type="unigram", byte_fallback=True, unk_id=0, bos_id=-1, eos_id=-1,
                  pad_id=-1, user_defined_symbols=["<|endoftext|>", "<|endofline|>", "<|padding|>"],
                  normalization_rule_name="identity", add_dummy_prefix=False)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("jsp")
    return {
        "abci": train_abci_recipe(d),
        "llm-jp": _train(d, "llmjp", pad_id=3),  # SentencePiece's defaults: <unk> 0, <s> 1, </s> 2; <pad> 3
    }


@pytest.mark.parametrize("variant,eod,pad,eol,restore", [
    ("abci", "<|endoftext|>", "<|padding|>", "<|endofline|>", True),
    ("llm-jp", "</s>", "<pad>", "\n", False),
])
def test_ids_specials_and_eod_equal_the_forks(models, variant, eod, pad, eol, restore):
    ours = build_tokenizer("JapaneseSentencePiece", vocab_file=models[variant], log=None)
    ref = Transcribed(models[variant], eod, pad, eol, restore)
    assert ours.variant == variant
    assert (ours.eod, ours.pad_id, ours.vocab_size) == (ref.eod_id, ref.pad_id, ref.vocab_size)
    assert ours.eod != ref.tokenizer.unk_id() and ours.pad_id != ref.tokenizer.unk_id()
    for text in TEXTS:
        assert ours.tokenize(text) == ref.tokenize(text), text
        assert ours.detokenize(ref.tokenize(text)) == ref.detokenize(ref.tokenize(text)), text
    assert ours.tokenize_batch(TEXTS) == [ref.tokenize(t) for t in TEXTS]
    if variant == "abci":  # newlines are the <|endofline|> piece, and come back
        newline = ours.tokenize("a\nb")
        assert ref.tokenizer.piece_to_id("<|endofline|>") in newline and ours.detokenize(newline) == "a\nb"


def test_refusals_name_the_file_and_the_pieces(tmp_path, models):
    with pytest.raises(TokenizerError, match="--tokenizer-type JapaneseSentencePiece needs --vocab-file"):
        build_tokenizer("JapaneseSentencePiece", tokenizer_model=models["abci"], log=None)
    bare = _train(tmp_path, "bare", eos_id=-1)
    with pytest.raises(TokenizerError, match=r"has neither \"<\|endoftext\|>\" with \"<\|endofline\|>\" nor"):
        build_tokenizer("JapaneseSentencePiece", vocab_file=bare, log=None)


def test_preprocessing_appends_the_forks_eod(tmp_path, models):
    """kojimano/Megatron-DeepSpeed-ABCI abci/jobs/data_processing/*.sh: preprocess_data.py --tokenizer-type
    JapaneseSentencePiece --vocab-file MODEL --dataset-impl mmap --workers N --append-eod."""
    from megatron_ds.data.indexed_dataset import MMapIndexedDataset

    docs = ["吾輩は猫である。\n名前はまだ無い。", "second document\r\nwith CRLF"]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    prefix = str(tmp_path / "out")
    assert _tool("preprocess_data").main([
        "--input", str(tmp_path / "in.jsonl"), "--output-prefix", prefix, "--vocab-file", models["abci"],
        "--dataset-impl", "mmap", "--tokenizer-type", "JapaneseSentencePiece", "--workers", "1",
        "--append-eod"]) == 0
    ref = Transcribed(models["abci"], "<|endoftext|>", "<|padding|>", "<|endofline|>", True)
    data = MMapIndexedDataset(prefix + "_text_document")
    assert [list(map(int, data[i])) for i in range(len(data))] == [ref.tokenize(d) + [ref.eod_id] for d in docs]
