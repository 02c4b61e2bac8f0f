"""Mixture of experts in the plan: layer placement, parameter counts, memory, and the one-line refusals.

Layer placement is checked against a transcription of Megatron-DeepSpeed's get_num_experts_per_layer
(megatron/model/transformer.py); parameter counts against closed forms written here from DeepSpeed's MoE layer
(deepspeed/moe/layer.py: a bias-free hidden x E gate, num_experts / ep_size copies of the expert MLP, with
use_residual the MLP and a hidden x 2 coefficient linear); the refusals through pretrain_gpt.py --dry-run.
"""
from __future__ import annotations

import contextlib
import io

import pytest

from megatron_ds.config import parse_args, resolve
from megatron_ds.config.memory import parameter_state, state_bytes
from megatron_ds.config.moe_params import expert_capacity, experts_per_layer
from megatron_ds.errors import ConfigError
from megatron_ds.families import main
from megatron_ds.families.gpt.gpt_family import GPT

SMALL = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
         "--micro-batch-size 2 --mock-data --vocab-size 100 --make-vocab-size-divisible-by 8 --train-iters 10 "
         "--lr 1e-4").split()


def upstream_experts_per_layer(num_experts: list, num_layers: int, expert_interval: int) -> list:
    """deepspeedai/Megatron-DeepSpeed megatron/model/transformer.py get_num_experts_per_layer (offset 0), transcribed."""
    assert len(num_experts) == 1 or len(num_experts) == num_layers // expert_interval
    if len(num_experts) == 1:
        num_experts = num_experts * (num_layers // expert_interval)
    out = []
    for i in range(num_layers):
        layer_num = i + 1
        out.append(num_experts[(layer_num - 1) // expert_interval] if layer_num % expert_interval == 0 else 1)
    return out


@pytest.mark.parametrize("num_experts, num_layers, interval", [
    ([8], 12, 2), ([8], 12, 1), ([4], 7, 3), ([64, 64, 64, 64, 64, 128, 128, 128, 128, 128, 128, 128], 24, 2),
    ([2, 4, 8], 12, 4), ([16], 5, 5)])
def test_experts_per_layer_is_megatron_deepspeeds(num_experts, num_layers, interval):
    assert list(experts_per_layer(num_experts, num_layers, interval)) == \
        upstream_experts_per_layer(num_experts, num_layers, interval)


def test_wrong_list_length_is_one_line():
    with pytest.raises(ConfigError, match="gives 3 values, but --num-layers 12 with --expert-interval 2 has 6 MoE"):
        experts_per_layer((2, 4, 8), 12, 2)


def _layout(argv, world):
    cfg, _ = parse_args(argv)
    return resolve(cfg, world_size=world, vocab_size=50257, device_type="cuda", family=GPT).layout


def _moe64_argv():
    """ds_pretrain_gpt_125M_MoE64.sh's model and MoE flags (tests/config/megatron_scripts.py has the whole script)."""
    return ("--num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 2048 --max-position-embeddings "
            "2048 --micro-batch-size 4 --global-batch-size 256 --mock-data --train-iters 10 --lr 4.5e-4 --fp16 "
            "--num-experts 64 --moe-expert-parallel-size 64 --create-moe-param-group --no-pipeline-parallel").split()


def test_125m_moe64_counts():
    """GPT-3 125M with 64 experts on every second layer (6 of 12), top-1, EP 64 on 64 GPUs: closed forms.
    Dense layer 12h^2 + 13h; MoE layer: attention 4h^2 + 4h, two LayerNorms 4h, gate 64h, 64 experts of
    8h^2 + 5h (the h -> 4h and 4h -> h linears with biases)."""
    lay = _layout(_moe64_argv(), 64)
    h, v, s = 768, 50304, 2048  # 50257 padded to a multiple of 128
    dense, attention, gate, expert = 12 * h * h + 13 * h, 4 * h * h + 8 * h, 64 * h, 8 * h * h + 5 * h
    rest = v * h + s * h + 2 * h  # tied embedding, positions, final LayerNorm
    assert lay.total_params == 6 * dense + 6 * (attention + gate + 64 * expert) + rest
    assert lay.active_params == 6 * dense + 6 * (attention + gate + expert) + rest
    (stage,) = lay.stages
    assert stage.params_per_tp_rank == 6 * dense + 6 * (attention + gate + expert) + rest  # 64 / EP 64 = 1 each
    assert stage.expert_params_per_tp_rank == 6 * expert
    assert lay.ep == 64 and lay.ds_config["pipeline"]["pipe_partitioned"] is False


def test_per_rank_counts_with_tp_residual_and_expert_tp():
    """TP 2 x PP 2 x DP 2, 4 experts on every layer, EP 2, PR-MoE (residual), Llama-style MLP (SwiGLU, no biases):
    each rank holds 2 experts, whole (or split over TP with --enable-expert-tensor-parallelism), the residual
    MLP likewise, the gate and the coefficient (hidden x 2 + bias) whole."""
    h, f, a, layers_per_stage = 64, 96, 4, 2
    base = (f"--num-layers 4 --hidden-size {h} --num-attention-heads {a} --ffn-hidden-size {f} --swiglu "
            f"--disable-bias-linear --normalization rmsnorm --seq-length 32 --max-position-embeddings 32 "
            f"--position-embedding-type rope --micro-batch-size 1 --mock-data --train-iters 10 --lr 1e-4 "
            f"--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --num-experts 4 --expert-interval 1 "
            f"--moe-expert-parallel-size 2 --mlp-type residual --topk 2").split()
    attention = 4 * h * h // 2 + 2 * h  # q, k, v, o split over TP 2; two RMSNorms whole
    mlp = 3 * h * f
    for expert_tp, shard in (([], mlp), (["--enable-expert-tensor-parallelism"], mlp // 2)):
        lay = _layout(base + expert_tp, 8)
        per_layer = attention + 4 * h + 2 * shard + (shard + 2 * h + 2)
        assert [s.params_per_tp_rank - per_layer * layers_per_stage for s in lay.stages] == \
            [lay.padded_vocab_size * h // 2, h + lay.padded_vocab_size * h // 2]  # embedding; final norm + output
        assert [s.expert_params_per_tp_rank for s in lay.stages] == [2 * 2 * shard] * 2
        full = 4 * h * h + 2 * h + 4 * h + 4 * mlp + mlp + 2 * h + 2
        assert lay.total_params == 4 * full + lay.padded_vocab_size * h + h  # tied embedding, final RMSNorm
        assert lay.active_params == lay.total_params - 4 * 2 * mlp  # 2 of the 4 experts


def test_zero_splits_expert_states_over_the_expert_data_parallel_group():
    """ZeRO 1 on TP 1 x DP 8 with EP 4: dense optimizer states (fp32 master + Adam moments, 12 bytes) split over
    DP 8, expert ones over the 2 ranks holding the same experts (DeepSpeed's expert data parallel group)."""
    lay = _layout(SMALL + "--num-experts 8 --moe-expert-parallel-size 4 --zero-stage 1 --create-moe-param-group "
                          "--bf16".split(), 8)
    sb = state_bytes(lay)
    assert sb.optimizer_split == 12
    state = parameter_state(lay, 1000, expert_params=400)
    assert state.optimizer == pytest.approx(600 * 12 / 8 + 400 * 12 / 2)


def dry_run(argv, world) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(argv) + ["--dry-run", "--world-size", str(world)])
    return rc, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("extra, world, says", [
    ("--num-experts 6 --moe-expert-parallel-size 4", 8, "--num-experts 6 is not divisible by --moe-expert-parallel"),
    ("--num-experts 8 --moe-expert-parallel-size 4", 2, "--moe-expert-parallel-size 4 does not divide the data "
                                                        "parallel size 2"),
    ("--num-experts 2 --topk 3", 1, "--topk 3"),
    ("--num-experts 2 4 8", 1, "--num-experts gives 3 values"),
    ("--num-experts 8 --expert-interval 5", 1, "places no MoE layer"),
    ("--num-experts 2 --zero-stage 3 --no-pipeline-parallel", 2, "ZeRO stage 3"),
    ("--num-experts 2 --zero-stage 1", 2, "needs --create-moe-param-group"),
    ("--num-experts 2 --bf16", 1, "needs --create-moe-param-group"),  # BF16_Optimizer in the pipeline engine
    # FP16_Optimizer's clipping norm (bf16 on the plain engine)
    ("--num-experts 2 --moe-expert-parallel-size 2 --bf16 --no-pipeline-parallel", 2, "clip differently"),
    ("--num-experts 2 --ds-sequence-parallel-size 2 --no-pipeline-parallel", 2, "DeepSpeed-Ulysses"),
    ("--num-experts 2 --tensor-model-parallel-size 2 --sequence-parallel", 2, "--sequence-parallel"),
    ("--num-experts 2 --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 "
     "--global-batch-size 4", 2, "interleaved or ZB-H1"),
    ("--num-experts 2 --pipeline-model-parallel-size 2 --enable-zbh1-pipeline --global-batch-size 4", 2,
     "interleaved or ZB-H1"),
    ("--num-experts 2 --moe-train-capacity-factor 0", 1, "--moe-train-capacity-factor 0.0 is out of range"),
    # 64 tokens over 6 experts: ceil(10.67) = 11 slots, which DeepSpeed's drop_tokens cannot split over TP 2
    ("--num-experts 6 --tensor-model-parallel-size 2", 2, "capacity of 11 tokens per expert"),
    ("--num-experts 2 --tensor-model-parallel-size 2 --disable-moe-token-dropping "
     "--enable-expert-tensor-parallelism", 2, "drop one of the two flags"),
    # MoE on layer 4 only: stage 0 (layers 1-2) has none, and BF16_Optimizer's expert norm would wait for it
    ("--num-experts 2 --expert-interval 4 --pipeline-model-parallel-size 2 --bf16 --create-moe-param-group", 2,
     "stage(s) 0 would hold no MoE layer"),
])
def test_bad_moe_input_is_one_line_at_dry_run(extra, world, says):
    # DeepSpeed-MoE's refusals: on a Megatron-DeepSpeed line, where --num-experts alone builds that layer
    rc, _, err = dry_run(SMALL + ["--deepspeed"] + extra.split(), world)
    assert rc == 1 and len(err.strip().splitlines()) == 1 and says in err, err


def test_dry_run_reports_moe_parameters():
    rc, out, err = dry_run(SMALL + "--num-experts 8 --moe-expert-parallel-size 2 --topk 2".split(), 4)
    assert rc == 0, err
    assert "mixture of experts: 2 of 4 layers (every 2), 8 experts, top-2, EP 2 (4 per rank)" in out
    assert "M active per token" in out and "of them experts: 1/EP of each MoE layer's" in out


def test_dense_model_with_ep_is_a_note():
    rc, out, err = dry_run(SMALL + "--moe-expert-parallel-size 2".split(), 2)
    assert rc == 0, err
    assert "WARNING: --moe-expert-parallel-size 2 has no effect on a dense model" in out


def test_memory_suggestions_stay_valid_for_moe():
    """A MoE layout that does not fit: the single changes the estimate suggests keep EP dividing DP, never ZeRO 3,
    and a ZeRO change carries --create-moe-param-group; each one resolves."""
    from megatron_ds.config.memory import estimate_memory, suggestions

    argv = ("--num-layers 8 --hidden-size 1024 --num-attention-heads 16 --seq-length 2048 --micro-batch-size 4 "
            "--global-batch-size 32 --mock-data --train-iters 10 --lr 1e-4 --bf16 --no-pipeline-parallel "
            "--num-experts 16 --moe-expert-parallel-size 4 --create-moe-param-group --zero-stage 1").split()
    lay = _layout(argv, 8)
    fixes = suggestions(lay, estimate_memory(lay).total * 0.9, limit=10)
    assert fixes and not any("--zero-stage 3" in f for f in fixes), fixes
    for fix in fixes:
        flags = fix.split(" (~")[0].split()
        assert not flags[0] == "--zero-stage" or "--create-moe-param-group" in flags, fix
        _layout(argv + flags, 8)  # resolves: no ConfigError


def test_zero_json_that_moe_cannot_run_is_one_line(tmp_path):
    """DeepSpeed's ZeRO optimizer asserts reduce_scatter (and at stage 2 contiguous_gradients) for MoE."""
    import json

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2, "contiguous_gradients": False}}))
    rc, _, err = dry_run(SMALL + ["--num-experts", "2", "--create-moe-param-group", "--no-pipeline-parallel",
                                  "--deepspeed_config", str(path)], 2)
    assert rc == 1 and len(err.strip().splitlines()) == 1 and '"contiguous_gradients": true' in err, err


@pytest.mark.parametrize("tokens, experts, topk, factor, min_capacity", [
    (64, 6, 1, 1.0, 4), (64, 4, 2, 1.0, 4), (4096, 64, 1, 1.25, 4), (10, 8, 2, 0.5, 4), (96, 7, 3, 1.1, 0)])
def test_expert_capacity_is_deepspeeds(tokens, experts, topk, factor, min_capacity):
    """The slots --dry-run checks against TP equal DeepSpeed's own _capacity on gates of that shape
    (deepspeed/moe/sharded_moe.py; top-2 and top-k gates pass the factor times k)."""
    import torch  # noqa: PLC0415
    from deepspeed.moe.sharded_moe import _capacity  # noqa: PLC0415

    gates = torch.zeros(tokens, experts)
    k = 1 if topk == 1 else topk
    expected = int(_capacity(gates, torch.tensor(factor * k), torch.tensor(min_capacity)))
    assert expert_capacity(tokens, experts, topk, factor, min_capacity) == expected


def test_capacity_that_tp_splits_passes_dry_run():
    rc, out, err = dry_run(SMALL + "--deepspeed --num-experts 4 --tensor-model-parallel-size 2".split(), 2)  # 16 slots
    assert rc == 0, err
