"""The pure parts of MoE checkpoints against DeepSpeed's own code, on synthetic tensors.

- file names equal DeepSpeed's ``_get_expert_ckpt_name`` / ``_get_optimizer_ckpt_name``
  (deepspeedai/DeepSpeed ``deepspeed/runtime/engine.py``);
- expert files written from a global (EP 1) state with our names are what DeepSpeed's own
  ``load_moe_state_dict`` reads into an EP 2 model on each expert parallel rank, and that is what
  ``expert_files.to_local`` says the rank holds; regrouping between EP sizes through them agrees with it;
- tensor parallel rules: experts are whole on every TP rank unless
  --enable-expert-tensor-parallelism, then split like the dense MLP;
- DeepSpeed-MoE's Mixtral export names, and refusals of what Mixtral cannot express, one line each; Megatron-LM's
  MoE names round-trip through every HF MoE class's layout (the hub's and transformers 5's fused one).
"""
from __future__ import annotations

import dataclasses
import os
import types

import pytest
import torch

from megatron_ds.checkpoint import expert_files
from megatron_ds.checkpoint import tp as tp_rules
from megatron_ds.config.schema import ModelConfig
from megatron_ds.errors import ConfigError
from megatron_ds.families.gpt import mixtral_hf as mixtral
from megatron_ds.families.gpt.gpt_family import GPT

H, F, E = 8, 6, 4  # hidden, expert ffn (SwiGLU: dense_h_to_4h has 2F rows), experts


def _expert(i: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return {"dense_h_to_4h.weight": torch.randn(2 * F, H, generator=g),
            "dense_4h_to_h.weight": torch.randn(H, F, generator=g)}


def _global_state(prefix: str = "3.mlp") -> dict[str, torch.Tensor]:
    out = {f"{prefix}.deepspeed_moe.gate.wg.weight": torch.randn(E, H)}
    for e in range(E):
        out.update({f"{prefix}{expert_files.EXPERTS_INFIX}{e}.{k}": v for k, v in _expert(e).items()})
    return out


def _expert_file_name(moe_layer: int, expert: int, mp_rank: int) -> str:
    """DeepSpeed's ``_get_expert_ckpt_name`` (the per-layer form, ``layer_id >= 0``)."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    return os.path.basename(DeepSpeedEngine._get_expert_ckpt_name("d", moe_layer, expert, "t",
                                                                  checkpoint_mp_rank=mp_rank))


def test_file_names_are_deepspeeds():
    from deepspeed.runtime.engine import DeepSpeedEngine

    assert expert_files.parse_expert_file(_expert_file_name(1, 5, 3)) == (1, 5, 3)
    engine = types.SimpleNamespace(checkpoint_mp_rank=2)
    name = os.path.basename(DeepSpeedEngine._get_optimizer_ckpt_name(engine, "d", "t", 1))
    assert expert_files.parse_expert_optim_file(name) == (1, 2)


class _Expert(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.dense_h_to_4h = torch.nn.Linear(H, 2 * F, bias=False)
        self.dense_4h_to_h = torch.nn.Linear(F, H, bias=False)


class _Layer(torch.nn.Module):
    def __init__(self, ep_size: int):
        super().__init__()
        from deepspeed.moe.layer import MoE

        self.mlp = MoE(H, _Expert(), num_experts=E, ep_size=ep_size, k=2)


@pytest.mark.parametrize("ep_size", [1, 2, 4])
def test_deepspeed_loads_what_to_local_says(tmp_path, monkeypatch, ep_size):
    """DeepSpeed's loader, at each expert parallel rank, reads our expert files into exactly
    ``to_local``'s tensors (global ids -> the rank's local ids as DeepSpeed numbers them)."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.utils import groups

    model = torch.nn.ModuleDict({"3": _Layer(ep_size)})  # named like a PipelineModule's layer "3"
    full = _global_state()
    tag = "global_step1"
    os.makedirs(tmp_path / tag)
    for e in range(E):  # what _save_moe_checkpoint writes: one file per global expert, keys with the global id
        torch.save({k: v for k, v in full.items() if expert_files.expert_id(k) == e},
                   tmp_path / tag / _expert_file_name(0, e, 0))
    for rank in range(ep_size):
        monkeypatch.setattr(groups, "_get_expert_parallel_rank", lambda name, r=rank: r)
        loaded = {}
        DeepSpeedEngine.load_moe_state_dict(str(tmp_path), tag, loaded, old_moe_load=False, model=model,
                                            checkpoint_mp_rank=0)
        ours = {k: v for k, v in expert_files.to_local(full, rank, ep_size).items()
                if expert_files.expert_id(k) is not None}
        assert sorted(loaded) == sorted(ours)
        assert all(torch.equal(loaded[k], ours[k]) for k in ours)
        # and the names are the model's own parameter names on that rank
        own = {k for k in model.state_dict() if expert_files.expert_id(k) is not None}
        assert set(ours) == own


