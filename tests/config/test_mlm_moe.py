"""Which MoE layer a command line builds (megatron_ds/config/moe_selection.py), Megatron-LM's MoE flags resolved and
refused in one line, and its parameter count against a built layer.

--moe-layer-freq follows Megatron-LM's moe_freq_type (megatron/training/arguments.py) and
TransformerConfig.moe_layer_freq: an int N makes layer i (from 0) an MoE layer when i % N == 0; a list expression
gives one 0/1 per layer.
"""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from megatron_ds.config import moe_selection
from megatron_ds.config.layout import resolve_model_config
from megatron_ds.config.moe_params import model_experts, moe_layer_params
from megatron_ds.config.schema import ModelConfig, ParallelConfig
from megatron_ds.model.mlm_moe import build_mlm_moe
from tests.config.test_moe import SMALL, _layout, dry_run


@pytest.mark.parametrize("extra, says", [
    # --num-experts alone: the line's dialect decides (--deepspeed or not)
    ("--deepspeed --num-experts 4", "DeepSpeed-MoE (model/moe_layer.py), because --num-experts without either "
                                    "family's MoE flags, on a Megatron-DeepSpeed command line"),
    ("--num-experts 4", "Megatron-LM's MoE (model/mlm_moe.py; allgather dispatch, EP 1, ETP 1 (Megatron-LM's default "
                        "ETP = TP: no --expert-tensor-parallel-size)), because --num-experts "
                        "without either family's MoE flags, on an upstream Megatron-LM command line"),
    # a family's flags decide whatever the dialect
    ("--num-experts 4 --topk 2 --moe-expert-parallel-size 2", "DeepSpeed-MoE (model/moe_layer.py), because "
                                                               "Megatron-DeepSpeed's MoE flags (--topk "
                                                               "--moe-expert-parallel-size)"),
    ("--deepspeed --num-experts 4 --moe-router-topk 2 --moe-token-dispatcher-type alltoall",
     "Megatron-LM's MoE (model/mlm_moe.py; alltoall dispatch, EP 1, ETP 1 (Megatron-LM's default ETP = TP: no "
     "--expert-tensor-parallel-size)), because Megatron-LM's MoE flags "
     "(--moe-router-topk --moe-token-dispatcher-type)"),
    ("--deepspeed --num-experts 4 --expert-model-parallel-size 1",
     "Megatron-LM's MoE (model/mlm_moe.py; allgather dispatch"),
])
def test_dry_run_says_which_moe_layer_and_why(extra, says):
    rc, out, err = dry_run(SMALL + extra.split(), 2)
    assert rc == 0, err
    assert f"mixture of experts: {says}" in out, out


def test_dry_run_describes_megatron_lms_layers():
    rc, out, err = dry_run(SMALL + "--num-experts 8 --moe-router-topk 3 --moe-ffn-hidden-size 32 --moe-layer-freq 2 "
                                   "--moe-shared-expert-intermediate-size 48".split(), 2)
    assert rc == 0, err
    assert ("mixture of experts (Megatron-LM's): 2 of 4 layers, 8 experts of ffn 32, top-3, shared ffn 48, EP 1 "
            "(8 per rank)") in out, out


def test_dry_run_describes_expert_tensor_parallelism():
    rc, out, err = dry_run(SMALL + "--num-experts 4 --moe-router-topk 2 --tensor-model-parallel-size 2 "
                                   "--sequence-parallel --expert-tensor-parallel-size 2".split(), 2)
    assert rc == 0, err
    assert "EP 1 (4 per rank, split over ETP 2)" in out, out


def test_expert_grid_below_tp_is_built():
    """Megatron-LM's expert grid with ETP between 1 and TP: TP 4, ETP 2, EP 2 on 4 ranks (experts 2 per rank, halves)."""
    rc, out, err = dry_run(SMALL + "--num-experts 4 --num-attention-heads 4 --tensor-model-parallel-size 4 "
                                   "--sequence-parallel --expert-tensor-parallel-size 2 --expert-model-parallel-size 2 "
                                   "--moe-token-dispatcher-type alltoall".split(), 4)
    assert rc == 0, err
    assert "EP 2 (2 per rank, split over ETP 2)" in out, out


def test_expert_tensor_parallel_size_defaults_to_tp_as_megatron_lm():
    """Megatron-LM sets --expert-tensor-parallel-size to TP when it is absent (megatron/training/arguments.py
    validate_args): an upstream script at TP 2 with --sequence-parallel gets its experts split over TP."""
    rc, out, err = dry_run(SMALL + "--num-experts 4 --tensor-model-parallel-size 2 --sequence-parallel".split(), 2)
    assert rc == 0, err
    assert "EP 1 (4 per rank, split over ETP 2)" in out, out
    assert "EP 1, ETP 2 (Megatron-LM's default ETP = TP: no --expert-tensor-parallel-size)" in out, out


