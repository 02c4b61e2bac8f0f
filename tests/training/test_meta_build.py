"""--dry-run's build of the real model on the meta device (megatron_ds/training/meta_build.py).

The layouts are the ABCI job scripts' (scripts/abci/), built one rank per pipeline stage in this
process. Each stage's built parameter count is checked twice: against the memory estimate's
(families/gpt/gpt_params.py count_gpt_parameters, through config/memory.py) and against a closed form written
here from the architecture (GPT-2: 12h^2 + 13h per layer; Llama: GQA attention, three SwiGLU
matrices, RMSNorm, no biases, untied output layer), split over TP and PP by hand.
"""
from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest
import torch

from megatron_ds.config import parse_args, resolve
from megatron_ds.config.memory import _candidates, estimate_stages, state_bytes
from megatron_ds.errors import ConfigError
from megatron_ds.families import main
from megatron_ds.families.gpt.gpt_family import GPT
from megatron_ds.training.meta_build import TOLERANCE, build_stages, compare

REPO = Path(__file__).resolve().parents[2]
VOCAB = 50257  # GPT-2's, the scripts' default tokenizer
EOD = VOCAB - 1

COMMON = ["--train-iters", "100", "--lr", "1e-4", "--mock-data", "--vocab-size", str(VOCAB), "--zero-stage", "1"]
# name: (job script, world size of its default node count, the script's model and parallel flags)
LAYOUTS = {
    # rt_F=8: 8 nodes x 4 V100
    "gpt_13b": ("abci2_v100_gpt_13b.sh", 32, dict(TP=4, PP=8, NUM_LAYERS=40, HIDDEN_SIZE=5120, NUM_HEADS=40,
                                                  SEQ_LENGTH=2048, MICRO_BATCH=1, GLOBAL_BATCH=512),
                ["--fp16", "--checkpoint-activations", "--deepspeed_config", "ds_configs/zero1_fp16.json"]),
    # select=2: 2 nodes x 8 H200
    "llama_7b": ("abci3_h200_llama_7b.sh", 16, dict(TP=2, PP=1, NUM_LAYERS=32, HIDDEN_SIZE=4096, NUM_HEADS=32,
                                                    SEQ_LENGTH=4096, MICRO_BATCH=1, GLOBAL_BATCH=1024,
                                                    NUM_KV_HEADS=8, FFN_HIDDEN_SIZE=11008),
                 ["--use-rotary-position-embeddings", "--swiglu", "--normalization", "rmsnorm",
                  "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--attention-dropout", "0",
                  "--hidden-dropout", "0", "--bf16", "--deepspeed_config", "ds_configs/zero1_bf16.json"]),
    # rt_AF=1: one node x 8 A100
    "gpt_1.3b": ("abci2_a100_gpt_1.3b.sh", 8, dict(TP=1, PP=1, NUM_LAYERS=24, HIDDEN_SIZE=2048, NUM_HEADS=16,
                                                   SEQ_LENGTH=2048, MICRO_BATCH=4, GLOBAL_BATCH=512),
                 ["--bf16", "--checkpoint-activations", "--deepspeed_config", "ds_configs/zero1_bf16.json"]),
}


def _argv(name: str, extra=()) -> list[str]:
    _, world, v, flags = LAYOUTS[name]
    argv = ["--tensor-model-parallel-size", str(v["TP"]), "--pipeline-model-parallel-size", str(v["PP"]),
            "--num-layers", str(v["NUM_LAYERS"]), "--hidden-size", str(v["HIDDEN_SIZE"]),
            "--num-attention-heads", str(v["NUM_HEADS"]), "--seq-length", str(v["SEQ_LENGTH"]),
            "--max-position-embeddings", str(v["SEQ_LENGTH"]), "--micro-batch-size", str(v["MICRO_BATCH"]),
            "--global-batch-size", str(v["GLOBAL_BATCH"]), *COMMON, *flags, *extra]
    if "NUM_KV_HEADS" in v:
        argv += ["--num-key-value-heads", str(v["NUM_KV_HEADS"]), "--ffn-hidden-size", str(v["FFN_HIDDEN_SIZE"])]
    return argv


