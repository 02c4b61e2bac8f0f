"""The MoE layer (megatron_ds/model/moe_layer.py, model/transformer.py) in one process.

- Token dropping and routing equal DeepSpeed's gating on the same inputs: an independent
  transcription of deepspeed/moe/sharded_moe.py (``_capacity``, ``top1gating`` with random token
  selection, ``top2gating`` without second-expert sampling, the no-drop capacity, the auxiliary loss)
  computes which routes survive, the layer's output (each kept route's expert output times its gate)
  and l_aux from the layer's own gate and expert weights; the layer's output, l_aux and reported drop
  fraction must match.
- Parameter names are Megatron-DeepSpeed's (mlp.deepspeed_moe.gate.wg, ...experts.deepspeed_experts.N,
  the residual MoE's mlp.mlp and mlp.coefficient); experts start different.
- Activation recompute runs a layer's forward twice but the auxiliary loss counts once: loss and
  gradients with recompute equal those without.
- The MoE layers are those upstream's get_num_experts_per_layer names.

Tolerances: the transcription computes the same fp32 products in another order (einsum-free sums
over k routes), 1e-6 relative; the recompute comparison reruns identical kernels (exact up to 1e-7).
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megatron_ds.config.layout import resolve_model_config
from megatron_ds.config.schema import ModelConfig
from megatron_ds.families.gpt.gpt_model import build_sequential_gpt
from megatron_ds.model.language_model import reported_names
from megatron_ds.model.loss_report import LossReport
from megatron_ds.model.moe_layer import experts_per_layer
from megatron_ds.model.transformer import ParallelTransformerLayer

H, E = 16, 4
_BASE = dict(num_layers=2, hidden_size=H, num_attention_heads=2, seq_length=8, max_position_embeddings=8,
             hidden_dropout=0.0, attention_dropout=0.0, num_experts=(E,), expert_interval=1)


def _cfg(**over):
    return resolve_model_config(ModelConfig(**{**_BASE, **over}))


def _capacity(tokens, experts, factor, min_capacity):
    """deepspeed/moe/sharded_moe.py _capacity: ceil(tokens / experts * factor), at least min_capacity."""
    return max(math.ceil(tokens / experts * factor), min_capacity)


def _reference_routes(logits, k, factor, min_capacity, drop, uniform=None):
    """[(token, expert, gate weight)] of the routes DeepSpeed keeps, and l_aux (a transcription of
    top1gating / top2gating, written with loops over tokens)."""
    s, e = logits.shape
    gates = F.softmax(logits, dim=1)
    first = gates.argmax(dim=1).tolist()
    me = gates.mean(dim=0)
    ce = torch.bincount(torch.tensor(first), minlength=e).float() / s
    if k == 1:
        l_aux = (me * ce).sum() * e
        capacity = _capacity(s, e, factor, min_capacity) if drop else None
        kept = []
        for expert in range(e):
            tokens = [t for t in range(s) if first[t] == expert]
            if capacity is not None:  # random token selection: the `capacity` highest uniform draws
                tokens = sorted(tokens, key=lambda t: -float(uniform[t, expert]))[:capacity]
            kept += [(t, expert, float(gates[t, expert])) for t in tokens]
        return kept, l_aux
    second = logits.masked_fill(F.one_hot(torch.tensor(first), e).bool(), float("-inf")).argmax(dim=1).tolist()
    l_aux = (me * ce).mean() * e * e
    capacity = _capacity(s, e, 2 * factor, min_capacity) if drop else s * 2
    # positions in an expert's buffer: every first choice (in token order), then the second choices
    fill = [0] * e
    slot1, slot2 = [], []
    for t in range(s):
        slot1.append(fill[first[t]])
        fill[first[t]] += 1
    for t in range(s):
        slot2.append(fill[second[t]])
        fill[second[t]] += 1
    kept = []
    for t in range(s):
        keep1, keep2 = slot1[t] < capacity, slot2[t] < capacity
        g1 = float(gates[t, first[t]]) if keep1 else 0.0
        g2 = float(gates[t, second[t]]) if keep2 else 0.0
        denom = max(g1 + g2, torch.finfo(torch.float32).eps)
        if keep1:
            kept.append((t, first[t], g1 / denom))
        if keep2:
            kept.append((t, second[t], g2 / denom))
    return kept, l_aux


@pytest.mark.parametrize("k,factor,drop", [(1, 1.0, True), (2, 1.0, True), (2, 0.5, True), (1, 1.0, False)])
def test_routing_and_dropping_equal_deepspeeds_gating(k, factor, drop):
    torch.manual_seed(0)
    cfg = _cfg(topk=k, moe_train_capacity_factor=factor, moe_min_capacity=2, disable_moe_token_dropping=not drop,
               disable_moe_top2_2nd_expert_sampling=True)
    layer = ParallelTransformerLayer(cfg, 1, num_experts=E)
    moe = layer.mlp
    # skewed inputs, so that some experts overflow their capacity
    x = torch.randn(24, 1, H) + 2.0 * torch.randn(1, 1, H)
    torch.manual_seed(7)
    with torch.no_grad():
        out, l_aux, _ = moe(x)
    reported = float(layer.drops.last)  # what the layer reports as the drop fraction

    tokens = x.reshape(-1, H)
    logits = tokens.float() @ moe.deepspeed_moe.gate.wg.weight.detach().float().t()
    torch.manual_seed(7)  # top-1's random token selection draws uniform [tokens, experts] first
    uniform = torch.rand(tokens.shape[0], E) if k == 1 else None
    kept, ref_l_aux = _reference_routes(logits, k, factor, 2, drop, uniform)
    experts = moe.deepspeed_moe.experts.deepspeed_experts
    expected = torch.zeros_like(tokens)
    with torch.no_grad():
        for t, e, w in kept:
            expected[t] += w * experts[e](tokens[t:t + 1])[0][0]
    routes = tokens.shape[0] * k
    assert reported == pytest.approx(1 - len(kept) / routes, abs=1e-7)  # fp32 division
    if drop and factor < 1:
        assert len(kept) < routes  # the case exercises dropping
    assert out.reshape(-1, H) == pytest.approx(expected, rel=1e-6, abs=1e-6)
    assert float(l_aux) == pytest.approx(float(ref_l_aux), rel=1e-6)


def test_parameter_names_are_megatron_deepspeeds():
    layer = ParallelTransformerLayer(_cfg(mlp_type="residual"), 2, num_experts=E)
    names = {n for n, _ in layer.named_parameters() if n.startswith("mlp.")}
    expected = {"mlp.deepspeed_moe.gate.wg.weight", "mlp.coefficient.weight", "mlp.coefficient.bias"}
    for prefix in ["mlp.mlp."] + [f"mlp.deepspeed_moe.experts.deepspeed_experts.{i}." for i in range(E)]:
        expected |= {prefix + p for p in ("dense_h_to_4h.weight", "dense_h_to_4h.bias", "dense_4h_to_h.weight",
                                          "dense_4h_to_h.bias")}
    assert names == expected
    experts = layer.mlp.deepspeed_moe.experts.deepspeed_experts
    assert not torch.equal(experts[0].dense_h_to_4h.weight, experts[1].dense_h_to_4h.weight)
    # expert parallel rank 1 of 2 holds global experts 2 and 3: the same weights as here
    torch.manual_seed(123)
    whole = ParallelTransformerLayer(_cfg(), 2, num_experts=E)
    torch.manual_seed(123)
    half = ParallelTransformerLayer(_cfg(), 2, num_experts=E, ep_size=2, ep_rank=1)
    for j in range(2):
        a = half.mlp.deepspeed_moe.experts.deepspeed_experts[j].state_dict()
        b = whole.mlp.deepspeed_moe.experts.deepspeed_experts[2 + j].state_dict()
        assert all(torch.equal(a[key], b[key]) for key in a)


def _loss_and_grads(interval):
    cfg = _cfg(topk=2, disable_moe_top2_2nd_expert_sampling=True, expert_interval=2, num_layers=4,
               moe_loss_coeff=1.0)
    report = LossReport(reported_names(True))
    model = build_sequential_gpt(cfg, padded_vocab_size=32, seed=5, loss_report=report,
                                 activation_checkpoint_interval=interval)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 32, (2, 8), generator=g)
    loss = model.loss_fn(model((tokens, torch.arange(8).expand(2, 8))), (tokens, torch.ones(2, 8)))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return float(loss.detach()), report.reduce(torch.device("cpu")), grads


def test_recompute_counts_the_auxiliary_loss_once():
    loss, reported, grads = _loss_and_grads(0)
    loss_rc, reported_rc, grads_rc = _loss_and_grads(1)
    assert reported["moe loss"] > 0.5  # coefficient 1: two MoE layers' l_aux, each about 1
    assert loss == pytest.approx(reported["lm loss"] + reported["moe loss"], rel=1e-6)
    assert (loss_rc, reported_rc) == (pytest.approx(loss, rel=1e-7), pytest.approx(reported, rel=1e-7))
    for name, grad in grads.items():
        assert grads_rc[name] == pytest.approx(grad, rel=1e-6, abs=1e-9), name
    # the gate learns from the auxiliary loss too
    assert grads["2.mlp.deepspeed_moe.gate.wg.weight"].abs().sum() > 0


def test_moe_layers_are_upstreams():
    """megatron/model/transformer.py get_num_experts_per_layer: layer n (1-based) is MoE when
    n % interval == 0; a list gives one count per MoE layer."""
    assert experts_per_layer([8], 4, 2) == [1, 8, 1, 8]
    assert experts_per_layer([4, 8], 4, 2) == [1, 4, 1, 8]
    assert experts_per_layer([4], 3, 1) == [4, 4, 4]
    with pytest.raises(ValueError):
        experts_per_layer([4, 8, 16], 4, 2)
