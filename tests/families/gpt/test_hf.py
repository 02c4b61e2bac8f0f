"""Hugging Face export and import.

- GPT-2-style (trained at TP 2 x PP 2) and Llama-style with GQA and an untied output layer
  (trained at TP 2 x DP 2 with ZeRO-1) export to a directory that transformers loads with no
  missing or unexpected weights, whose logits equal ours and whose greedy continuation equals ours.
  Ours: the single-process model with the consolidated weights (tests/checkpoint/test_consolidate.py
  ties those to the trained run). Tolerance: both fp32 on the same weights; different attention
  kernels and summation orders give ~1e-7 relative differences on logits of size ~1: atol 1e-5.
- import -> export reproduces the exported safetensors bitwise (pure reshuffling, fp32 throughout).
- A Llama built by transformers, imported, and trained here for one step at TP 2 reports the
  loss transformers computes for the same batch (fp32; atol 1e-5 on a loss of ~6).
- The GPT-2 tokenizer files written by the export give, through AutoTokenizer, our token ids.
"""
import json
import os

import pytest
import torch

from tests.checkpoint.common import train
from tests.distributed import run_distributed
from tests.training.common import TINY_GPT, train_losses

transformers = pytest.importorskip("transformers")
from megatron_ds.cli import from_hf, to_hf  # noqa: E402
from megatron_ds.families.gpt.gpt_family import GPT

LOGIT_TOL = dict(rtol=1e-5, atol=1e-5)
LAYOUTS = {"gpt2": ((2, 2, 1), []), "llama": ((2, 1, 2), ["--zero-stage", "1"])}
GPT2_FILES = os.path.join(os.path.dirname(__file__), "..", "..", "..", "..", "shared", "data", "gpt2")


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def exported(request, tmp_path_factory):
    style = request.param
    (tp, pp, dp), extra = LAYOUTS[style]
    ckpt = str(tmp_path_factory.mktemp(f"{style}-ckpt"))
    train(style, tp, pp, dp, 2, ["--save", ckpt, "--vocab-size", "500", *extra])  # pads to 504 at TP 2
    out = str(tmp_path_factory.mktemp(f"{style}-hf"))
    assert to_hf.main(["--load", ckpt, "--out", out]) == 0
    return style, ckpt, out


def _ours(ckpt):
    from megatron_ds.checkpoint import load_consolidated
    from megatron_ds.families.gpt.gpt_model import build_sequential_gpt

    c = load_consolidated(ckpt, log=lambda *a: None, family=GPT)
    model = build_sequential_gpt(c.model, padded_vocab_size=c.padded_vocab_size, vocab_size=c.vocab_size, seed=0)
    model.load_state_dict(c.state_dict)
    return model.eval()


def _our_logits(model, tokens):
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    return model((tokens, positions))