def _run(name: str, extra=()):
    cfg, _ = parse_args(_argv(name, extra))
    return resolve(cfg, world_size=LAYOUTS[name][1], vocab_size=VOCAB, device_type="cuda", family=GPT)


def _padded(tp: int) -> int:
    multiple = 128 * tp  # --make-vocab-size-divisible-by 128 (the default) on every TP rank
    return -(-VOCAB // multiple) * multiple


def closed_form(name: str, stage: int, virtual: int = 1) -> int:
    """Parameters one TP rank of ``stage`` holds, from the architecture (not from the code)."""
    v = LAYOUTS[name][2]
    h, tp, pp, n = v["HIDDEN_SIZE"], v["TP"], v["PP"], v["NUM_LAYERS"]
    emb = _padded(tp) * h // tp
    if "NUM_KV_HEADS" in v:  # Llama: q and o a*d x h, k and v g*d x h, SwiGLU 3 h x f, two RMSNorms
        d = h // v["NUM_HEADS"]
        attention = h * v["NUM_HEADS"] * d * 2 + h * v["NUM_KV_HEADS"] * d * 2
        layer = (attention + 3 * h * v["FFN_HIDDEN_SIZE"]) // tp + 2 * h
        first, last = emb, h + emb  # untied: its own output layer; RMSNorm has no bias
    else:  # GPT-2: QKV 3h^2 + 3h and MLP 8h^2 + 4h (biases of the column-parallel layers) and
        # the projection h^2 split over TP; two LayerNorms 4h and two row-parallel biases 2h not
        layer = (12 * h * h + 7 * h) // tp + 6 * h
        first = emb + v["SEQ_LENGTH"] * h  # + learned positions
        last = 2 * h + (emb if pp > 1 else 0)  # final LayerNorm; the tied copy lives apart from stage 0
    params = n // pp * layer
    return params + (first if stage == 0 else 0) + (last if stage == pp - 1 else 0)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layouts_are_the_job_scripts(name):
    script = (REPO / "scripts" / "abci" / LAYOUTS[name][0]).read_text()
    for var, value in LAYOUTS[name][2].items():
        assert f"{var}=${{{var}:-{value}}}" in script, (var, value)
    flags = LAYOUTS[name][3]
    for flag in flags:
        if flag.startswith("--") and flag != "--deepspeed_config":
            assert flag in script, flag
    # common.sh's DS_CONFIG: ds_configs/zero${ZERO_STAGE}_P.json for `set_job_defaults P`, ZERO_STAGE 1
    precision = flags[flags.index("--deepspeed_config") + 1].removesuffix(".json").split("_")[-1]
    assert f"set_job_defaults {precision}" in script
    assert "ZERO_STAGE=${ZERO_STAGE:-1}" in (REPO / "scripts" / "abci" / "common.sh").read_text()


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_built_stages_match_the_estimate_and_the_closed_form(name):
    run = _run(name)
    built = build_stages(run, EOD)
    assert not torch.distributed.is_initialized()  # the fake tensor parallel group is gone
    assert [b.stage for b in built] == list(range(run.layout.pp))
    for b in built:
        assert b.params == closed_form(name, b.stage), b
        assert b.param_bytes == 2 * b.params  # fp16 / bf16 weights in the module
        for quantity, (value, estimated) in compare(run.layout, b).items():
            assert value == pytest.approx(estimated, rel=TOLERANCE), (b.stage, quantity)
    if name == "llama_7b":
        # BF16_Optimizer (ZeRO 1, fp32 accumulation): fp32 master weights and Adam's two moments,
        # 12 bytes per parameter, split over DP 8
        assert compare(run.layout, built[0])["optimizer states"][0] == pytest.approx(built[0].params * 12 / 8)


def test_interleaved_chunks_hold_the_same_parameters_per_rank():
    # 13B at PP 4 with two chunks of 5 layers per rank: rank 0 holds the embedding and layers 0-4
    # and 20-24, the last rank 15-19 and 35-39 and the tied copy: 10 layers per rank either way.
    extra = ["--pipeline-model-parallel-size", "4", "--num-layers-per-virtual-pipeline-stage", "5"]
    run = _run("gpt_13b", extra)
    assert run.layout.virtual_pp == 2
    built = build_stages(run, EOD)
    v = LAYOUTS["gpt_13b"][2]
    h, tp = v["HIDDEN_SIZE"], v["TP"]
    layer = (12 * h * h + 7 * h) // tp + 6 * h
    emb = _padded(tp) * h // tp
    expected = [10 * layer + emb + v["SEQ_LENGTH"] * h, 10 * layer, 10 * layer, 10 * layer + 2 * h + emb]
    assert [b.params for b in built] == expected
    assert [s.params_per_tp_rank for s in run.layout.stages] == expected


TINY = ["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "128",
        "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "10", "--lr", "1e-4",
        "--mock-data", "--vocab-size", str(VOCAB), "--pipeline-model-parallel-size", "4"]


@pytest.mark.parametrize("method, layers", [
    # DeepSpeed's partition_uniform over all 11 layers (embedding, 8 transformer layers, final
    # norm, output layer) in 4 parts: 3, 3, 3, 2 -- the last stage holds no transformer layer.
    ("uniform", [(0, 2), (2, 5), (5, 8), (8, 8)]),
    # balancing parameters: the word embedding (50304 x 64) and its tied copy each outweigh all 8
    # transformer layers (8 x 50k), so they stand alone on the end stages and the middle two
    # stages split the layers.
    ("parameters", [(0, 0), (0, 4), (4, 8), (8, 8)]),
])
def test_other_partition_methods_move_layers_and_the_estimate_follows(method, layers):
    cfg, _ = parse_args(TINY + ["--pipeline-partition-method", method])
    run = resolve(cfg, world_size=4, vocab_size=VOCAB, device_type="cpu", family=GPT)
    assert [s.layers for s in run.layout.stages] == layers
    built = build_stages(run, EOD)
    assert [b.params for b in built] == [s.params_per_tp_rank for s in run.layout.stages]


@pytest.mark.parametrize("method, message", [("type:MoELayer", "matches no layer of the model"),
                                             ("profile", "knows uniform, parameters and type:REGEX")])
def test_partition_methods_deepspeed_refuses_are_refused_before_the_queue(method, message):
    cfg, _ = parse_args(TINY + ["--pipeline-partition-method", method])
    with pytest.raises(ConfigError, match=message):
        resolve(cfg, world_size=4, vocab_size=VOCAB, device_type="cpu", family=GPT)


def test_dry_run_prints_the_built_model_per_stage():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(_argv("gpt_13b") + ["--dry-run", "--world-size", "32"]) == 0
    text = out.getvalue()
    assert "model built on the meta device, one rank per pipeline stage (TP rank 0 of 4, DP rank 0" in text
    counts = re.findall(r"^  stage (\d): ([\d,]+) parameters built, ([\d,]+) estimated \(\+0\.00%\); "
                        r"GB built/estimated: weights [\d.]+/[\d.]+, gradients [\d.]+/[\d.]+, "
                        r"optimizer states [\d.]+/[\d.]+$", text, re.M)
    assert [int(s) for s, _, _ in counts] == list(range(8))
    assert [int(c.replace(",", "")) for _, c, _ in counts] == [closed_form("gpt_13b", s) for s in range(8)]
    assert re.search(r"^  every stage within 1% of the estimate \(built in [\d.]+ s\)$", text, re.M)
    assert text.index("every stage within") < text.index("memory per GPU")
    assert not torch.distributed.is_initialized()


MOE_BASE = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
            "--micro-batch-size 1 --mock-data --vocab-size 100 --train-iters 10 --lr 1e-4").split()


