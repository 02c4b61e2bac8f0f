"""BERT and Hugging Face transformers, both ways (families/bert/bert_hf.py).

- import: transformers' own BertForPreTraining / MegatronBertForPreTraining, built from a config
  with every tensor drawn at random (norms and biases included, so a misplaced one shows), saved
  and imported, gives our BERT the same MLM and sentence-order logits;
- export: our BERT (pre-LN as Megatron's, post-LN with --apply-residual-connection-post-layernorm,
  with and without the binary head), written as a transformers directory and loaded by
  transformers' AutoModelForPreTraining, gives our logits;
- a checkpoint trained at TP 2 x PP 2 by pretrain_bert.py exports with the logits of the model
  its consolidated weights build (the vocab-parallel MLM bias and word embedding merged).

Logits are compared at every position of padded batches: transformers' BERT masks padding keys
only, as ours does (model/transformer.py padding_attention_mask). Tolerance: fp32 with the same
products summed in different orders (fused QKV vs three projections, SDPA vs HF's attention):
a few ulps of O(1-10) logits through 2 layers; 1e-4 absolute is ~100x that and far below a
misplaced tensor (O(0.1) or more).
"""
from __future__ import annotations

import pytest
import torch

from megatron_ds.checkpoint.consolidate import load_consolidated
from megatron_ds.config.layout import resolve_model_config
from megatron_ds.config.schema import ModelConfig
from megatron_ds.families.bert.bert_family import BERT
from megatron_ds.families.bert.bert_hf import import_hf_bert, write_hf_bert
from megatron_ds.families.bert.bert_model import build_sequential_bert
from megatron_ds.families.gpt.gpt_family import GPT

transformers = pytest.importorskip("transformers")
TOL = dict(rtol=1e-4, atol=1e-4)
VOCAB, SEQ, B = 100, 12, 3


def _batch(types: int):
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (B, SEQ), generator=g)
    token_types = (torch.arange(SEQ) >= 5).long().expand(B, SEQ).clone()
    if types == 1:
        token_types.zero_()
    padding = (torch.arange(SEQ)[None] < torch.tensor([SEQ, 8, 4])[:, None]).long()
    return tokens, token_types, padding


def _ours(model, batch):
    model.eval()
    with torch.no_grad():
        out = model(batch)
    logits, binary = out if isinstance(out, tuple) else (out, None)
    return logits[..., :VOCAB], binary


def _theirs(hf_model, batch):
    hf_model.eval()
    tokens, types, padding = batch
    with torch.no_grad():
        out = hf_model(input_ids=tokens, token_type_ids=types, attention_mask=padding)
    return out.prediction_logits, out.seq_relationship_logits


def _randomize(module, seed: int):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            scale = 0.3 if p.dim() > 1 else 0.2
            base = 1.0 if ("LayerNorm" in name or ".ln." in name or "norm" in name) and name.endswith("weight") else 0.0
            p.copy_(base + scale * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("arch,types", [("BertForPreTraining", 2), ("MegatronBertForPreTraining", 2),
                                        ("BertForPreTraining", 1)])
def test_hf_model_imports_with_its_logits(tmp_path, arch, types):
    config_cls = transformers.BertConfig if arch == "BertForPreTraining" else transformers.MegatronBertConfig
    config = config_cls(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=16, type_vocab_size=types)
    hf_model = getattr(transformers, arch)(config)
    _randomize(hf_model, 0)
    hf_model.tie_weights()
    hf_model.save_pretrained(tmp_path / "hf")
    m = import_hf_bert(str(tmp_path / "hf"), str(tmp_path / "ckpt"), family=BERT, log=lambda *a: None)
    assert m.bert_binary_head == (types == 2)
    c = load_consolidated(str(tmp_path / "ckpt"), family=BERT, log=lambda *a: None)
    ours = build_sequential_bert(c.model, padded_vocab_size=c.padded_vocab_size, seed=0, vocab_size=VOCAB)
    ours.load_state_dict(c.state_dict, strict=True)
    batch = _batch(types)
    (logits, binary), (hf_logits, hf_binary) = _ours(ours, batch), _theirs(hf_model, batch)
    torch.testing.assert_close(logits, hf_logits, **TOL)
    if types == 2:
        torch.testing.assert_close(binary, hf_binary, **TOL)


@pytest.mark.parametrize("post_ln,binary_head", [(False, True), (True, True), (True, False)])
def test_export_loads_in_transformers_with_our_logits(tmp_path, post_ln, binary_head):
    m = resolve_model_config(ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=SEQ,
                                         max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0,
                                         apply_residual_connection_post_layernorm=post_ln,
                                         bert_binary_head=binary_head))
    ours = build_sequential_bert(m, padded_vocab_size=128, seed=3, vocab_size=VOCAB)
    _randomize(ours, 1)
    arch = write_hf_bert(str(tmp_path / "hf"), m, ours.state_dict(), VOCAB, log=lambda *a: None)
    assert arch == ("BertForPreTraining" if post_ln else "MegatronBertForPreTraining")
    hf_model = transformers.AutoModelForPreTraining.from_pretrained(tmp_path / "hf")
    assert type(hf_model).__name__ == arch
    batch = _batch(2 if binary_head else 1)
    (logits, binary), (hf_logits, hf_binary) = _ours(ours, batch), _theirs(hf_model, batch)
    torch.testing.assert_close(logits, hf_logits, **TOL)
    if binary_head:
        torch.testing.assert_close(binary, hf_binary, **TOL)


