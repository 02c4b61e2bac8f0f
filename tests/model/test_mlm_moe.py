"""Megatron-LM's MoE layer (megatron_ds/model/mlm_moe.py) in one process, against references written here.

- Dropless: the layer's output (and its input/weight gradients) equal a dense per-token loop: each token
  through its top-k experts' MLPs (picked from the router's logits as Megatron-LM's
  topk_routing_with_score_function defines: softmax of the top-k logits, softmax before the top-k, sigmoid
  normalised over the k, the scaling factor), weighted and summed, plus the (gated) shared expert.
- With a capacity factor the routes that survive are the reference's: per expert, its tokens ordered by
  probability (or position), the first ceil(tokens x k / experts x factor) kept (Megatron-LM's
  apply_router_token_dropping); padding gives every expert exactly its capacity.
- The auxiliary losses equal the papers' formulas on fixed logits, written with loops: Switch Transformer's
  E x sum_i f_i P_i (f_i the fraction of the k x T routes to expert i, P_i the mean router probability), the
  sequence-level version averaged over sequences (DeepSeek-V2), ST-MoE's z-loss mean_t (log sum_i e^{x_ti})^2,
  and DeepSeek-V3's bias update b_i += u x sign(mean load - load_i).

Tolerances: fp32, the same products summed in another order: 1e-5 relative.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megatron_ds.config.layout import resolve_model_config
from megatron_ds.config.schema import ModelConfig
from megatron_ds.model import mlm_moe
from megatron_ds.model.mlm_moe import drop_tokens, update_expert_bias

H, E, S, B = 16, 4, 6, 2
_BASE = dict(num_layers=2, hidden_size=H, num_attention_heads=2, seq_length=S, max_position_embeddings=S,
             hidden_dropout=0.0, attention_dropout=0.0, num_experts=(E,), ffn_hidden_size=24,
             moe_router_topk=2)


def _cfg(**over):
    return resolve_model_config(ModelConfig(**{**_BASE, **over}))


def _layer(seed=0, **over):
    torch.manual_seed(seed)
    layer = mlm_moe.build_mlm_moe(_cfg(**over), E)
    with torch.no_grad():  # a router that separates the experts clearly
        layer.router.weight.normal_(0, 1.0)
    return layer


def _act(cfg, x):
    if cfg.swiglu:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
    return F.gelu(x)


def _reference(layer, cfg, x):
    """The layer's output computed token by token (module docstring)."""
    tokens = x.reshape(-1, H)
    w = layer.router.weight
    out = []
    for t in tokens:
        logits = w @ t
        order = logits.detach()
        k = cfg.moe_router_topk
        if cfg.moe_router_score_function == "sigmoid":
            scores = torch.sigmoid(logits)
            top = sorted(range(E), key=lambda e: -float(order[e]))[:k]
            weights = [scores[e] / sum(scores[j] for j in top) for e in top]
        elif cfg.moe_router_pre_softmax:
            probs = torch.softmax(logits, 0)
            top = sorted(range(E), key=lambda e: -float(order[e]))[:k]
            weights = [probs[e] for e in top]
        else:
            top = sorted(range(E), key=lambda e: -float(order[e]))[:k]
            z = sum(torch.exp(logits[j]) for j in top)
            weights = [torch.exp(logits[e]) / z for e in top]
        y = torch.zeros(H)
        for e, p in zip(top, weights):
            fc1, fc2 = layer.experts.linear_fc1, layer.experts.linear_fc2
            b1, b2 = (0.0, 0.0) if fc1.bias is None else (fc1.bias[e], fc2.bias[e])
            # Megatron-LM's grouped MLPs: the probability scales fc2's bias too (GroupedMLP._apply_bias)
            y = y + p * (cfg.moe_router_topk_scaling_factor or 1.0) * (
                fc2.weight[e] @ _act(cfg, fc1.weight[e] @ t + b1) + b2)
        if layer.shared_experts is not None:
            se = layer.shared_experts
            s = se.linear_fc2(_act(cfg, se.linear_fc1(t)))
            if se.gate_weight is not None:
                s = s * torch.sigmoid(se.gate_weight[0] @ t)
            y = y + s
        out.append(y)
    return torch.stack(out).view_as(x)


