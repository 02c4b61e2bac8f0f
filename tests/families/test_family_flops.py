"""BERT's and T5's iteration-line FLOPs (families/bert/bert_flops.py, families/t5/t5_flops.py) against the
matmuls their real models run.

As tests/families/gpt/test_flops.py for the GPT: the model is built from the flags the CLI parses
(``families/bert/bert_model.py`` / ``families/t5/t5_model.py`` through their sequential builders, the plain
engine's module),
a forward and backward of one batch runs under torch's FlopCounterMode with SDPA's math backend
(attention as two batched matmuls over all keys, the formula's convention), and the formula must
give the same integer count. Nothing of the formula is reused: the model's shapes decide the count.
The losses (vocab-parallel cross entropy, the binary head's 2-way cross entropy) run no matmul, so
nothing is subtracted. Full recompute (--checkpoint-activations: interval 1, torch's non-reentrant
checkpoint of ``parallel/random.py``) re-runs what the checkpoint needs of every encoder/decoder layer.
"""
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from megatron_ds.config import parse_args, resolve
from megatron_ds.families.bert.bert_family import BERT
from megatron_ds.families.bert.bert_flops import bert_flops_per_iteration
from megatron_ds.families.bert.bert_model import build_sequential_bert
from megatron_ds.families.gpt.gpt_flops import model_flops_per_iteration
from megatron_ds.families.t5.t5_family import T5
from megatron_ds.families.t5.t5_flops import t5_flops_per_iteration
from megatron_ds.families.t5.t5_model import build_sequential_t5
from megatron_ds.families.t5.t5_params import decoder_layers
from megatron_ds.model.kernels import sdpa_supports_gqa
from megatron_ds.training.loop import Loop

VOCAB = 100
COMMON = ("--hidden-size 32 --num-attention-heads 4 --micro-batch-size 2 --mock-data --vocab-size 100 "
          "--make-vocab-size-divisible-by 8 --hidden-dropout 0 --attention-dropout 0 --train-iters 1 "
          "--lr 1e-4").split()
BERT_FLAGS = COMMON + "--num-layers 2 --seq-length 16 --max-position-embeddings 16".split()
# encoder and decoder of different depths and lengths, so that a count at the wrong length or depth shows
T5_FLAGS = COMMON + ("--num-layers 2 --decoder-num-layers 3 --seq-length 16 --decoder-seq-length 8 "
                     "--max-position-embeddings 16").split()
T5_CASES = {
    "learned": [],
    # HF T5 v1.1's shape: gated GeLU (three MLP matrices) and relative position biases (a lookup, no matmul)
    "geglu_relative": ("--geglu --position-embedding-type relative --relative-attention-num-buckets 8 "
                       "--relative-attention-max-distance 12 --normalization rmsnorm --disable-bias-linear").split(),
    # hidden dropout on (Megatron's default 0.1): full recompute re-runs each layer's MLP output projection
    # too, as the mask drawn after it is something backward needs (planner/flops.py)
    "dropout": ["--hidden-dropout", "0.1"],
}


def _layout(flags, shape):
    cfg, _ = parse_args(flags)
    return resolve(cfg, world_size=1, vocab_size=VOCAB, device_type="cpu", family=shape).layout


def _count(model, inputs, labels) -> int:
    sdpa_supports_gqa()  # its one-off probe (a 1x1 attention) must not land in the count
    counter = FlopCounterMode(display=False)
    with counter, sdpa_kernel(SDPBackend.MATH):
        model.loss_fn(model(inputs), labels).backward()
    return counter.get_total_flops()