def test_export_gives_our_logits_and_greedy_tokens(exported):
    style, ckpt, out = exported
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert type(theirs).__name__ == {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}[style]
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert theirs.config.vocab_size == 500  # the padding rows are gone
    theirs.eval()
    ours = _ours(ckpt)
    tokens = torch.randint(0, 500, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = _our_logits(ours, tokens)
        assert torch.isinf(want[..., 500:]).all()  # padded columns are masked
        torch.testing.assert_close(theirs(input_ids=tokens).logits, want[..., :500], **LOGIT_TOL)
        prompt = tokens[:, :8]
        generated = theirs.generate(prompt, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
        seq = prompt
        for _ in range(10):
            seq = torch.cat([seq, _our_logits(ours, seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(generated, seq)


def test_import_export_round_trip_is_bitwise(exported, tmp_path):
    from safetensors.torch import load_file

    _, _, out = exported
    assert from_hf.main(["--hf-dir", out, "--save", str(tmp_path / "imported")]) == 0
    again = str(tmp_path / "again")
    assert to_hf.main(["--load", str(tmp_path / "imported"), "--out", again]) == 0
    a, b = load_file(os.path.join(out, "model.safetensors")), load_file(os.path.join(again, "model.safetensors"))
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    ca, cb = (json.load(open(os.path.join(d, "config.json"))) for d in (out, again))
    assert ca == cb


def test_imported_llama_trains_with_the_loss_transformers_computes(tmp_path):
    from megatron_ds.training.data import MockGPTDataset

    config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                      rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.2)
    torch.manual_seed(0)
    hf_dir = str(tmp_path / "hf")
    transformers.LlamaForCausalLM(config).save_pretrained(hf_dir)
    assert from_hf.main(["--hf-dir", hf_dir, "--save", str(tmp_path / "ckpt")]) == 0
    argv = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --num-key-value-heads 2 --ffn-hidden-size 128 "
            "--seq-length 32 --max-position-embeddings 32 --use-rotary-position-embeddings --swiglu "
            "--normalization rmsnorm --disable-bias-linear --untie-embeddings-and-output-weights "
            "--micro-batch-size 2 --global-batch-size 8 --lr 1e-3 --train-iters 1 --mock-data --vocab-size 512 "
            "--make-vocab-size-divisible-by 4 --hidden-dropout 0 --attention-dropout 0 --log-interval 1 "
            "--eval-interval 1000 --eval-iters 1 --num-workers 0 --seed 1234 --tensor-model-parallel-size 2 "
            f"--load {tmp_path / 'ckpt'}").split()
    [(iteration, loss)] = run_distributed(train_losses, 2, argv, timeout=600)[-1]
    assert iteration == 1
    # the first global batch: samples 0-7 of the mock training set (seed 1234)
    data = MockGPTDataset(8, 32, 512, 1234)
    text = torch.stack([torch.as_tensor(data[i]["text"]) for i in range(8)])
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        logits = model(input_ids=text[:, :-1]).logits
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, 512), text[:, 1:].reshape(-1))
    assert loss == pytest.approx(expected.item(), abs=1e-5)


@pytest.mark.skipif(not os.path.isdir(GPT2_FILES), reason="GPT-2 tokenizer files (../shared/data/gpt2) absent")
def test_exported_gpt2_tokenizer_encodes_like_ours(tmp_path):
    from megatron_ds.config import DataConfig
    from megatron_ds.data.tokenizer import build_tokenizer
    from megatron_ds.families.gpt.gpt_hf_export import save_tokenizer

    data = DataConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=os.path.join(GPT2_FILES, "gpt2-vocab.json"),
                      merge_file=os.path.join(GPT2_FILES, "gpt2-merges.txt"))
    save_tokenizer(data, 50256, str(tmp_path), log=lambda *a: None)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    ours = build_tokenizer("GPT2BPETokenizer", vocab_file=data.vocab_file, merge_file=data.merge_file)
    text = "Hello world! Checkpoints that leave the toolkit,\n  with 123 numbers and ünïcode."
    assert theirs(text)["input_ids"] == ours.tokenize(text)
    assert theirs.eos_token_id == ours.eod == 50256


def test_what_the_target_cannot_express_is_refused_by_flag():
    from megatron_ds.config import ModelConfig, resolve_model_config
    from megatron_ds.errors import ConfigError
    from megatron_ds.families.gpt.gpt_hf import choose_architecture

    def arch(**kw):
        return choose_architecture(resolve_model_config(ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                                                                    seq_length=16, **kw)))

    assert arch() == "gpt2"
    assert arch(use_rotary_position_embeddings=True, swiglu=True, normalization="rmsnorm",
                num_key_value_heads=2, add_bias_linear=False, untie_embeddings_and_output_weights=True) == "llama"
    with pytest.raises(ConfigError, match="--swiglu"):
        arch(swiglu=True)
    with pytest.raises(ConfigError, match="--num-key-value-heads 2"):
        arch(num_key_value_heads=2)
    with pytest.raises(ConfigError, match="--normalization layernorm"):
        arch(use_rotary_position_embeddings=True, swiglu=True)
    with pytest.raises(ConfigError, match="--rotary-percent 0.5"):
        arch(use_rotary_position_embeddings=True, swiglu=True, normalization="rmsnorm", rotary_percent=0.5)
    with pytest.raises(ConfigError, match="without positions"):
        arch(position_embedding_type="none")