@pytest.mark.parametrize("over", [
    dict(swiglu=True, add_bias_linear=False),
    dict(add_bias_linear=False, moe_router_pre_softmax=True, moe_router_topk=3),
    dict(swiglu=True, add_bias_linear=False, moe_router_score_function="sigmoid",
         moe_router_topk_scaling_factor=2.5),
    dict(swiglu=True, add_bias_linear=False, moe_shared_expert_intermediate_size=20, moe_shared_expert_gate=True),
    dict(moe_shared_expert_intermediate_size=20),  # GeLU, with linear biases
])
def test_dropless_layer_equals_dense_per_token_reference(over):
    layer = _layer(**over)
    cfg = _cfg(**over)
    x = torch.randn(S, B, H, requires_grad=True)
    out, aux = layer(x)
    x_ref = x.detach().clone().requires_grad_()
    ref = _reference(layer, cfg, x_ref)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    assert float(aux) == 0.0  # no coefficient given: Megatron-LM's --moe-aux-loss-coeff defaults to 0
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, [x, *layer.parameters()], g)
    ref_grads = torch.autograd.grad(ref, [x_ref, *layer.parameters()], g, allow_unused=True)
    for name, a, b in zip(["input", *(n for n, _ in layer.named_parameters())], grads, ref_grads):
        torch.testing.assert_close(a, torch.zeros_like(a) if b is None else b, rtol=1e-5, atol=1e-6, msg=name)


def test_expert_bias_picks_but_does_not_weigh():
    """The expert bias changes which experts a token goes to, not the weights it gets (DeepSeek-V3 eq. 16)."""
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    probs, chosen = mlm_moe.topk_routing(logits, 2, score_function="sigmoid",
                                         expert_bias=torch.tensor([5.0, 0.0, 0.0, 0.0]))
    assert chosen[0].tolist() == [True, False, False, True]
    s = torch.sigmoid(logits[0])
    torch.testing.assert_close(probs[0], torch.stack([s[0], 0 * s[1], 0 * s[2], s[3]]) / (s[0] + s[3]))


def _reference_keep(probs, chosen, k, factor, policy):
    tokens, experts = probs.shape
    cap = math.ceil(tokens * k / experts * factor)
    keep = torch.zeros_like(chosen)
    for e in range(experts):
        mine = [t for t in range(tokens) if chosen[t, e]]
        if policy == "probs":  # every token competes by its probability (0 off its experts)
            ranked = sorted(range(tokens), key=lambda t: -float(probs[t, e].detach()))[:cap]
            mine = [t for t in ranked if chosen[t, e]]
        else:
            mine = mine[:cap]
        for t in mine:
            keep[t, e] = True
    return keep


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("factor", [0.5, 1.0])
def test_capacity_drops_the_references_tokens(policy, factor):
    torch.manual_seed(3)
    logits = torch.randn(24, E) + torch.tensor([2.0, 0.0, 0.0, -1.0])  # expert 0 overloaded
    probs, chosen = mlm_moe.topk_routing(logits, 2)
    kept_probs, kept = drop_tokens(probs, chosen, 2, factor, policy)
    ref = _reference_keep(probs, chosen, 2, factor, policy)
    assert torch.equal(kept, ref)
    assert (~ref).logical_and(chosen).any()  # something was dropped
    torch.testing.assert_close(kept_probs, probs * ref)
    padded_probs, padded = drop_tokens(probs, chosen, 2, factor, policy, pad=True)
    cap = math.ceil(24 * 2 / E * factor)
    assert padded.sum(0).tolist() == [cap] * E
    assert torch.equal(padded & chosen, ref)


def test_layer_with_capacity_computes_only_the_kept_routes():
    layer = _layer(swiglu=True, add_bias_linear=False, moe_expert_capacity_factor=0.5)
    x = torch.randn(S, B, H)
    out, _ = layer(x)
    dropless = _layer(swiglu=True, add_bias_linear=False)
    dropless.load_state_dict(layer.state_dict())
    logits = x.reshape(-1, H) @ layer.router.weight.t()
    probs, chosen = mlm_moe.topk_routing(logits, 2)
    keep = _reference_keep(probs, chosen, 2, 0.5, "probs")
    # the reference: each token through the experts it kept, with the weights the dropless routing gave it
    ref = torch.zeros(S * B, H)
    for t, token in enumerate(x.reshape(-1, H)):
        for e in range(E):
            if keep[t, e]:
                fc1, fc2 = layer.experts.linear_fc1.weight[e], layer.experts.linear_fc2.weight[e]
                ref[t] += probs[t, e] * (fc2 @ _act(_cfg(swiglu=True), fc1 @ token))
    torch.testing.assert_close(out.reshape(-1, H), ref, rtol=1e-5, atol=1e-6)
    assert float(layer.router.last["dropped"]) == pytest.approx(1 - keep.sum().item() / chosen.sum().item())