def _regroup(per_rank: list[dict], ep_size: int) -> list[dict]:
    """The states of ``len(per_rank)`` expert parallel ranks (local ids) as the states of ``ep_size`` ranks."""
    full: dict = {}
    for rank, state in enumerate(per_rank):
        full.update(expert_files.to_global(state, rank))
    return [expert_files.to_local(full, r, ep_size) for r in range(ep_size)]


def test_regroup_between_ep_sizes():
    full = _global_state()
    per_rank = {n: [expert_files.to_local(full, r, n) for r in range(n)] for n in (1, 2, 4)}
    for src in (1, 2, 4):
        for dst in (1, 2, 4):
            out = _regroup(per_rank[src], dst)
            assert [sorted(s) for s in out] == [sorted(s) for s in per_rank[dst]]
            assert all(torch.equal(a[k], b[k]) for a, b in zip(out, per_rank[dst]) for k in a)
    assert expert_files.to_global(per_rank[2][1], 1) == {k: v for k, v in full.items()
                                                         if expert_files.expert_id(k) in (2, 3)
                                                         or expert_files.expert_id(k) is None}
    with pytest.raises(ValueError, match="do not divide over expert parallel size 3"):
        expert_files.to_local(full, 0, 3)


def _model(**kw) -> ModelConfig:
    base = dict(num_layers=2, hidden_size=H, num_attention_heads=2, ffn_hidden_size=F, seq_length=8,
                max_position_embeddings=8, position_embedding_type="rope", normalization="rmsnorm", swiglu=True,
                add_bias_linear=False, num_experts=(E,), expert_interval=1, topk=2,
                disable_moe_token_dropping=True, disable_moe_top2_2nd_expert_sampling=True)
    return ModelConfig(**{**base, **kw})


