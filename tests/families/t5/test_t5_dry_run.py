"""pretrain_t5.py --dry-run: T5's analytic parameter count (families/t5/t5_params.py) against the model
built on the meta device stage by stage (the split rank's partition), its total against transformers'
own T5ForConditionalGeneration of the same shape (an independent implementation: the shared
embedding counted once, no biases, RMS norms), Megatron-DeepSpeed's own T5 example flags accepted
as written, and what T5 cannot run refused in one line.
"""
from __future__ import annotations

import contextlib
import io

import numpy as np
import pytest
import torch

from megatron_ds.config import parse_args, resolve
from megatron_ds.families import main
from megatron_ds.families.gpt.gpt_family import GPT
from megatron_ds.families.t5.t5_family import T5
from megatron_ds.training.meta_build import build_stages

VOCAB = 32128  # even: TP 2 pads nothing with --make-vocab-size-divisible-by 1
T5_BASE = ("--num-layers 12 --decoder-num-layers 12 --hidden-size 768 --num-attention-heads 12 --kv-channels 64 "
           "--ffn-hidden-size 3072 --encoder-seq-length 512 --decoder-seq-length 128 --max-position-embeddings 512 "
           f"--micro-batch-size 4 --train-iters 10 --lr 1e-4 --mock-data --vocab-size {VOCAB} "
           "--make-vocab-size-divisible-by 1").split()
HF_VARIANT = "--position-embedding-type none --normalization rmsnorm --disable-bias-linear".split()
# HF's own T5 v1.1 / Flan-T5: relative position biases (tables split over TP with the heads), gated GeLU
HF_T5_V11 = "--position-embedding-type relative --normalization rmsnorm --disable-bias-linear --geglu".split()


def _run(tp: int, pp: int, extra=()):
    flags, ignored = parse_args(T5_BASE + ["--tensor-model-parallel-size", str(tp),
                                           "--pipeline-model-parallel-size", str(pp), *extra])
    return resolve(flags, world_size=tp * pp, vocab_size=VOCAB, device_type="cpu", ignored=ignored, family=T5)


@pytest.mark.parametrize("tp,pp,extra", [(1, 1, ()), (2, 2, ("--pipeline-model-parallel-split-rank", "1")),
                                         (1, 4, ("--pipeline-model-parallel-split-rank", "2")),
                                         (2, 3, ("--pipeline-model-parallel-split-rank", "1", *HF_VARIANT)),
                                         (2, 2, ("--pipeline-model-parallel-split-rank", "1", *HF_T5_V11)),
                                         # each side divides over its own stages, the total does not over 4
                                         (1, 4, ("--pipeline-model-parallel-split-rank", "3", "--num-layers", "6"))])
def test_built_stages_match_the_estimate(tp, pp, extra):
    run = _run(tp, pp, extra)
    built = build_stages(run, None)
    assert [b.params for b in built] == [s.params_per_tp_rank for s in run.layout.stages]


def test_total_matches_transformers_t5():
    transformers = pytest.importorskip("transformers")
    run = _run(1, 1, HF_VARIANT)
    config = transformers.T5Config(vocab_size=VOCAB, d_model=768, d_kv=64, d_ff=3072, num_layers=12,
                                   num_decoder_layers=12, num_heads=12, feed_forward_proj="gelu")
    with torch.device("meta"):
        hf = transformers.T5ForConditionalGeneration(config)
    buckets = 2 * config.relative_attention_num_buckets * 12  # HF's relative position tables, none here
    assert run.layout.total_params == hf.num_parameters() - buckets