def _switch(logits, k):
    """Switch Transformer eq. 4 with k routes per token: E sum_i f_i P_i, loops over tokens."""
    tokens, experts = logits.shape
    probs = [[math.exp(v) / sum(math.exp(u) for u in row) for v in row] for row in logits.tolist()]
    f = [0.0] * experts
    p = [0.0] * experts
    for row in probs:
        for e in sorted(range(experts), key=lambda i: -row[i])[:k]:
            f[e] += 1 / (tokens * k)
        for e in range(experts):
            p[e] += row[e] / tokens
    return experts * sum(fi * pi for fi, pi in zip(f, p))


def test_aux_seq_aux_and_z_losses_equal_the_papers_formulas():
    torch.manual_seed(5)
    seq, batch, k = 5, 3, 2
    x = torch.randn(seq * batch, H)
    router = mlm_moe.TopKRouter(H, E, topk=k, init_std=1.0, aux={"aux_loss": 0.1, "seq_aux_loss": 0.2},
                                z_loss_coeff=0.3)
    _, _, loss = router(x, seq, batch)
    logits = (x @ router.weight.t()).detach()
    aux = _switch(logits, k)
    # tokens are [seq, batch]-ordered: sequence b is rows b, b + batch, ...
    seq_aux = sum(_switch(logits[b::batch], k) for b in range(batch)) / batch
    z = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits.tolist()) / len(logits)
    assert router.last["load_balancing_loss"].item() == pytest.approx(aux, rel=1e-5)
    assert router.last["seq_load_balancing_loss"].item() == pytest.approx(seq_aux, rel=1e-5)
    assert router.last["z_loss"].item() == pytest.approx(z, rel=1e-5)
    assert loss.item() == pytest.approx(0.1 * aux + 0.2 * seq_aux + 0.3 * z, rel=1e-5)
    router.eval()  # evaluation adds no auxiliary loss (Megatron-LM's router: training only)
    assert router(x, seq, batch)[2].item() == 0.0


def test_expert_bias_update_follows_deepseek_v3():
    torch.manual_seed(7)
    router = mlm_moe.TopKRouter(H, E, topk=1, init_std=1.0, score_function="sigmoid", expert_bias=True)
    model = torch.nn.ModuleDict({"r": router})
    x = torch.randn(40, H)
    bias = torch.tensor([0.1, -0.2, 0.0, 0.3])
    router.expert_bias.copy_(bias)
    loads = torch.zeros(E)
    for chunk in x.split(20):  # two micro-batches, one step
        router(chunk, 20, 1)
        scores = torch.sigmoid(chunk @ router.weight.t()) + bias
        for row in scores:
            loads[int(row.argmax())] += 1
    assert torch.equal(router.local_tokens_per_expert, loads)
    update_expert_bias(model, 0.01)
    expected = [b + 0.01 * (1 if c < loads.mean() else -1 if c > loads.mean() else 0)
                for b, c in zip(bias.tolist(), loads.tolist())]
    torch.testing.assert_close(router.expert_bias, torch.tensor(expected))
    assert router.local_tokens_per_expert.sum() == 0
    with torch.no_grad():  # a forward without grad (evaluation, recompute's first pass) counts nothing
        router(x, 40, 1)
    assert router.local_tokens_per_expert.sum() == 0
    router.to(torch.bfloat16)  # a bf16 engine casts buffers too: the bias returns to fp32, its small steps count
    router(x.to(torch.bfloat16), 40, 1)
    before = router.expert_bias.clone()
    update_expert_bias(model, 1e-4)
    assert router.expert_bias.dtype == torch.float32
    assert (router.expert_bias - before).abs().max().item() == pytest.approx(1e-4, rel=1e-3)