def _bert_counted(layout, batch: int, full_recompute: bool) -> int:
    m = layout.model
    model = build_sequential_bert(m, padded_vocab_size=layout.padded_vocab_size, seed=3, vocab_size=VOCAB,
                                  activation_checkpoint_interval=1 if full_recompute else 0)
    g = torch.Generator().manual_seed(0)
    s = m.seq_length
    tokens = torch.randint(5, VOCAB, (batch, s), generator=g)
    types = (torch.arange(s) >= s // 2).long().repeat(batch, 1)
    padding = torch.ones(batch, s, dtype=torch.long)
    padding[0, -3:] = 0
    labels = torch.where(torch.rand(batch, s, generator=g) < 0.3, tokens, torch.full_like(tokens, -1))
    loss_mask = (labels >= 0).float()
    return _count(model, (tokens, types, padding), (labels, loss_mask, torch.tensor([0, 1])))


@pytest.mark.parametrize("full_recompute", [False, True], ids=["no-recompute", "full-recompute"])
@pytest.mark.parametrize("binary_head", [True, False], ids=["binary-head", "no-binary-head"])
def test_bert_flops_equal_the_matmuls_the_model_runs(binary_head, full_recompute):
    """The encoder layers, the MLM head's dense transform and output layer over the padded vocabulary, and
    (with the binary head) the pooler and the binary head on position 0."""
    layout = _layout(BERT_FLAGS + ([] if binary_head else ["--bert-no-binary-head"]), BERT)
    assert layout.model.bert_binary_head is binary_head
    counted = _bert_counted(layout, batch=2, full_recompute=full_recompute)
    formula = bert_flops_per_iteration(layout.model, 2, layout.padded_vocab_size, full_recompute)
    assert formula == counted  # exact: both are integer counts of the same multiply-adds


def _t5_counted(layout, batch: int, full_recompute: bool) -> int:
    m, s_e, s_d = layout.model, layout.model.seq_length, layout.decoder_seq_length
    model = build_sequential_t5(m, decoder_num_layers=decoder_layers(m), padded_vocab_size=layout.padded_vocab_size,
                                seed=3, vocab_size=VOCAB, activation_checkpoint_interval=1 if full_recompute else 0)
    g = torch.Generator().manual_seed(0)
    enc_flags, dec_flags = torch.ones(batch, s_e, dtype=torch.long), torch.ones(batch, s_d, dtype=torch.long)
    enc_flags[0, -4:] = 0
    dec_flags[1, -2:] = 0
    enc = torch.randint(1, VOCAB, (batch, s_e), generator=g) * enc_flags
    dec = torch.randint(1, VOCAB, (batch, s_d), generator=g) * dec_flags
    labels = torch.randint(1, VOCAB, (batch, s_d), generator=g) * dec_flags
    return _count(model, (enc, dec, enc_flags, dec_flags), (labels, dec_flags.float()))


@pytest.mark.parametrize("full_recompute", [False, True], ids=["no-recompute", "full-recompute"])
@pytest.mark.parametrize("case", list(T5_CASES))
def test_t5_flops_equal_the_matmuls_the_model_runs(case, full_recompute):
    """Encoder layers at the encoder length, decoder layers at the decoder length with cross-attention
    (queries at the decoder length, keys and values projected from the encoder output), the LM head at
    the decoder length."""
    layout = _layout(T5_FLAGS + T5_CASES[case], T5)
    assert (layout.model.seq_length, layout.decoder_seq_length, decoder_layers(layout.model)) == (16, 8, 3)
    counted = _t5_counted(layout, batch=2, full_recompute=full_recompute)
    formula = t5_flops_per_iteration(layout.model, 2, layout.padded_vocab_size, full_recompute,
                                     decoder_seq_length=layout.decoder_seq_length)
    assert formula == counted  # exact: both are integer counts of the same multiply-adds


def test_families_hand_the_loop_their_count():
    """pretrain_bert.py / pretrain_t5.py's families give the loop (training/loop.py ``Loop.flops``: the
    layout's ``family.flops``) their own formula at the layout's global batch."""
    bert = _layout(BERT_FLAGS + ["--checkpoint-activations"], BERT)
    assert BERT.flops(bert, 16) == bert_flops_per_iteration(bert.model, 2, bert.padded_vocab_size, True)
    cfg, _ = parse_args(T5_FLAGS)
    run = resolve(cfg, world_size=1, vocab_size=VOCAB, device_type="cpu", family=T5)
    loop = Loop(run, engine=None, loss_fn=None, dp_group=None, device=torch.device("cpu"), tb=None, save=None)
    t5 = run.layout
    assert loop.flops == t5_flops_per_iteration(t5.model, 2, t5.padded_vocab_size, False, decoder_seq_length=8)
    # what the line printed before: the GPT formula at the encoder length, without decoder or cross-attention
    assert loop.flops > 1.5 * model_flops_per_iteration(t5.model, 2, t5.padded_vocab_size, False)
