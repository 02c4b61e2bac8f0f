"""A pretrain_t5.py checkpoint written at TP 2 through the tools: consolidation, export to Hugging
Face (tools/checkpoint/to_hf.py), import back (tools/checkpoint/from_hf.py), span-prediction
evaluation's model loader (families/t5/span_loss.py).

The run trains one step at learning rate 0, so its weights are the initial ones, which the seed
fixes at any TP size: the consolidated checkpoint must equal a single-process T5 built with the
same seed bit for bit (every TP-split tensor merged along the right dimension, cross-attention's
query and per-head key/value, the gated MLP's stride-2 [gate; up] and the relative position
tables' head split included). The export's logits (transformers' own T5 reading the
directory) equal that model's; importing the export gives the same tensors back (kv_channels 16:
the 1/sqrt(d) folded into the query weights is a power of two, so the round trip is exact; the vocabulary's padding rows, never read, are not exported), and pretrain_t5.py continues from the import
at PP 2 with the split rank, its first loss that of the consolidated model on the same samples.
"""
import os

import pytest
import torch

from tests.distributed import run_distributed
from tests.families.t5.test_t5_parity import t5_train_losses

transformers = pytest.importorskip("transformers")

VARIANT = ("--num-layers 2 --decoder-num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 16 "
           "--decoder-seq-length 8 --micro-batch-size 2 --global-batch-size 4 --lr 0 --min-lr 0 --train-iters 1 "
           "--mock-data --vocab-size 61 --make-vocab-size-divisible-by 4 --log-interval 1 --eval-interval 1000 "
           "--eval-iters 0 --num-workers 0 --seed 1234 --hidden-dropout 0 --attention-dropout 0 "
           "--position-embedding-type relative --relative-attention-num-buckets 8 --relative-attention-max-distance 12 "
           "--normalization rmsnorm --disable-bias-linear --geglu "
           "--layernorm-epsilon 1e-6 --tensor-model-parallel-size 2").split()
ATOL = 1e-5  # as tests/families/t5/test_hf_t5.py: fp32, the same products summed in other orders


def test_tp2_checkpoint_consolidates_exports_and_imports(tmp_path):
    from megatron_ds.checkpoint.consolidate import load_consolidated
    from megatron_ds.families.t5.span_loss import load_t5
    from megatron_ds.families.t5.t5_family import T5
    from megatron_ds.families.t5.t5_model import build_sequential_t5
    from megatron_ds.families.t5.t5_params import decoder_layers
    from megatron_ds.cli.from_hf import main as from_hf
    from megatron_ds.cli.to_hf import main as to_hf

    ckpt = str(tmp_path / "ckpt")
    run_distributed(t5_train_losses, 2, VARIANT + ["--save", ckpt], timeout=600)
    weights = load_consolidated(ckpt, family=T5, log=lambda *a: None)
    assert weights.vocab_size == 61 and weights.padded_vocab_size == 64
    fresh = build_sequential_t5(weights.model, decoder_num_layers=decoder_layers(weights.model), padded_vocab_size=64,
                                seed=1234, vocab_size=61).state_dict()
    assert set(weights.state_dict) == set(fresh)
    for name, value in fresh.items():
        assert torch.equal(weights.state_dict[name], value), name

    out = str(tmp_path / "hf")
    assert to_hf(["--load", ckpt, "--out", out]) == 0
    hf = transformers.T5ForConditionalGeneration.from_pretrained(out).eval()
    ours = load_t5(weights)
    g = torch.Generator().manual_seed(0)
    enc, dec = torch.randint(3, 61, (2, 16), generator=g), torch.randint(3, 61, (2, 8), generator=g)
    ef, df = torch.ones_like(enc), torch.ones_like(dec)
    ef[0, 11:] = 0
    with torch.no_grad():
        mine = ours((enc * ef, dec, ef, df))[..., :61]
        theirs = hf(input_ids=enc * ef, attention_mask=ef, decoder_input_ids=dec, decoder_attention_mask=df).logits
    assert torch.allclose(mine, theirs, atol=ATOL, rtol=0), (mine - theirs).abs().max()

    back = str(tmp_path / "back")
    assert from_hf(["--hf-dir", out, "--save", back]) == 0
    imported = load_consolidated(back, family=T5, log=lambda *a: None)
    for name, value in weights.state_dict.items():  # the vocabulary's padding rows are not exported
        rows = 61 if name.endswith("word_embeddings.weight") else None
        assert torch.equal(imported.state_dict[name][:rows], value[:rows]), name
    assert os.path.isfile(os.path.join(out, "model.safetensors"))

    # the imported checkpoint continues in pretrain_t5.py at another layout (PP 2, split rank 1:
    # resharded at --load); at lr 0 its first loss is the consolidated model's on the same samples
    at = VARIANT.index("--tensor-model-parallel-size")
    layout = VARIANT[:at] + VARIANT[at + 2:]
    losses = run_distributed(t5_train_losses, 2, layout + ["--load", back, "--pipeline-model-parallel-size", "2",
                                                           "--pipeline-model-parallel-split-rank", "1"],
                             timeout=600)[-1]
    from megatron_ds.families.t5.t5_family import MockT5Dataset, T5Collator

    data = MockT5Dataset(4, 16, 8, 61, 1234)  # the run's training samples: seed + 0 for the train split
    collate = T5Collator(61, "mock")
    expected = []
    with torch.no_grad():
        for first in (0, 2):  # two micro-batches of 2 make the global batch of 4
            inputs, labels = collate([data[first], data[first + 1]])
            expected.append(float(ours.loss_fn(ours(inputs), labels)))
    assert losses[0][1] == pytest.approx(sum(expected) / 2, rel=1e-5)  # fp32, another summation order