def test_parameter_names_are_megatron_lms():
    layer = _layer(swiglu=True, moe_shared_expert_intermediate_size=8, moe_shared_expert_gate=True,
                   moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    shapes = {n: tuple(t.shape) for n, t in layer.state_dict().items()}
    assert shapes == {
        "router.weight": (E, H), "router.expert_bias": (E,),
        "experts.linear_fc1.weight": (E, 48, H), "experts.linear_fc1.bias": (E, 48),
        "experts.linear_fc2.weight": (E, H, 24), "experts.linear_fc2.bias": (E, H),
        "shared_experts.linear_fc1.weight": (16, H), "shared_experts.linear_fc1.bias": (16,),
        "shared_experts.linear_fc2.weight": (H, 8), "shared_experts.linear_fc2.bias": (H,),
        "shared_experts.gate_weight": (1, H)}


def test_experts_do_not_depend_on_the_expert_parallel_rank():
    """Rank r of EP 2 holds global experts 2r, 2r+1 with the weights they have at EP 1 (checkpoints reshard by
    concatenating dimension 0)."""
    cfg = _cfg(swiglu=True)
    torch.manual_seed(0)
    whole = mlm_moe.GroupedExperts(cfg, range(E), 24, seed=11, params_dtype=torch.float32, device=None)
    for r in range(2):
        half = mlm_moe.GroupedExperts(cfg, range(2 * r, 2 * r + 2), 24, seed=11, params_dtype=torch.float32,
                                      device=None)
        assert torch.equal(half.linear_fc1.weight, whole.linear_fc1.weight[2 * r:2 * r + 2])
        assert torch.equal(half.linear_fc2.weight, whole.linear_fc2.weight[2 * r:2 * r + 2])


def test_grouped_gemm_path_equals_the_loop(monkeypatch):
    """The torch._grouped_mm call (what CUDA runs in bf16) on the CPU in fp32, forward only (torch's CPU kernel
    has no backward): the same products as the loop over experts, with experts that get no token."""
    torch.manual_seed(2)
    layer = mlm_moe._Stacked([1, 2, 3, 4], 16, 48, bias=True, std=0.5, params_dtype=torch.float32, device=None)
    with torch.no_grad():
        layer.bias.normal_()
    counts = [5, 0, 7, 4]
    x = torch.randn(sum(counts), 16)
    loop = mlm_moe.grouped_linear(x, counts, layer)
    monkeypatch.setattr(mlm_moe, "_grouped_mm_ok", lambda x, w: True)
    with torch.no_grad():
        grouped = mlm_moe.grouped_linear(x, counts, layer, grouped=True)
    torch.testing.assert_close(grouped, loop, rtol=1e-5, atol=1e-6)


def test_experts_without_routes_stay_in_the_graph():
    """An expert parallel rank that receives no routes (the expert bias can steer every token away from its
    experts) still returns an output that autograd reaches from the weights and the input: the dispatch's
    backward all-to-all then runs on it too (a detached empty output left the other ranks waiting there)."""
    layer = mlm_moe._Stacked([1, 2], 16, 8, bias=False, std=0.5, params_dtype=torch.float32, device=None)
    x = torch.zeros(0, 16, requires_grad=True)
    y = mlm_moe.grouped_linear(x, [0, 0], layer)
    assert y.shape == (0, 8) and y.requires_grad
    y.sum().backward()
    assert x.grad.shape == (0, 16) and layer.weight.grad is not None and not layer.weight.grad.any()


@pytest.mark.parametrize("flag", [False, True])
def test_only_moe_grouped_gemm_selects_the_grouped_kernel(monkeypatch, flag):
    """--moe-grouped-gemm is a speed choice, off by default (upstream's default too: SequentialMLP): where the
    grouped kernel could run (``_grouped_mm_ok`` forced, as on CUDA in bf16) the layer calls it only with the
    flag, and gives the loop's output either way."""
    calls = []
    real = torch._grouped_mm

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    layer = _layer(moe_grouped_gemm=flag)
    x = torch.randn(S, B, H)
    with torch.no_grad():
        loop, _ = layer(x)
        monkeypatch.setattr(mlm_moe, "_grouped_mm_ok", lambda x, w: True)
        monkeypatch.setattr(torch, "_grouped_mm", spy)
        out, _ = layer(x)
    assert len(calls) == (2 if flag else 0)  # fc1 and fc2
    torch.testing.assert_close(out, loop, rtol=1e-5, atol=1e-6)


def test_routing_report_reads_the_routers_choice():
    """The reported load is what the router chose (before capacity, which padding would make look balanced):
    max/mean and coefficient of variation of the top-k choices' counts; the dropped fraction of those routes."""
    from megatron_ds.model.loss_report import LossReport
    from megatron_ds.model.moe_layer import DROP_FRACTION

    layer = _layer(swiglu=True, moe_expert_capacity_factor=0.5, moe_pad_expert_input_to_capacity=True)
    x = torch.randn(S, B, H)
    layer(x)
    report = LossReport(mlm_moe.ROUTING_NAMES + (DROP_FRACTION,))
    mlm_moe.report_routing(report, layer)
    got = report.reduce(torch.device("cpu"))
    _, chosen = mlm_moe.topk_routing(x.reshape(-1, H) @ layer.router.weight.t(), 2)
    counts = [float(c) for c in chosen.sum(0)]
    mean = sum(counts) / E
    cv = math.sqrt(sum((c - mean) ** 2 for c in counts) / E) / mean
    assert got["tokens per expert max/mean"] == pytest.approx(max(counts) / mean)
    assert got["tokens per expert cv"] == pytest.approx(cv, rel=1e-5)
    cap = math.ceil(S * B * 2 / E * 0.5)
    kept = sum(min(c, cap) for c in counts)  # padding keeps each expert's routed tokens up to its capacity
    assert got[DROP_FRACTION] == pytest.approx(1 - kept / sum(counts), rel=1e-5)


def _sinkhorn_reference(cost, tol=1e-4):
    """Sinkhorn-Knopp written with loops: row factors r and column factors c of K = exp(cost) alternately set
    so that the rows of r_t K_tj c_j sum to 1/T, then its columns to 1/E, until c moves by less than ``tol`` on
    average (Megatron-LM's stopping rule; eps 1e-8 in each denominator as there)."""
    k = [[math.exp(float(v)) for v in row] for row in cost]
    tokens, experts = len(k), len(k[0])
    c = [1.0] * experts
    while True:
        r = [1 / tokens / (sum(c[j] * k[t][j] for j in range(experts)) + 1e-8) for t in range(tokens)]
        new = [1 / experts / (sum(r[t] * k[t][j] for t in range(tokens)) + 1e-8) for j in range(experts)]
        moved = sum(abs(a - b) for a, b in zip(c, new)) / experts
        c = new
        if moved <= tol:
            return torch.tensor([[r[t] * k[t][j] * c[j] for j in range(experts)] for t in range(tokens)])


def test_sinkhorn_equals_the_reference():
    cost = torch.randn(12, E, dtype=torch.float64) * 2
    got = mlm_moe.sinkhorn(cost)
    torch.testing.assert_close(got, _sinkhorn_reference(cost).double(), rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(got.sum(0), torch.full((E,), 1 / E, dtype=torch.float64))  # balanced experts


@pytest.mark.parametrize("topk", [1, 2])
def test_sinkhorn_routing_is_megatron_lms(topk):
    """--moe-router-load-balancing-type sinkhorn: in training the top-k of the balanced logits are chosen,
    weighted by the sigmoid (top-1) or softmax of the logits; in evaluation the top-k of those scores."""
    layer = _layer(moe_router_load_balancing_type=("sinkhorn",), moe_router_topk=topk)
    x = torch.randn(S * B, H) * 3
    logits = x @ layer.router.weight.t()
    scores = torch.sigmoid(logits) if topk == 1 else torch.softmax(logits, -1)
    for train, pick in ((True, _sinkhorn_reference(logits.detach())), (False, scores.detach())):
        layer.train(train)
        probs, routing_map, _ = layer.router(x, S, B)
        want = torch.zeros_like(routing_map)
        for t in range(S * B):
            for e in sorted(range(E), key=lambda e: -float(pick[t, e]))[:topk]:
                want[t, e] = True
        assert torch.equal(routing_map, want)
        torch.testing.assert_close(probs, scores * want)
    layer.train(True)
    balanced = layer.router(x, S, B)[1].sum(0)
    plain = mlm_moe.topk_routing(logits, topk)[1].sum(0)
    assert balanced.max() - balanced.min() <= plain.max() - plain.min()  # Sinkhorn spreads the load