@pytest.mark.parametrize("extra, world, says", [
    # Megatron-LM's default ETP is TP (arguments.py: expert_tensor_parallel_size = tensor_model_parallel_size), so
    # its scripts at TP > 1 that want whole experts pass 1; with and without sequence parallelism, with EP over
    # TP x DP and with context parallelism
    ("--tensor-model-parallel-size 2 --expert-tensor-parallel-size 1", 2, "EP 1 (4 per rank)"),
    ("--tensor-model-parallel-size 2 --sequence-parallel --expert-tensor-parallel-size 1 "
     "--expert-model-parallel-size 4", 4, "EP 4 (1 per rank)"),
    ("--tensor-model-parallel-size 2 --sequence-parallel --expert-tensor-parallel-size 1 --context-parallel-size 2 "
     "--expert-model-parallel-size 2", 4, "EP 2 (2 per rank)"),
    ("--tensor-model-parallel-size 2 --sequence-parallel --expert-tensor-parallel-size 2 --context-parallel-size 2 "
     "--expert-model-parallel-size 2", 4, "EP 2 (2 per rank, split over ETP 2)"),
    ("--num-attention-heads 4 --tensor-model-parallel-size 4 --sequence-parallel --expert-tensor-parallel-size 4",
     4, "EP 1 (4 per rank, split over ETP 4)"),
], ids=["tp2_etp1", "tp2_sp_etp1_ep4", "tp2_sp_cp2_etp1_ep2", "tp2_sp_cp2_etp2_ep2", "tp4_sp_etp4"])
def test_expert_tensor_parallel_sizes_megatron_lm_accepts_and_are_built(extra, world, says):
    """The --expert-tensor-parallel-size values built here, 1 and TP, in the layouts they combine with."""
    rc, out, err = dry_run(SMALL + "--num-experts 4 --moe-router-topk 2".split() + extra.split(), world)
    assert rc == 0, err
    assert says in out, out


def test_sinkhorn_is_accepted():
    rc, out, err = dry_run(SMALL + "--num-experts 4 --moe-router-load-balancing-type sinkhorn".split(), 1)
    assert rc == 0 and "Megatron-LM's MoE" in out, err


def test_num_experts_alone_builds_the_dialects_layer(tmp_path):
    """Upstream Megatron-LM's --num-experts 8 alone (no DeepSpeed on the line) is its MoE as TransformerConfig's
    defaults make it (core_v0.19.0 megatron/core/transformer/transformer_config.py: moe_router_topk 2,
    moe_layer_freq 1, moe_expert_capacity_factor None = dropless); Megatron-DeepSpeed's scripts always pass
    --deepspeed --deepspeed_config, and their --num-experts 8 is DeepSpeed-MoE on every --expert-interval'th layer
    (default 2, megatron/arguments.py), top-1."""
    upstream = _layout(SMALL + ["--num-experts", "8"], 2)
    m = upstream.model
    assert moe_selection.is_mlm_moe(m)
    assert (m.moe_router_topk, m.moe_expert_capacity_factor) == (2, None)
    assert model_experts(m) == (8, 8, 8, 8)
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2}))
    ds = _layout(SMALL + ["--deepspeed", "--deepspeed_config", str(config), "--num-experts", "8"], 2)
    assert not moe_selection.is_mlm_moe(ds.model)
    assert (ds.model.topk, ds.model.expert_interval) == (1, 2)
    assert model_experts(ds.model) == (1, 8, 1, 8)
    rc, out, err = dry_run(SMALL + ["--deepspeed", "--deepspeed_config", str(config), "--num-experts", "8"], 2)
    assert rc == 0, err
    assert "flags read as Megatron-DeepSpeed's" in out and "mixture of experts: DeepSpeed-MoE" in out, out
    assert "mixture of experts: 2 of 4 layers (every 2), 8 experts, top-1, EP 1" in out, out
    rc, out, err = dry_run(SMALL + ["--num-experts", "8"], 2)
    assert rc == 0, err
    assert "flags read as Megatron-LM's" in out and "mixture of experts: Megatron-LM's MoE" in out, out
    assert "mixture of experts (Megatron-LM's): 4 of 4 layers, 8 experts of ffn 256, top-2, EP 1" in out, out