def test_tp2_pp2_checkpoint_exports_the_initial_model(tmp_path):
    """pretrain_bert.py at TP 2 x PP 2 saves after one step at a learning rate too small to move a
    weight (1e-30), so the checkpoint holds the initial model, which per-layer seeding makes the
    same at every layout: the single-process model built here with the run's seed. Its export (the
    shards merged over TP -- vocab-parallel word embedding and MLM bias, QKV, MLP -- and the stages
    joined) must give that model's logits in transformers."""
    from tests.distributed import run_distributed
    from tests.families.bert.test_bert_parity import TINY_BERT, bert_losses

    from megatron_ds.families.bert.bert_hf import export_hf_bert

    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    argv = [a for a in TINY_BERT] + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                     "--save", ckpt]
    argv[argv.index("--train-iters") + 1] = "1"
    argv[argv.index("--lr") + 1] = "1e-30"
    run_distributed(bert_losses, 4, argv, timeout=900)
    assert export_hf_bert(ckpt, out, family=BERT, log=lambda *a: None) == "MegatronBertForPreTraining"
    m = load_consolidated(ckpt, family=BERT, log=lambda *a: None).model
    ours = build_sequential_bert(m, padded_vocab_size=512, seed=1234, vocab_size=512)
    hf_model = transformers.AutoModelForPreTraining.from_pretrained(out)
    batch = _batch(2)
    (logits, binary), (hf_logits, hf_binary) = _ours(ours, batch), _theirs(hf_model, batch)
    torch.testing.assert_close(logits, hf_logits[..., :VOCAB], **TOL)
    torch.testing.assert_close(binary, hf_binary, **TOL)


def test_a_checkpoint_of_another_family_is_refused_by_name():
    """pretrain_gpt.py --load of a BERT checkpoint (or the reverse) stops in one line naming the
    family, before any weight is read; GPT signatures carry no family field (older ones load)."""
    from megatron_ds.checkpoint.checkpointing import check_compatible
    from megatron_ds.checkpoint.format import layout_signature
    from megatron_ds.config import parse_args, resolve
    from megatron_ds.errors import ConfigError

    flags, _ = parse_args("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
                          "--micro-batch-size 1 --train-iters 1 --lr 1e-3 --mock-data --vocab-size 100".split())
    gpt = layout_signature(resolve(flags, world_size=1, vocab_size=100, device_type="cpu", family=GPT).layout)
    bert = layout_signature(resolve(flags, world_size=1, vocab_size=100, device_type="cpu", family=BERT).layout)
    assert "model_family" not in gpt and bert["model_family"] == "bert"
    check_compatible(gpt, gpt, "ckpt", load_optim=True)
    check_compatible(bert, bert, "ckpt", load_optim=True)
    for saved, now in ((bert, gpt), (gpt, bert)):
        with pytest.raises(ConfigError, match=r"model_family: checkpoint (bert|gpt) vs now (gpt|bert)"):
            check_compatible(saved, now, "ckpt", load_optim=True)