def _umask_is(mask, fn):
    old = os.umask(mask)
    try:
        return fn()
    finally:
        os.umask(old)


def test_default_tokenizer_is_recorded_and_exported_with_group_readable_files(tmp_path, capsys):
    """Trained without --tokenizer-type (Megatron's default, GPT-2 BPE): the checkpoint names the
    tokenizer, the export writes its files and bos/eos ids, every file follows the umask (0002:
    group-writable, as shared ABCI group directories want; safetensors alone would write 0600).
    A checkpoint that records no tokenizer (--mock-data alone) says so, and takes --tokenizer-type."""
    from tests.data.test_tokenizer import training_corpus

    from megatron_ds.cli import train_tokenizer

    corpus = training_corpus(tmp_path / "corpus.jsonl", n_docs=100)
    assert train_tokenizer.main(["--input", str(corpus), "--vocab-size", "400",
                                 "--output-dir", str(tmp_path / "tok")]) == 0
    vocab, merges = str(tmp_path / "tok" / "vocab.json"), str(tmp_path / "tok" / "merges.txt")
    ckpt = str(tmp_path / "ckpt")
    argv = [a for a in TINY_GPT if a not in ("--vocab-size", "512")] + [
        "--train-iters", "1", "--global-batch-size", "2", "--vocab-file", vocab, "--merge-file", merges, "--save", ckpt]
    run_distributed(train_losses, 1, argv, timeout=600)
    meta = json.load(open(os.path.join(ckpt, "global_step1", "megatron_ds_config.json")))
    assert meta["config"]["data"]["tokenizer_type"] == "GPT2BPETokenizer"

    out = str(tmp_path / "hf")
    assert _umask_is(0o002, lambda: to_hf.main(["--load", ckpt, "--out", out])) == 0
    eod = json.load(open(vocab))["<|endoftext|>"]
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["bos_token_id"] == config["eos_token_id"] == eod
    assert transformers.AutoTokenizer.from_pretrained(out).eos_token_id == eod
    modes = {name: os.stat(os.path.join(out, name)).st_mode & 0o777 for name in os.listdir(out)}
    assert "model.safetensors" in modes and "tokenizer.json" in modes
    assert set(modes.values()) == {0o664}, modes

    # a checkpoint from before the resolved type was recorded: null, with the files it trained with
    meta["config"]["data"]["tokenizer_type"] = None
    with open(os.path.join(ckpt, "global_step1", "megatron_ds_config.json"), "w") as f:
        json.dump(meta, f)
    assert to_hf.main(["--load", ckpt, "--out", str(tmp_path / "older")]) == 0
    assert json.load(open(tmp_path / "older" / "config.json"))["eos_token_id"] == eod
    # a checkpoint recording no tokenizer (as one trained on --mock-data alone)
    meta["config"]["data"].update(tokenizer_type=None, vocab_file=None, merge_file=None, mock_data=True)
    with open(os.path.join(ckpt, "global_step1", "megatron_ds_config.json"), "w") as f:
        json.dump(meta, f)
    capsys.readouterr()
    assert to_hf.main(["--load", ckpt, "--out", str(tmp_path / "bare")]) == 0
    assert "NOTE: no tokenizer files written, and no bos/eos token ids: the checkpoint records no tokenizer " \
           "(--mock-data alone, or imported without tokenizer files); pass --tokenizer-type" in capsys.readouterr().out
    assert json.load(open(tmp_path / "bare" / "config.json"))["eos_token_id"] is None
    assert to_hf.main(["--load", ckpt, "--out", str(tmp_path / "named"), "--tokenizer-type", "GPT2BPETokenizer",
                       "--vocab-file", vocab, "--merge-file", merges]) == 0
    assert json.load(open(tmp_path / "named" / "config.json"))["eos_token_id"] == eod