def test_memory_suggestions_for_an_upstream_line_stay_megatron_lms():
    """An upstream line's --num-experts alone: the estimate's single changes name no DeepSpeed-MoE flag (a ZeRO
    change without --create-moe-param-group), so each one resolves to the same layer."""
    from megatron_ds.config.memory import estimate_memory, suggestions

    argv = ("--num-layers 8 --hidden-size 1024 --num-attention-heads 16 --seq-length 2048 --micro-batch-size 4 "
            "--global-batch-size 32 --mock-data --train-iters 10 --lr 1e-4 --bf16 --num-experts 16").split()
    lay = _layout(argv, 8)
    fixes = suggestions(lay, estimate_memory(lay).total * 0.99, limit=100)  # ZeRO saves ~2% (BF16_Optimizer)
    assert any(f.startswith("--zero-stage") for f in fixes), fixes
    for fix in fixes:
        assert "--create-moe-param-group" not in fix, fix
        assert moe_selection.is_mlm_moe(_layout(argv + fix.split(" (~")[0].split(), 8).model), fix


@pytest.mark.parametrize("extra, world, says", [
    ("--num-experts 4 --topk 2 --moe-router-topk 2", 1, "--moe-router-topk (Megatron-LM's MoE) and --topk"),
    ("--deepspeed --num-experts 4 --topk 2 --moe-router-topk 2", 1, "--moe-router-topk (Megatron-LM's MoE) and --topk"),
    ("--num-experts 4 --moe-grouped-gemm --create-moe-param-group", 1, "--create-moe-param-group (Megatron-DeepSpeed"),
    ("--moe-router-topk 2", 1, "without --num-experts"),
    ("--num-experts 4 --moe-router-topk 5", 1, "--moe-router-topk 5"),
    ("--num-experts 4 --moe-router-load-balancing-type quantile_balancing", 1, "quantile_balancing is not supported"),
    ("--num-experts 4 --moe-router-load-balancing-type sinkhorn --moe-aux-loss-coeff 0.01", 1,
     "sinkhorn balances by routing, alone and with --moe-aux-loss-coeff 0"),
    ("--num-experts 4 --moe-router-load-balancing-type sinkhorn aux_loss", 1, "sinkhorn balances by routing"),
    ("--num-experts 4 --moe-router-load-balancing-type aux_loss seq_aux_loss --moe-aux-loss-coeff 1 2 3", 1,
     "gives 3 values for 2 balancing types"),
    ("--num-experts 4 --moe-router-enable-expert-bias", 1, "needs --moe-router-score-function sigmoid"),
    ("--num-experts 4 --moe-router-topk 1", 1, "--moe-router-topk 1 with softmax scores needs --moe-router-pre-softmax"),
    ("--num-experts 4 --moe-pad-expert-input-to-capacity", 1, "needs --moe-expert-capacity-factor"),
    ("--num-experts 4 --moe-layer-freq [1,0]", 1, "gives 2 values for --num-layers 4"),
    ("--num-experts 4 --moe-layer-freq __import__('os')", 1, "neither an integer nor a list expression"),
    ("--num-experts 4 --moe-router-topk 2 --expert-model-parallel-size 2 --zero-stage 3 --deepspeed "
     "--no-pipeline-parallel", 2, "cannot run under ZeRO stage 3"),
    ("--num-experts 4 --moe-router-topk 2 --expert-model-parallel-size 3", 2, "must divide --num-experts 4"),
    ("--num-experts 4 --moe-router-topk 2 --expert-tensor-parallel-size 2", 2,
     "--expert-tensor-parallel-size 2 must divide --tensor-model-parallel-size 1 here"),
    # the grid: ETP x EP must tile TP x DP; the experts' ffn splits over ETP
    ("--num-experts 4 --moe-router-topk 2 --num-attention-heads 4 --tensor-model-parallel-size 4 --sequence-parallel "
     "--expert-tensor-parallel-size 2 --expert-model-parallel-size 4", 4,
     "and ETP 2 x EP 4 the 4 tensor x data parallel ranks of a pipeline stage"),
    ("--num-experts 4 --moe-router-topk 2 --num-attention-heads 4 --tensor-model-parallel-size 4 --sequence-parallel "
     "--expert-tensor-parallel-size 2 --moe-ffn-hidden-size 15", 4, "must divide the experts' ffn size 15"),
    ("--num-experts 4 --moe-router-topk 2 --num-attention-heads 4 --tensor-model-parallel-size 4 --sequence-parallel "
     "--expert-tensor-parallel-size 2 --bf16", 4, "would count expert shards 2 times"),
    ("--num-experts 4 --moe-router-topk 2 --tensor-model-parallel-size 2 --expert-tensor-parallel-size 2", 2,
     "--expert-tensor-parallel-size 2 needs --sequence-parallel"),
    # Megatron-LM's default ETP = TP needs sequence parallelism: both ways out named
    ("--num-experts 4 --tensor-model-parallel-size 2", 2, "without --expert-tensor-parallel-size splits the experts over "
     "TP (Megatron-LM's default ETP = TP), which needs --sequence-parallel: add --sequence-parallel (Megatron-LM's MoE "
     "requires it at TP > 1) or pass --expert-tensor-parallel-size 1 for whole experts"),
    ("--num-experts 4 --moe-router-topk 2 --tensor-model-parallel-size 2 --expert-model-parallel-size 2 "
     "--expert-tensor-parallel-size 1", 4, "--expert-model-parallel-size 2 at --tensor-model-parallel-size 2 needs --sequence-parallel"),
    ("--num-experts 4 --moe-router-topk 2 --tensor-model-parallel-size 2 --sequence-parallel "
     "--expert-tensor-parallel-size 1 --expert-model-parallel-size 4", 2,
     "and ETP 1 x EP 4 the 2 tensor x data parallel ranks"),
])
def test_bad_megatron_lm_moe_input_is_one_line(extra, world, says):
    rc, _, err = dry_run(SMALL + extra.split(), world)
    assert rc == 1 and len(err.strip().splitlines()) == 1 and says in err, err


