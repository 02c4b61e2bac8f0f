"""--load compares the tokenizer a checkpoint was trained with to this run's (checkpoint/vocabulary.py).

Through pretrain_gpt.py's main, as a user meets it: a checkpoint trained with one byte-level BPE,
loaded with another one (and data made with it). Refused in one line naming both (by --dry-run
too); with --allow-vocab-change loaded with its vocabulary rows resized, which the saved weights
then show.
"""
import json

import pytest
import torch

from megatron_ds.checkpoint import load_consolidated
from megatron_ds.checkpoint.vocabulary import check_vocabulary, rows_only, saved_tokenizer
from megatron_ds.cli import preprocess_data, train_tokenizer
from megatron_ds.errors import ConfigError
from megatron_ds.families.gpt.gpt_family import GPT
from tests.data.test_tokenizer import training_corpus
from tests.distributed import run_distributed
from tests.training.cli import cli_many

MODEL = ("--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 16 --max-position-embeddings 16 "
         "--micro-batch-size 2 --lr-decay-iters 4 --log-interval 1 --eval-iters 0 --num-workers 0 --split 100,0,0 "
         "--tokenizer-type GPT2BPETokenizer --seed 1234").split()


def _tokenizer_and_data(root, corpus, size):
    """A BPE of ``size`` tokens trained on ``corpus`` and the corpus preprocessed with it."""
    tok = root / f"bpe{size}"
    assert train_tokenizer.main(["--input", str(corpus), "--vocab-size", str(size), "--output-dir", str(tok)]) == 0
    files = ["--vocab-file", str(tok / "vocab.json"), "--merge-file", str(tok / "merges.txt")]
    prefix = root / f"data{size}"
    assert preprocess_data.main(["--input", str(corpus), "--output-prefix", str(prefix), "--append-eod",
                                 "--tokenizer-type", "GPT2BPETokenizer", *files]) == 0
    return files + ["--data-path", f"{prefix}_text_document", "--data-cache-path", str(root / "cache")]


def test_another_tokenizer_is_refused_and_extends_on_purpose(tmp_path):
    corpus = training_corpus(tmp_path / "corpus.jsonl", n_docs=100)
    small, big = _tokenizer_and_data(tmp_path, corpus, 300), _tokenizer_and_data(tmp_path, corpus, 400)
    saved, extended = str(tmp_path / "ckpt300"), str(tmp_path / "ckpt400")
    runs = [MODEL + small + ["--lr", "1e-3", "--train-iters", "2", "--save", saved],
            MODEL + big + ["--lr", "1e-3", "--train-iters", "3", "--load", saved],
            MODEL + big + ["--lr", "1e-3", "--train-iters", "3", "--load", saved, "--dry-run"],
            # lr 0: the one step trained after loading leaves the weights as loaded, to be read back
            MODEL + big + ["--lr", "0", "--override-lr-scheduler", "--train-iters", "3", "--load", saved,
                           "--allow-vocab-change", "--save", extended]]
    (rc0, _, err0), (rc1, out1, err1), dry, (rc2, out2, err2) = run_distributed(cli_many, 1, runs, timeout=900)[0]
    assert rc0 == 0, err0
    vocab300 = runs[0][runs[0].index("--vocab-file") + 1]
    assert rc1 == 1 and " iteration " not in out1, out1[-2000:]
    assert err1.strip() == (
        f"error: checkpoint {saved}/global_step2 was trained with another tokenizer (vocabulary size: checkpoint "
        f"300 vs now 400; EOD id: checkpoint 299 vs now 399); train with its tokenizer (--tokenizer-type "
        f"GPT2BPETokenizer --vocab-file {vocab300} --merge-file {vocab300[:-len('vocab.json')]}merges.txt), or "
        f"pass --allow-vocab-change to resize its embedding and output rows to this tokenizer's 400 tokens")
    assert dry[0] == 1 and dry[2] == err1, dry[2]  # --dry-run finds it before the queue
    assert rc2 == 0, err2
    assert (f"NOTE: --allow-vocab-change: checkpoint {saved}/global_step2 was trained with another tokenizer "
            f"(vocabulary size: checkpoint 300 vs now 400; EOD id: checkpoint 299 vs now 399); embedding and "
            f"output rows resized to this tokenizer's 400 tokens (padded 512): rows 300-399 are new and start at "
            f"the mean of the checkpoint's 300 rows") in out2
    before = load_consolidated(saved, log=lambda *a: None, family=GPT).state_dict
    after = load_consolidated(extended, log=lambda *a: None, family=GPT)
    key = next(k for k in before if k.endswith("word_embeddings.weight"))
    old, new = before[key], after.state_dict[key]
    assert (old.shape[0], new.shape[0]) == (384, 512)  # 300 and 400 tokens padded to multiples of 128
    assert torch.equal(new[:300], old[:300])
    expected = old[:300].double().mean(dim=0).float()  # in float64 here, float32 in the loader
    assert torch.allclose(new[300:400], expected.expand(100, -1), rtol=0, atol=1e-6)
    # the extended checkpoint records the new tokenizer: resuming it with that one needs no flag
    meta = json.loads((tmp_path / "ckpt400" / "global_step3" / "megatron_ds_config.json").read_text())
    assert meta["tokenizer"]["vocab_size"] == 400 and meta["tokenizer"]["eod"] == 399


def _now(size, eod, digest="d1", kind="GPT2BPETokenizer"):
    return {"type": kind, "vocab_size": size, "eod": eod, "digest": digest}


def test_what_is_compared():
    """Two vocabularies of one size by their digest; the type only where a digest is missing; checkpoints
    without a record by their real size, imports and the oldest by their padded rows."""
    check = lambda saved, now: check_vocabulary(saved, now, path="ck", allow_change=False, padded=0)  # noqa: E731
    with pytest.raises(ConfigError, match=r"\(same size, other tokens: digest checkpoint d1 vs now d2\)"):
        check(_now(400, 399), _now(400, 399, "d2"))
    # the same id -> token mapping from vocab.json + merges.txt and from tokenizer.json
    assert check(_now(400, 399), _now(400, 399, kind="HFTokenizer")) is None
    with pytest.raises(ConfigError, match=r"\(tokenizer type: checkpoint GPT2BPETokenizer vs now HFTokenizer\)"):
        check(_now(400, 399, None), _now(400, 399, kind="HFTokenizer"))
    older = {"signature": {"padded_vocab_size": 512}, "vocab_size": 400,
             "config": {"data": {"tokenizer_type": "HuggingFaceTokenizer"}}}
    assert check(saved_tokenizer(older), _now(400, 399, kind="HFTokenizer")) is None
    with pytest.raises(ConfigError, match=r"\(vocabulary size: checkpoint 400 vs now 401\)"):
        check(saved_tokenizer(older), _now(401, 400, kind="HFTokenizer"))
    # a GPT-2 import without tokenizer files: 50257 unpadded rows; at TP 2 an old checkpoint's 50432
    imported = {"signature": {"padded_vocab_size": 50257}, "vocab_size": 50257, "imported_from": "hf"}
    assert saved_tokenizer(imported) == rows_only(50257, None, 1)
    assert check(saved_tokenizer(imported), _now(50257, 50256)) is None
    with pytest.raises(ConfigError, match=r"vocabulary rows: checkpoint 50257 vs 1024 for this tokenizer's 1000 "):
        check(saved_tokenizer(imported), _now(1000, 999))
    assert check(rows_only(50432, 128, 2), _now(50257, 50256)) is None