@pytest.mark.parametrize("extra, world", [
    ("--num-experts 8 --moe-expert-parallel-size 2 --topk 2", 4),  # GPT-2 MLP experts on layers 2 and 4
    # PR-MoE on every layer, Llama-style experts, TP 2 x PP 2 x DP 2 (experts whole on each TP rank)
    ("--num-experts 4 --expert-interval 1 --moe-expert-parallel-size 2 --mlp-type residual "
     "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --swiglu --disable-bias-linear", 8),
])
def test_moe_stage_counts_are_the_built_models(extra, world):
    """MoE: the layout's per-rank counts (config/moe_params.py: 1/EP of the experts) and its expert share are what
    the MoE model builds on each stage; expert parameters are those DeepSpeed marks (is_moe_param). Built on the
    CPU: these are small."""
    from deepspeed.moe.utils import is_moe_param

    from megatron_ds import ds_compat
    from megatron_ds.families.gpt.gpt_model import build_stage_gpt
    from megatron_ds.training.engine import model_kwargs

    cfg, _ = parse_args(MOE_BASE + extra.split())
    run = resolve(cfg, world_size=world, vocab_size=100, device_type="cpu", family=GPT)
    lay = run.layout
    group = ds_compat.fake_process_group(lay.tp, 0) if lay.tp > 1 else contextlib.nullcontext()
    with group as tp_group:
        for stage in lay.stages:
            model = build_stage_gpt(lay.model, num_stages=lay.pp, stage=stage.stage,
                                    partition_method=run.distributed.pipeline_partition_method,
                                    **model_kwargs(run, tp_group, EOD, device="cpu"))
            params = list(model.parameters())
            assert sum(p.numel() for p in params) == stage.params_per_tp_rank
            assert sum(p.numel() for p in params if is_moe_param(p)) == stage.expert_params_per_tp_rank > 0