@pytest.mark.parametrize("spec, expected", [
    (None, [1, 1, 1, 1, 1, 1]), ("1", [1, 1, 1, 1, 1, 1]), ("2", [1, 0, 1, 0, 1, 0]), ("4", [1, 0, 0, 0, 1, 0]),
    ("([0]+[1]*2)*2", [0, 1, 1, 0, 1, 1]), ("[0,1,0,1,1,1]", [0, 1, 0, 1, 1, 1]),
])
def test_layer_freq_is_megatron_lms(spec, expected):
    assert list(moe_selection.layer_freq(spec, 6)) == [bool(v) for v in expected]


def test_resolved_defaults_are_megatron_lms():
    m, ep, _ = moe_selection.resolve(ModelConfig(num_layers=2, hidden_size=8, num_attention_heads=2, seq_length=4,
                                           ffn_hidden_size=24, num_experts=(4,), moe_grouped_gemm=True),
                               ParallelConfig(), deepspeed=True)  # a Megatron-LM MoE flag chooses, whatever the line
    # transformer_config.py: moe_router_topk 2, aux_loss with coefficient 0, softmax, bias update rate 1e-3,
    # drop policy probs, allgather dispatch; the expert ffn is --ffn-hidden-size
    assert (m.moe_router_topk, m.moe_router_load_balancing_type, m.moe_aux_loss_coeff, m.moe_router_score_function,
            m.moe_router_bias_update_rate, m.moe_token_drop_policy, m.moe_token_dispatcher_type,
            m.moe_ffn_hidden_size, ep) == (2, ("aux_loss",), (0.0,), "softmax", 1e-3, "probs", "allgather", 24, 1)


@pytest.mark.parametrize("over", [dict(swiglu=True), dict(moe_shared_expert_intermediate_size=12,
                                                           moe_shared_expert_gate=True)])
def test_parameter_count_is_the_built_layers(over):
    m = resolve_model_config(ModelConfig(num_layers=2, hidden_size=8, num_attention_heads=2, seq_length=4,
                                         ffn_hidden_size=24, num_experts=(4,), moe_router_topk=2,
                                         moe_ffn_hidden_size=10, **over))
    layer = build_mlm_moe(m, 4, device=torch.device("meta"))
    per_rank, experts, total, active = dataclasses.astuple(moe_layer_params(m, 4, tp=1, ep=1))
    assert per_rank == total == sum(p.numel() for p in layer.parameters())
    assert experts == sum(p.numel() for p in layer.experts.parameters())
    one_expert = experts // 4
    assert active == total - 2 * one_expert


@pytest.mark.parametrize("tp, etp, expected", [(2, "1", 1), (4, "2", 2), (2, None, 4)],
                         ids=["tp2_whole", "tp4_etp2", "tp2_default"])
def test_relayout_keeps_the_lines_expert_tensor_parallel_rule(tp, etp, expected):
    """The memory estimate's twice-wider TP suggestion for Megatron-LM's MoE with sequence parallelism on 4 x TP
    ranks: whole experts stay whole, an ETP below TP stays, and ETP = TP by default follows TP; the suggested line
    resolves to the layout it was estimated with."""
    from megatron_ds.config.memory import _candidates

    argv = SMALL + ["--num-attention-heads", "8", "--num-experts", "4", "--tensor-model-parallel-size", str(tp),
                    "--sequence-parallel", "--expert-model-parallel-size", "2"] + (
        ["--expert-tensor-parallel-size", etp] if etp else [])
    lay = _layout(argv, 4 * tp)
    flag, wider = next((f, c) for f, c in _candidates(lay) if f.startswith(f"--tensor-model-parallel-size {2 * tp}"))
    assert flag == f"--tensor-model-parallel-size {2 * tp} --expert-tensor-parallel-size {expected}"
    again = _layout(argv + flag.split(), 4 * tp)
    assert (again.tp, again.etp, again.stages) == (2 * tp, expected, wider.stages) and wider.etp == expected