@pytest.mark.parametrize("expert_tp", [False, True])
def test_expert_tensor_parallel_rule(expert_tp):
    m = _model(enable_expert_tensor_parallelism=expert_tp)
    full = _global_state()
    up = f"3.mlp{expert_files.EXPERTS_INFIX}1.dense_h_to_4h.weight"
    down = f"3.mlp{expert_files.EXPERTS_INFIX}1.dense_4h_to_h.weight"
    shards_up = [tp_rules.split(up, full[up], 2, r, m, GPT) for r in range(2)]
    shards_down = [tp_rules.split(down, full[down], 2, r, m, GPT) for r in range(2)]
    if expert_tp:  # as the dense SwiGLU MLP: [gate_r; up_r] rows, and the down projection's columns
        gate, upper = full[up].chunk(2)
        assert torch.equal(shards_up[1], torch.cat([gate[F // 2:], upper[F // 2:]]))
        assert torch.equal(shards_down[0], full[down][:, :F // 2])
    else:
        assert all(torch.equal(s, full[up]) for s in shards_up)
        assert all(torch.equal(s, full[down]) for s in shards_down)
    assert torch.equal(tp_rules.merge(up, shards_up, m, GPT), full[up])
    assert torch.equal(tp_rules.merge(down, shards_down, m, GPT), full[down])
    gate_name = "3.mlp.deepspeed_moe.gate.wg.weight"
    assert tp_rules.partition(gate_name, m, GPT) is None
    # PR-MoE's residual MLP is a dense MLP: split whatever the expert flag says
    assert tp_rules.partition("3.mlp.mlp.dense_h_to_4h.weight", m, GPT) == (0, 2)


def test_mixtral_export_names():
    """DeepSpeed-MoE's experts as the hub's Mixtral layout (block_sparse_moe.experts.E.w1/w3 = the SwiGLU gate/up
    halves of dense_h_to_4h, w2 = dense_4h_to_h), every tensor placed."""
    local = {k.split(".", 1)[1]: v for k, v in _global_state().items()}  # without the layer prefix
    hf = mixtral.moe_to_hf(0, local)
    p = "model.layers.0.block_sparse_moe."
    assert set(hf) == {p + "gate.weight"} | {f"{p}experts.{e}.w{j}.weight" for e in range(E) for j in (1, 2, 3)}
    assert torch.equal(hf[p + "gate.weight"], local["mlp.deepspeed_moe.gate.wg.weight"])
    for e in range(E):
        assert torch.equal(hf[f"{p}experts.{e}.w1.weight"], _expert(e)["dense_h_to_4h.weight"][:F])  # gate half
        assert torch.equal(hf[f"{p}experts.{e}.w3.weight"], _expert(e)["dense_h_to_4h.weight"][F:])  # up half
        assert torch.equal(hf[f"{p}experts.{e}.w2.weight"], _expert(e)["dense_4h_to_h.weight"])
    with pytest.raises(ConfigError, match="mlp.coefficient.weight has no place in MixtralForCausalLM"):
        mixtral.moe_to_hf(0, {**local, "mlp.coefficient.weight": torch.zeros(2, H)})


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"])
def test_megatron_lm_moe_names_round_trip(arch):
    """Megatron-LM's stacked experts ([E, 2F, H] of [gate; up], [E, H, F]) to the hub's per-expert layout and back,
    and from transformers 5's fused layout (gate_up_proj [E, 2F, H] with the gate rows first, down_proj [E, H, F]:
    Qwen2MoeExperts / MixtralExperts), which is ours as it is."""
    from megatron_ds.families.gpt import moe_hf

    g = torch.Generator().manual_seed(0)
    ours = {moe_hf.ROUTER: torch.randn(E, H, generator=g), moe_hf.FC1: torch.randn(E, 2 * F, H, generator=g),
            moe_hf.FC2: torch.randn(E, H, F, generator=g)}
    if arch in ("qwen2_moe", "deepseek_v3"):
        ours.update({moe_hf.SHARED_FC1: torch.randn(2 * F, H, generator=g), moe_hf.SHARED_FC2: torch.randn(H, F,
                                                                                                          generator=g)})
    if arch == "qwen2_moe":
        ours[moe_hf.SHARED_GATE] = torch.randn(1, H, generator=g)
    if arch == "deepseek_v3":
        ours[moe_hf.EXPERT_BIAS] = torch.randn(E, generator=g)
    hub, names = moe_hf.moe_to_hf(arch, 3, ours), moe_hf.hf_names(arch, 3)
    up = "w3" if arch == "mixtral" else "up_proj"
    assert torch.equal(hub[f"{names.experts}2.{up}.weight"], ours[moe_hf.FC1][2, F:])
    back = moe_hf.moe_from_hf(arch, 3, E, hub.get)
    assert sorted(back) == sorted(ours) and all(torch.equal(back[k], ours[k]) for k in ours)
    p = "model.layers.3.mlp."
    fused = {p + "gate.weight": ours[moe_hf.ROUTER], p + "experts.gate_up_proj": ours[moe_hf.FC1],
             p + "experts.down_proj": ours[moe_hf.FC2],
             **{k: v for k, v in hub.items() if not k.startswith(names.experts) and k != names.router}}
    back = moe_hf.moe_from_hf(arch, 3, E, fused.get)
    assert sorted(back) == sorted(ours) and all(torch.equal(back[k], ours[k]) for k in ours)
    with pytest.raises(ConfigError, match="has no place in"):
        moe_hf.moe_to_hf(arch, 3, {**ours, "mlp.linear_fc3.weight": torch.zeros(1)})


@pytest.mark.parametrize("change,reason", [
    (dict(add_bias_linear=True), "biases"),
    (dict(swiglu=False), "GeLU experts"),
    (dict(mlp_type="residual"), "--mlp-type residual"),
    (dict(expert_interval=2, num_layers=2), "--expert-interval 2"),
    (dict(num_experts=(4, 1)), "--num-experts 4 1 (Mixtral has the same experts on every layer; a layer with 1"),
    (dict(topk=1), "--topk 1"),
    (dict(disable_moe_token_dropping=False), "token dropping"),
    (dict(disable_moe_top2_2nd_expert_sampling=False), "second-expert sampling"),
    (dict(normalization="layernorm"), "--normalization layernorm"),
])
def test_mixtral_refusals_name_the_reason(change, reason):
    from megatron_ds.families.gpt import gpt_hf as hf

    assert hf.choose_architecture(_model()) == hf.MIXTRAL
    with pytest.raises(ConfigError) as info:
        hf.choose_architecture(dataclasses.replace(_model(), **change))
    message = str(info.value)
    assert "\n" not in message and reason in message and message.startswith(
        "a mixture-of-experts model exports as MixtralForCausalLM, which cannot express")


@pytest.mark.parametrize("tp,dp,ep,expert_tp", [(1, 4, 2, False), (2, 2, 2, False), (2, 2, 4, False),
                                                (2, 4, 2, True), (1, 2, 1, False)])
def test_expert_parallel_rank_of_other_ranks(tp, dp, ep, expert_tp):
    """The placement the ZeRO shard reader assumes is the one the model is built with
    (``ParallelState.expert_parallel_rank``, which training checks against DeepSpeed's groups)."""
    from megatron_ds.parallel.groups import ParallelState

    pp = 2
    for rank in range(tp * dp * pp):
        stage_rank = rank % (tp * dp)  # our topology: pipe-major, then data, then tensor
        state = types.SimpleNamespace(rank=rank, world_size=tp * dp * pp, pp_size=pp, sp_size=1, dp_size=dp,
                                      dp_rank=stage_rank // tp)
        want = ParallelState.expert_parallel_rank(state, ep, expert_tp)
        got = expert_files.expert_parallel_rank(stage_rank // tp, stage_rank % tp, tp=tp, ep=ep, expert_tp=expert_tp)
        assert got == want


def test_mixtral_config_imports_as_megatron_lm_moe():
    """Mixtral's router (softmax, top k, renormalized) is Megatron-LM's softmax over the top-k logits: its layer
    without --moe-router-pre-softmax, on every layer. A top-1 Mixtral (weight 1) is refused: Megatron-LM's
    TransformerConfig refuses top-1 softmax routing without pre-softmax (its router would get no gradient)."""
    from megatron_ds.config.moe_selection import is_mlm_moe
    from megatron_ds.families.gpt import gpt_hf as hf

    transformers = pytest.importorskip("transformers")
    d = transformers.MixtralConfig(vocab_size=64, hidden_size=H, intermediate_size=F, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, num_local_experts=E,
                                   num_experts_per_tok=2).to_dict()
    arch, m = hf.model_config_from_hf(d)
    assert arch == hf.MIXTRAL and is_mlm_moe(m) and m.num_experts == (E,) and m.moe_router_topk == 2
    assert m.moe_layer_freq is None and not m.moe_router_pre_softmax and m.moe_ffn_hidden_size == F
    assert m.moe_expert_capacity_factor is None and not m.add_bias_linear
    assert hf.choose_architecture(m) == hf.MIXTRAL  # exports back as Mixtral
    with pytest.raises(ConfigError, match="num_experts_per_tok 1 with renormalized weights"):
        hf.model_config_from_hf({**d, "num_experts_per_tok": 1})