@pytest.mark.parametrize("method", ["type:ParallelTransformerLayer", "uniform", "parameters"])
def test_moe_partitions_match_the_analytic_count(method):
    """DeepSpeed's partition methods over an MoE model (8 experts on layers 2 and 4, EP 1): "parameters"
    balances by what each layer holds, so MoE layers weigh more; the layout's per-stage counts are the stages
    the built model is cut into."""
    from megatron_ds.config import resolve_model_config
    from megatron_ds.config.schema import ModelConfig
    from megatron_ds.families.gpt.gpt_model import build_sequential_gpt
    from megatron_ds.families.gpt.gpt_params import count_gpt_parameters

    cfg = resolve_model_config(ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32,
                                           num_experts=(8,)))
    model = build_sequential_gpt(cfg, padded_vocab_size=128, seed=1)
    _, stages = count_gpt_parameters(cfg, 128, 1, 2, method)
    assert model.stage_parameter_counts(2, method) == [s.params_per_tp_rank for s in stages]


def test_moe_dry_run_build_matches_the_estimate():
    """--dry-run's meta-device build of an MoE model with experts split over TP (--enable-expert-tensor-parallelism),
    one count per MoE layer, PR-MoE, ZeRO 1 bf16 on TP 2 x DP 4 with EP 2: parameters, expert parameters and the
    weights, gradients and optimizer states that follow (ZeRO splits expert states over TP x DP / (EP x TP) = 2
    ranks, dense ones over DP 4) equal the estimate's."""
    cfg, _ = parse_args(MOE_BASE + ("--num-experts 4 2 --moe-expert-parallel-size 2 --mlp-type residual "
                                    "--tensor-model-parallel-size 2 --enable-expert-tensor-parallelism --zero-stage 1 "
                                    "--create-moe-param-group --bf16").split())
    run = resolve(cfg, world_size=8, vocab_size=100, device_type="cuda", family=GPT)
    (built,) = build_stages(run, EOD)
    assert built.expert_params == run.layout.stages[0].expert_params_per_tp_rank > 0
    for quantity, (value, estimated) in compare(run.layout, built).items():
        assert value == pytest.approx(estimated, rel=1e-12), quantity  # the same counts: exact up to float sums


