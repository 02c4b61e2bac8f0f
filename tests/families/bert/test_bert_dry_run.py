"""pretrain_bert.py --dry-run: BERT's analytic parameter count (families/bert/bert_params.py) against the
model built on the meta device stage by stage (training/meta_build.py with BERT's builder), and
its total against transformers' own MegatronBertForPreTraining of the same shape (an independent
implementation of the same architecture: tied MLM decoder counted once, its bias, pooler and
sentence-relationship head included); flag combinations BERT cannot run are refused in one line.
"""
from __future__ import annotations

import contextlib
import io

import pytest
import torch

from megatron_ds.config import parse_args, resolve
from megatron_ds.families import main
from megatron_ds.families.bert.bert_family import BERT
from megatron_ds.training.meta_build import build_stages

VOCAB = 30522  # bert-large-uncased; even, so TP 2 pads nothing with --make-vocab-size-divisible-by 1
BERT_LARGE = ("--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 512 "
              "--max-position-embeddings 512 --micro-batch-size 4 --train-iters 10 --lr 1e-4 --mock-data "
              f"--vocab-size {VOCAB} --make-vocab-size-divisible-by 1").split()


def _run(tp: int, pp: int, extra=()):
    flags, ignored = parse_args(BERT_LARGE + ["--tensor-model-parallel-size", str(tp),
                                              "--pipeline-model-parallel-size", str(pp), *extra])
    return resolve(flags, world_size=tp * pp, vocab_size=VOCAB, device_type="cpu", ignored=ignored,
                   family=BERT)


@pytest.mark.parametrize("tp,pp,extra", [(1, 1, ()), (2, 2, ()), (2, 4, ("--bert-no-binary-head",)),
                                         (1, 3, ("--pipeline-partition-method", "parameters"))])
def test_built_stages_match_the_estimate(tp, pp, extra):
    run = _run(tp, pp, extra)
    built = build_stages(run, None)
    assert [b.params for b in built] == [s.params_per_tp_rank for s in run.layout.stages]


@pytest.mark.parametrize("binary_head", [True, False])
def test_total_matches_transformers_megatron_bert(binary_head):
    transformers = pytest.importorskip("transformers")
    run = _run(1, 1, () if binary_head else ("--bert-no-binary-head",))
    config = transformers.MegatronBertConfig(vocab_size=VOCAB, hidden_size=1024, num_hidden_layers=24,
                                             num_attention_heads=16, intermediate_size=4096,
                                             max_position_embeddings=512, type_vocab_size=2)
    with torch.device("meta"):
        hf = transformers.MegatronBertForPreTraining(config)
    total = hf.num_parameters()  # tied decoder weight once
    if not binary_head:  # no token types, pooler or sentence-relationship head here
        total -= 2 * 1024 + (1024 * 1024 + 1024) + (2 * 1024 + 2)
    assert run.layout.total_params == total


def test_refused_combinations_are_one_line(capsys):
    argv = BERT_LARGE + ["--dry-run", "--world-size", "8", "--pipeline-model-parallel-size", "2",
                         "--num-layers-per-virtual-pipeline-stage", "4"]
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(argv, family=BERT) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pretrain_bert.py cannot run with" in err[0] and "virtual" in err[0]
