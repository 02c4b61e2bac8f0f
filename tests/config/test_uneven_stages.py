"""Uneven pipeline stages in the resolution: which transformer layers each stage holds by
Megatron-DeepSpeed's --pp-partition-method and Megatron-LM's uneven-stage flags, what is refused, and
what --dry-run prints for published layouts (BLOOM 176B, Llama 3 405B)."""
import contextlib

import pytest

from megatron_ds.config import parse_args, resolve
from megatron_ds.errors import ConfigError
from megatron_ds.families import main as pretrain_main
from megatron_ds.families.gpt.gpt_family import GPT

BASE = ("--hidden-size 64 --num-attention-heads 8 --seq-length 32 --micro-batch-size 1 --train-iters 10 "
        "--lr 1e-3").split()


def _layout(layers, pp, *extra):
    cfg, _ = parse_args(BASE + ["--num-layers", str(layers), "--pipeline-model-parallel-size", str(pp), *extra])
    return resolve(cfg, world_size=pp, vocab_size=1000, ds_template=None, device_type="cpu", family=GPT).layout


def _counts(layout):
    return [stop - first for first, stop in (s.layers for s in layout.stages)]


def _megatron_ranges(num_layers, pp, first=None, last=None, embedding=False, loss=False, v=None):
    """Megatron-LM's layers of each pipeline rank (``v``: of each chunk, in (rank, chunk) order), transcribed
    from transformer_layer.py get_transformer_layer_offset and transformer_block.py get_num_layers_to_build."""
    out = []
    for rank in range(pp):
        for vp_stage in range(v or 1):
            if first is not None or last is not None:
                middle_stages = pp - (first is not None) - (last is not None)
                middle_layers = num_layers - (first or 0) - (last or 0)
                middle_rank = rank if first is None else rank - 1
                if v is not None:
                    f, m, la = (first or 0) // v, middle_layers // v, (last or 0) // v
                    offset = vp_stage * (f + m + la) + (0 if rank == 0 else f + middle_rank * (m // middle_stages))
                else:
                    per = middle_layers // middle_stages if middle_stages > 0 else 0
                    offset = 0 if rank == 0 else middle_rank * per + (first or 0)
                per_rank = middle_layers // middle_stages if middle_stages > 0 else 0
                if rank == 0 and first is not None:
                    per_rank = first
                if rank == pp - 1 and last is not None:
                    per_rank = last
            else:
                total = num_layers + embedding + loss
                per_rank = total // pp
                if v is not None:
                    offset = vp_stage * (total // v) + rank * (per_rank // v)
                else:
                    offset = rank * per_rank
                offset -= 1 if embedding and not (vp_stage == 0 and rank == 0) else 0
            build = per_rank // (v or 1)
            build -= 1 if embedding and vp_stage == 0 and rank == 0 else 0
            build -= 1 if loss and vp_stage == (v or 1) - 1 and rank == pp - 1 else 0
            out.append((offset, offset + build))
    return out


@pytest.mark.parametrize("layers,pp,kw,flags", [
    (5, 3, dict(first=1), ["--decoder-first-pipeline-num-layers", "1"]),
    (10, 4, dict(last=4), ["--decoder-last-pipeline-num-layers", "4"]),
    (12, 4, dict(first=2, last=2), ["--decoder-first-pipeline-num-layers", "2",
                                   "--decoder-last-pipeline-num-layers", "2"]),
    (8, 4, dict(first=1, last=3), ["--decoder-first-pipeline-num-layers", "1",
                                   "--decoder-last-pipeline-num-layers", "3"]),
    (7, 2, dict(embedding=True), ["--account-for-embedding-in-pipeline-split"]),
    (14, 4, dict(embedding=True, loss=True), ["--account-for-embedding-in-pipeline-split",
                                              "--account-for-loss-in-pipeline-split"]),
    (3, 4, dict(embedding=True), ["--account-for-embedding-in-pipeline-split"]),  # first stage: embedding only
], ids=lambda v: "" if not isinstance(v, int) else str(v))
def test_megatron_lm_flags_place_layers_as_megatron(layers, pp, kw, flags):
    layout = _layout(layers, pp, *flags)
    assert [s.layers for s in layout.stages] == _megatron_ranges(layers, pp, **kw)
    assert layout.pipeline_partition == "layers:" + ",".join(str(b - a) for a, b in _megatron_ranges(layers, pp, **kw))


@pytest.mark.parametrize("layers,pp,v,kw,flags", [
    (8, 4, 2, dict(first=2, last=2), ["--decoder-first-pipeline-num-layers", "2",
                                      "--decoder-last-pipeline-num-layers", "2"]),
    (10, 3, 2, dict(first=2), ["--decoder-first-pipeline-num-layers", "2"]),
    (5, 2, 3, dict(embedding=True), ["--account-for-embedding-in-pipeline-split"]),
    (14, 4, 2, dict(embedding=True, loss=True), ["--account-for-embedding-in-pipeline-split",
                                                 "--account-for-loss-in-pipeline-split"]),
], ids=lambda v: "" if not isinstance(v, int) else str(v))
def test_megatron_lm_flags_place_chunks_as_megatron(layers, pp, v, kw, flags):
    from megatron_ds.parallel.partition import chunk_layer_range

    layout = _layout(layers, pp, *flags, "--num-virtual-stages-per-pipeline-rank", str(v),
                     "--global-batch-size", str(pp))
    got = [chunk_layer_range(layers, pp, v, r, c, layout.chunk_layers) for r in range(pp) for c in range(v)]
    assert [(g.start, g.stop) for g in got] == _megatron_ranges(layers, pp, v=v, **kw)
    held = [sum(len(g) for g in got[r * v:(r + 1) * v]) for r in range(pp)]
    assert [b - a for a, b in (s.layers for s in layout.stages)] == held  # what the count and estimate read


def test_pp_partition_method_is_megatron_deepspeeds_spelling():
    cfg, _ = parse_args(BASE + ["--num-layers", "4", "--pp-partition-method", "type:transformer|embedding"])
    assert cfg.parallel.pipeline_partition_method == "type:transformer|embedding"


def test_layers_not_dividing_pp_are_balanced_by_deepspeed():
    # DeepSpeed's type: balance of 5 transformer layers over 2 stages (the first takes the extra one), and of
    # 4 over 3; "type:transformer|embedding" weighs the embedding and the tied output layer as a layer each
    assert _counts(_layout(5, 2)) == [3, 2]
    assert _counts(_layout(4, 3)) == [2, 1, 1]
    assert _counts(_layout(4, 3, "--pp-partition-method", "type:transformer|embedding")) == [1, 2, 1]


@pytest.mark.parametrize("flags,match", [
    (["--decoder-first-pipeline-num-layers", "1", "--account-for-loss-in-pipeline-split"], "cannot be combined"),
    (["--decoder-first-pipeline-num-layers", "3"], "3 transformer layers left .* do not split evenly over the 2"),
    (["--decoder-last-pipeline-num-layers", "0"], "--decoder-last-pipeline-num-layers 0 must be positive"),
    (["--account-for-loss-in-pipeline-split"], r"--num-layers 6 \+ 1 \(loss\) = 7 is not divisible by"),
    (["--decoder-first-pipeline-num-layers", "2", "--pp-partition-method", "uniform"], "give one of them"),
    (["--decoder-first-pipeline-num-layers", "2", "--num-layers-per-virtual-pipeline-stage", "1",
      "--global-batch-size", "3"], "give --num-virtual-stages-per-pipeline-rank instead"),
    (["--decoder-first-pipeline-num-layers", "2", "--num-virtual-stages-per-pipeline-rank", "4",
      "--global-batch-size", "3"], "pipeline rank 0 holds 2 layers, which do not split into 4"),
    (["--account-for-embedding-in-pipeline-split", "--num-layers-per-virtual-pipeline-stage", "1",
      "--global-batch-size", "3"], r"--num-layers 6 \+ 1 \(embedding\) = 7 is not divisible by"),
    (["--pipeline-partition-method", "layers:3,3"], "needs 3 counts"),
])
def test_refusals_are_one_line(flags, match):
    with pytest.raises(ConfigError, match=match):
        _layout(6, 3, *flags)


def test_accounted_layers_must_split_into_the_chunks():
    # Megatron-LM's validate_args: (layers + embedding + loss) / PP divisible by the chunks
    with pytest.raises(ConfigError, match=r"3 layers per pipeline rank \(9 / PP 3\) do not split into"):
        _layout(7, 3, "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
                "--num-virtual-stages-per-pipeline-rank", "2", "--global-batch-size", "3")


def test_interleaved_and_zbh1_need_layers_dividing_pp_without_megatron_lm_flags():
    with pytest.raises(ConfigError, match="not divisible by --pipeline-model-parallel-size 3"):
        _layout(5, 3, "--virtual-pipeline-model-parallel-size", "2")
    with pytest.raises(ConfigError, match="the interleaved and ZB-H1 schedules need"):
        _layout(5, 3, "--enable-zbh1-pipeline", "--global-batch-size", "6")


def _dry_run(argv, capsys):
    with contextlib.chdir("/"):
        assert pretrain_main(argv + ["--dry-run", "--mock-data", "--train-iters", "10", "--lr", "1e-4"],
                             family=GPT) == 0
    return capsys.readouterr().out


def _stage_lines(out):
    return [line.strip() for line in out.splitlines() if line.startswith("  stage ") and " layers " in line]


def test_llama3_405b_on_pp16_dry_run(capsys):
    """Llama 3 405B (126 layers) on PP 16: Llama 3's report (section 3.3.2) takes one transformer layer
    each from the first and the last stage, what Megatron-LM's --account-for-embedding/loss-in-pipeline-split
    give: (126 + 2) / 16 = 8 per stage, 7 on the first and last."""
    out = _dry_run(("--world-size 1024 --num-layers 126 --hidden-size 16384 --num-attention-heads 128 "
                    "--group-query-attention --num-query-groups 8 --ffn-hidden-size 53248 --seq-length 8192 "
                    "--max-position-embeddings 8192 --micro-batch-size 1 --global-batch-size 512 --bf16 "
                    "--tensor-model-parallel-size 8 --pipeline-model-parallel-size 16 --vocab-size 128256 "
                    "--swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear "
                    "--untie-embeddings-and-output-weights --recompute-granularity full --recompute-method uniform "
                    "--use-distributed-optimizer --account-for-embedding-in-pipeline-split "
                    "--account-for-loss-in-pipeline-split").split(), capsys)
    stages = _stage_lines(out)
    assert len(stages) == 16
    assert stages[0].startswith("stage 0: layers 0-6,") and stages[1].startswith("stage 1: layers 7-14,")
    assert stages[15].startswith("stage 15: layers 119-125,")
    per_stage = next(line for line in out.splitlines() if line.startswith("memory per pipeline stage (GB): "))
    assert per_stage.count(" 8 layers ") == 14 and per_stage.startswith("memory per pipeline stage (GB): 0: 7 layers")
    assert "every stage within 1% of the estimate" in out  # the meta-device build placed the layers alike


def test_bloom_176b_on_pp12_dry_run(capsys):
    """BLOOM 176B (70 layers, hidden 14336, 112 heads, vocabulary 250880) as BigScience trained it on 384
    A100 80 GB: TP 4 x PP 12 x DP 8 with Megatron-DeepSpeed's --pp-partition-method 'type:transformer|embedding'
    (the embedding and the tied output layer weigh as a layer: 72 / 12 = 6, so 5 transformer layers on the first
    and the last stage); it fits in 80 GB."""
    out = _dry_run(("--world-size 384 --num-layers 70 --hidden-size 14336 --num-attention-heads 112 "
                    "--seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 2 --global-batch-size 2048 "
                    "--bf16 --tensor-model-parallel-size 4 --pipeline-model-parallel-size 12 --vocab-size 250880 "
                    "--checkpoint-activations --gpu-memory-gb a100-80").split()
                   + ["--pp-partition-method", "type:transformer|embedding"], capsys)
    assert [s.split(",")[0] for s in _stage_lines(out)] == (
        ["stage 0: layers 0-4"] + [f"stage {s}: layers {6 * s - 1}-{6 * s + 4}" for s in range(1, 11)]
        + ["stage 11: layers 65-69"])
    assert "of 80 GB: fits" in out