@pytest.mark.parametrize("extra, sizes", [
    # TP 2 x DP 4, each expert split over the 2 tensor parallel ranks (ETP 2) and the experts over 2 data
    # parallel ranks of each (EP 2)
    ("--expert-tensor-parallel-size 2 --expert-model-parallel-size 2", dict(dp=4, cp=1, ep=2, etp=2)),
    # TP 2 x CP 2 x DP 2, whole experts over all four TP x CP ranks of a data parallel rank (EP 4)
    ("--context-parallel-size 2 --expert-model-parallel-size 4 --expert-tensor-parallel-size 1",
     dict(dp=2, cp=2, ep=4, etp=1)),
    # TP 4 x DP 2, Megatron-LM's expert grid with ETP 2 below TP: halves of experts over ETP pairs, EP 2 over the
    # pairs, expert data parallel 8 / (2 x 2) = 2 (the last --tensor-model-parallel-size wins)
    ("--tensor-model-parallel-size 4 --expert-tensor-parallel-size 2 --expert-model-parallel-size 2",
     dict(dp=2, cp=1, ep=2, etp=2)),
], ids=["etp2_ep2", "cp2_ep4", "tp4_etp2_ep2"])
def test_megatron_lms_moe_estimate_splits_experts_over_ep_and_etp(extra, sizes):
    """Megatron-LM's MoE on 8 ranks (TP 2 with sequence parallelism, ZeRO 1, bf16): the estimate holds on each rank
    1/EP of every MoE layer's experts, each 1/ETP of its MLP, counted independently here from the shapes (SwiGLU
    fc1 [2 ffn, h] and fc2 [h, ffn] per expert) and equal to the meta-device build; ZeRO splits the expert states
    over Megatron-LM's expert data parallel size, world / (ETP x EP x PP) (megatron/core/parallel_state.py), the
    dense ones over DP x CP."""
    h, ffn, experts, layers, world = 64, 32, 8, 2, 8
    cfg, _ = parse_args(MOE_BASE + ["--num-layers", str(layers), "--swiglu", "--disable-bias-linear", "--bf16",
                                    "--use-distributed-optimizer", "--num-experts", str(experts),
                                    "--moe-ffn-hidden-size", str(ffn), "--tensor-model-parallel-size", "2",
                                    "--sequence-parallel", *extra.split()])
    run = resolve(cfg, world_size=world, vocab_size=100, device_type="cuda", family=GPT)
    lay = run.layout
    assert (lay.dp, lay.cp, lay.ep, lay.etp) == tuple(sizes.values())
    expert_params = layers * (experts // sizes["ep"]) * 3 * ffn * h // sizes["etp"]
    assert lay.stages[0].expert_params_per_tp_rank == expert_params
    (built,) = build_stages(run, EOD)
    assert (built.params, built.expert_params) == (lay.stages[0].params_per_tp_rank, expert_params)
    sb, edp = state_bytes(lay), world // (sizes["etp"] * sizes["ep"])
    dense = built.params - expert_params
    optimizer = sb.optimizer * built.params + sb.optimizer_split * (dense / (sizes["dp"] * sizes["cp"])
                                                                    + expert_params / edp)
    assert dict(estimate_stages(lay)[0].terms)["optimizer states"] == pytest.approx(optimizer, rel=1e-12)
    if sizes["etp"] == lay.tp:  # a suggested wider TP splits the experts with it (ETP = TP, as the default)
        flag, wider = next((f, c) for f, c in _candidates(lay) if f.startswith("--tensor-model-parallel-size 4"))
        assert flag == "--tensor-model-parallel-size 4 --expert-tensor-parallel-size 4" and wider.etp == 4
        assert wider.stages[0].expert_params_per_tp_rank == expert_params // 2