@pytest.mark.parametrize("proj,extra", [("gated-gelu", ("--geglu",)), ("relu", ("--relu",))])
def test_total_matches_transformers_t5_with_relative_biases(proj, extra):
    """HF's T5 v1.1 (gated-gelu) and v1.0 (relu) as they are: relative tables counted on both sides."""
    transformers = pytest.importorskip("transformers")
    run = _run(1, 1, ("--position-embedding-type", "relative", "--normalization", "rmsnorm", "--disable-bias-linear",
                      "--relative-attention-num-buckets", "16", *extra))
    config = transformers.T5Config(vocab_size=VOCAB, d_model=768, d_kv=64, d_ff=3072, num_layers=12,
                                   num_decoder_layers=12, num_heads=12, feed_forward_proj=proj,
                                   relative_attention_num_buckets=16)
    with torch.device("meta"):
        hf = transformers.T5ForConditionalGeneration(config)
    assert run.layout.total_params == hf.num_parameters()


def test_megatron_deepspeed_t5_example_dry_runs(tmp_path, capsys):
    """examples/pretrain_t5_distributed_with_mp.sh's T5_ARGS and DATA_ARGS as written (paths aside),
    at its 8 GPUs; --tokenizer-type is pretrain_t5.py's default, BertWordPieceLowerCase."""
    vocab = tmp_path / "t5-vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(200)]) + "\n")
    from megatron_ds.data.indexed_dataset import MMapIndexedDatasetBuilder

    prefix = str(tmp_path / "corpus_text_sentence")  # --dry-run opens the data, builds no samples
    builder = MMapIndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    builder.add_item(torch.tensor([5, 6, 7]))
    builder.end_document()
    builder.finalize(prefix + ".idx")
    argv = ("--tensor-model-parallel-size 2 --num-layers 12 --hidden-size 768 --num-attention-heads 12 "
            "--kv-channels 64 --ffn-hidden-size 3072 --encoder-seq-length 512 --decoder-seq-length 128 "
            "--max-position-embeddings 512 --micro-batch-size 16 --global-batch-size 128 --lr 0.0001 "
            "--train-iters 1000000 --lr-decay-iters 1000000 --lr-decay-style linear --min-lr 0.00001 "
            "--weight-decay 1e-2 --lr-warmup-fraction .01 --clip-grad 1.0 --fp16 --vocab-extra-ids 100 "
            f"--data-path {tmp_path}/corpus_text_sentence --vocab-file {vocab} --data-impl mmap --split 949,50,1 "
            "--log-interval 100 --save-interval 10000 --eval-interval 1000 --eval-iters 10 "
            "--distributed-backend nccl --dry-run --world-size 8").split()
    assert main(argv, family=T5) == 0
    out = capsys.readouterr().out
    assert "world size 8 = TP 2 x PP 1 x DP 4" in out and "every stage within 1% of the estimate" in out


@pytest.mark.parametrize("extra,says", [
    (["--tensor-model-parallel-size", "2", "--sequence-parallel"], "--sequence-parallel"),
    (["--pipeline-model-parallel-size", "2"], "--pipeline-model-parallel-split-rank in [1, 1]"),
    (["--pipeline-model-parallel-size", "4", "--pipeline-model-parallel-split-rank", "3", "--num-layers", "10"],
     "--encoder-num-layers 10 must be divisible by the 3 pipeline stages"),
    (["--num-key-value-heads", "4"], "multi-head"),
    (["--position-embedding-type", "relative", "--relative-attention-num-buckets", "2"], "at least 4"),
    (["--relu", "--geglu"], "each choose the MLP's activation"),
])
def test_refused_combinations_are_one_line(capsys, extra, says):
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(T5_BASE + ["--dry-run", "--world-size", "8", *extra], family=T5) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err


@pytest.mark.parametrize("flag", [("--position-embedding-type", "relative"), ("--relu",), ("--geglu",)])
def test_t5_only_flags_are_refused_for_the_gpt(flag):
    from megatron_ds.errors import ConfigError

    flags, ignored = parse_args(T5_BASE + list(flag))
    with pytest.raises(ConfigError, match="T5 only"):
        resolve(flags, world_size=1, vocab_size=VOCAB, device_type="cpu", ignored=ignored, family=GPT)
