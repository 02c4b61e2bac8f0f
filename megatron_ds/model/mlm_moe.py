"""Megatron-LM's mixture-of-experts layer (Megatron Core ``transformer/moe``), beside DeepSpeed-MoE
(``model/moe_layer.py``); ``config/moe_selection.py`` says which one a command line builds.

``MoELayer(x)`` -> ``(output, auxiliary loss)``: the router picks each token's top-k experts, the tokens
are permuted into one run per expert (``permute``: a sort, no Python loop over experts), each expert's run
goes through its MLP (``grouped_mlp``), the outputs are weighted by the routing probabilities and summed
back per token (``unpermute``), and the shared experts' output is added. With expert parallelism the
permuted tokens travel to the ranks holding their experts (``dispatch``: all-to-all or all-gather, as
Megatron-LM's MoEAlltoAllTokenDispatcher / MoEAllGatherTokenDispatcher).

Parameters, as Megatron-LM names them: ``router.weight`` ``[experts, hidden]`` (and the ``router.expert_bias``
buffer), ``experts.linear_fc1.weight`` ``[local experts, ffn (x2 gated), hidden]``,
``experts.linear_fc2.weight`` ``[local experts, hidden, ffn]`` (biases ``[local experts, out]`` with
--add-bias-linear), ``shared_experts.linear_fc1/fc2.weight`` and ``shared_experts.gate_weight``. The expert
weights of a layer are one tensor whose first dimension is the local expert: expert parallel rank ``r`` holds
global experts ``r * local .. (r + 1) * local - 1``, so the EP 1 tensor is the EP ranks' tensors concatenated
in rank order (checkpoints reshard across EP by concatenating or splitting dimension 0). Megatron-LM's
legacy GroupedMLP holds the same values transposed and flattened (``weight1 [hidden, local x ffn]``).

The auxiliary losses (--moe-aux-loss-coeff aux_loss / seq_aux_loss, --moe-z-loss-coeff) are returned already
weighted by their coefficients; the transformer layer adds them to the MoE loss its activation carries to the
loss function (``model/transformer.py``), which adds them to the language-model loss. Their gradient is what
Megatron-LM's MoEAuxLossAutoScaler injects in backward: d(aux)/d(theta) scaled like the main loss (by
1/micro-batches, and the loss scale), since here it is part of the loss DeepSpeed scales.
"""
from __future__ import annotations

import math
import random

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron_ds import ds_compat
from megatron_ds.config import moe_selection
from megatron_ds.model.activations import mlp_activation
from megatron_ds.model.moe_layer import DROP_FRACTION
from megatron_ds.parallel.groups import expert_tensor_parallel_group
from megatron_ds.parallel.layers import init_method_normal, scaled_init_method_normal, set_tensor_parallel_attributes
from megatron_ds.parallel.mappings import (all_gather_along_first_dim, gather_from_sequence_parallel_region,
                                           reduce_scatter_to_sequence_parallel_region)
from megatron_ds.parallel.utils import tp_rank, tp_world_size


def group_limited_topk(scores: torch.Tensor, topk: int, num_groups: int, group_topk: int):
    """Megatron-LM's moe_utils.group_limited_topk (DeepSeek-V2/V3's device- or node-limited routing): the
    ``group_topk`` groups of experts whose top ``topk // group_topk`` scores sum highest, then the top ``topk``
    experts among them -> (values, indices)."""
    tokens, experts = scores.shape
    group_scores = scores.view(tokens, num_groups, -1).topk(topk // group_topk, dim=-1)[0].sum(dim=-1)
    chosen = torch.topk(group_scores, k=group_topk, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, chosen, True)
    mask = mask.unsqueeze(-1).expand(tokens, num_groups, experts // num_groups).reshape(tokens, experts)
    return torch.topk(scores.masked_fill(~mask, float("-inf")), k=topk, dim=-1)


def topk_routing(logits: torch.Tensor, topk: int, *, score_function: str = "softmax", pre_softmax: bool = False,
                 scaling_factor: float | None = None, expert_bias: torch.Tensor | None = None,
                 groups: tuple[int, int] | None = None):
    """``[tokens, experts]`` logits -> (probs ``[tokens, experts]``, zero off the chosen experts; routing map,
    bool), Megatron-LM's moe_utils.topk_routing_with_score_function (fp32 scores, probs in the logits' dtype).
    The expert bias (auxiliary-loss-free balancing) changes which experts are chosen, never their weights.
    ``groups``: (--moe-router-num-groups, --moe-router-group-topk) for group-limited routing."""
    def top_k(scores):
        return group_limited_topk(scores, topk, *groups) if groups else torch.topk(scores, topk, dim=1)

    if score_function == "softmax":
        if pre_softmax:
            probs, top = top_k(torch.softmax(logits, dim=-1, dtype=torch.float32))
        else:
            scores, top = top_k(logits)
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    else:
        scores = torch.sigmoid(logits.float()) if score_function == "sigmoid" else F.softplus(logits.float()).sqrt()
        if expert_bias is not None:
            top = top_k(scores + expert_bias.float())[1]
            scores = scores.gather(1, top)
        else:
            scores, top = top_k(scores)
        probs = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20) if topk > 1 else scores
    if scaling_factor:
        probs = probs * scaling_factor
    probs = probs.type_as(logits)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top, True)
    return torch.zeros_like(logits).scatter(1, top, probs), routing_map


def sinkhorn(cost: torch.Tensor, tol: float = 1e-4) -> torch.Tensor:
    """Megatron-LM's moe_utils.sinkhorn: exp(cost) scaled by row and column factors until its rows sum to
    1 / tokens and its columns to 1 / experts (Sinkhorn-Knopp; the column factors moving less than ``tol`` on
    average)."""
    cost = torch.exp(cost)
    d0 = torch.ones(cost.size(0), device=cost.device, dtype=cost.dtype)
    d1 = torch.ones(cost.size(1), device=cost.device, dtype=cost.dtype)
    eps, error, d1_old = 1e-8, 1e9, d1
    while error > tol:
        d0 = (1 / d0.size(0)) * 1 / (torch.sum(d1 * cost, 1) + eps)
        d1 = (1 / d1.size(0)) * 1 / (torch.sum(d0.unsqueeze(1) * cost, 0) + eps)
        error = torch.mean(torch.abs(d1_old - d1))
        d1_old = d1
    return d1 * cost * d0.unsqueeze(1)


def sinkhorn_routing(logits: torch.Tensor, topk: int, training: bool):
    """--moe-router-load-balancing-type sinkhorn (S-BASE), Megatron-LM's TopKRouter.sinkhorn_load_balancing:
    in training each token's experts are the top-k of the Sinkhorn-balanced fp32 logits (no gradient), else
    of the scores; the weights are the scores there: sigmoid of the logits for top-1, their softmax otherwise.
    -> (probs, routing map) as ``topk_routing``."""
    scores = torch.sigmoid(logits) if topk == 1 else torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
    with torch.no_grad():
        top = torch.topk(sinkhorn(logits.float()) if training else scores, topk, dim=1).indices
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top, True)
    return scores * routing_map, routing_map


def capacity(tokens: int, experts: int, capacity_factor: float) -> int:
    """Megatron-LM's moe_utils.get_capacity: ceil(tokens / experts x factor)."""
    return math.ceil(tokens / experts * capacity_factor)


def drop_tokens(probs, routing_map, topk: int, capacity_factor: float, policy: str = "probs", pad: bool = False):
    """Megatron-LM's moe_utils.apply_router_token_dropping: each expert keeps at most ``capacity(tokens x k)``
    of its tokens, those of highest probability ("probs") or the first ones ("position"); ``pad``: every expert
    takes exactly that many (the padding tokens with probability 0)."""
    tokens, experts = probs.shape
    cap = capacity(tokens * topk, experts, capacity_factor)
    if cap > tokens:
        keep = torch.ones_like(routing_map)
    else:
        # "position": a stable sort of the 0/1 map puts each expert's first tokens first (torch.topk's order
        # among equal values is not specified; Megatron-LM's own topk on the int map means the same)
        key = probs if policy == "probs" else routing_map.float()
        top = torch.sort(key, dim=0, descending=True, stable=True).indices[:cap]
        keep = torch.zeros_like(routing_map).scatter(0, top, True)
    final = keep if pad else routing_map & keep
    return probs * final, final


def switch_aux_loss(scores, tokens_per_expert, total_tokens: int, topk: int, experts: int) -> torch.Tensor:
    """Megatron-LM's switch_load_balancing_loss_func, unweighted (the router applies the coefficient): E x sum_i
    f_i P_i (Switch Transformer eq. 4, f_i over the k routes of each token)."""
    return (scores.sum(0) * tokens_per_expert).sum() * (experts / (topk * total_tokens * total_tokens))


def z_loss(logits) -> torch.Tensor:
    """ST-MoE's router z-loss (Megatron-LM's z_loss_func), unweighted: mean of logsumexp(logits)^2."""
    return torch.logsumexp(logits, dim=-1).square().mean()


def aux_scores(logits, topk: int, score_function: str):
    """Megatron-LM's compute_routing_scores_for_aux_loss: the scores the balancing loss reads (softmax; sigmoid
    normalised per token) and the top-k map of those scores (no expert bias, no dropping)."""
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    else:
        scores = torch.sigmoid(logits.float()) if score_function == "sigmoid" else F.softplus(logits.float()).sqrt()
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    top = torch.topk(scores, topk, dim=1).indices
    return scores, torch.zeros_like(scores, dtype=torch.bool).scatter(1, top, True)


class TopKRouter(nn.Module):
    """Megatron-LM's TopKRouter (router.py): gating linear (in --moe-router-dtype), z-loss, top-k routing,
    token dropping with a capacity factor, the aux_loss / seq_aux_loss balancing losses in training, and the
    tokens each expert got for the expert bias's update (``update_expert_bias``) when it is enabled."""

    def __init__(self, hidden: int, experts: int, *, topk: int, init_std: float, score_function: str = "softmax",
                 pre_softmax: bool = False, scaling_factor: float | None = None, expert_bias: bool = False,
                 router_dtype: torch.dtype | None = None, aux: dict | None = None, z_loss_coeff: float | None = None,
                 capacity_factor: float | None = None, drop_policy: str = "probs", pad_to_capacity: bool = False,
                 groups: tuple[int, int] | None = None, seq_groups: tuple = (), bias_groups: tuple = (),
                 grad_scale: int = 1, params_dtype=torch.float32, device=None):
        super().__init__()
        self.topk, self.experts, self.score_function, self.pre_softmax = topk, experts, score_function, pre_softmax
        self.groups = groups
        self.scaling_factor, self.router_dtype, self.aux, self.z_loss_coeff = (scaling_factor, router_dtype,
                                                                             dict(aux or {}), z_loss_coeff)
        self.capacity_factor, self.drop_policy, self.pad = capacity_factor, drop_policy, pad_to_capacity
        self.weight = nn.Parameter(torch.empty(experts, hidden, dtype=torch.float32, device=device))
        if self.weight.device.type != "meta":
            init_method_normal(init_std)(self.weight)
        self.weight.data = self.weight.data.to(params_dtype)
        if expert_bias:  # fp32 whatever the weights' dtype (Megatron-LM's _maintain_float32_expert_bias)
            self.register_buffer("expert_bias", torch.zeros(experts, dtype=torch.float32, device=device))
            self.register_buffer("local_tokens_per_expert", torch.zeros(experts, dtype=torch.float32, device=device),
                                 persistent=False)
        else:
            self.expert_bias = self.local_tokens_per_expert = None
        self.last: dict = {}  # the last training forward's statistics, for the loss report
        # the ranks that route the parts of one sequence (Megatron-LM's tp_cp_group in router.py), as groups whose
        # product it is: the tensor parallel group under Megatron sequence parallelism at TP > 1, the context
        # parallel group, or both (a sum over TP, then over CP, is the sum over TP x CP)
        self.seq_groups = tuple(g for g in seq_groups if g is not None and dist.get_world_size(g) > 1)
        self.seq_size = math.prod(dist.get_world_size(g) for g in self.seq_groups)
        # what the expert bias's counts are summed over besides the data parallel ranks (which include the CP
        # ranks, parallel/groups.py): the tensor parallel group under sequence parallelism
        self.bias_groups = tuple(g for g in bias_groups if g is not None and dist.get_world_size(g) > 1)
        # context parallelism: DeepSpeed averages the CP ranks' gradients (its data parallel axis is DP x CP), so a
        # CP rank's part of the losses is trained at CP x its weight, as its language-model loss is
        self.grad_scale = grad_scale

    def forward(self, x: torch.Tensor, seq: int, batch: int):
        """``x [seq x batch, hidden]`` -> (probs, routing map, weighted auxiliary loss: a 0-dim fp32 tensor).

        Under sequence or context parallelism (``seq_groups``) ``x`` is this rank's part of the sequences: each
        loss is computed as Megatron-LM's router does, from the tokens per expert summed over the group and this rank's
        scores, so that the ranks' losses sum to the loss of the whole sequences (their gradients too: the
        router's weight gradient is summed over the group); the value returned is that sum, on every rank."""
        dtype = self.router_dtype or x.dtype
        logits = F.linear(x.to(dtype), self.weight.to(dtype))
        loss = torch.zeros((), dtype=torch.float32, device=x.device)
        train, terms = self.training, {}
        parts = self.seq_size
        if train and self.z_loss_coeff:
            terms["z_loss"] = z_loss(logits.float()) / parts  # a mean over all the sequences' tokens
            loss = loss + terms["z_loss"] * self.z_loss_coeff
        if "sinkhorn" in self.aux:
            probs, routing_map = sinkhorn_routing(logits, self.topk, train)
        else:
            probs, routing_map = topk_routing(logits, self.topk, score_function=self.score_function,
                                              pre_softmax=self.pre_softmax, scaling_factor=self.scaling_factor,
                                              expert_bias=self.expert_bias, groups=self.groups)
        chosen = routing_map
        if self.capacity_factor is not None:
            probs, routing_map = drop_tokens(probs, routing_map, self.topk, self.capacity_factor, self.drop_policy,
                                             self.pad)
        if train and any(self.aux.values()):
            scores, aux_map = aux_scores(logits, self.topk, self.score_function)
            if self.aux.get("aux_loss"):
                terms["load_balancing_loss"] = switch_aux_loss(scores, self._over_seq(aux_map.sum(0).float()),
                                                               x.shape[0] * parts, self.topk, self.experts)
                loss = loss + terms["load_balancing_loss"] * self.aux["aux_loss"]
            if self.aux.get("seq_aux_loss"):
                # Megatron-LM's _apply_seq_aux_loss: tokens are [seq, batch]-ordered; folding the batch into the
                # expert dimension makes the switch loss a sum of per-sequence losses, averaged over the batch
                s, m = scores.reshape(seq, -1), aux_map.reshape(seq, -1)
                terms["seq_load_balancing_loss"] = switch_aux_loss(s, self._over_seq(m.sum(0).float()), seq * parts,
                                                                   self.topk, self.experts) / batch
                loss = loss + terms["seq_load_balancing_loss"] * self.aux["seq_aux_loss"]
        counts = routing_map.sum(0)
        if self.local_tokens_per_expert is not None and train and torch.is_grad_enabled():
            # after dropping, as Megatron-LM's _apply_expert_bias; not under no_grad: a recomputed forward
            # (activation checkpointing) counts once
            self.local_tokens_per_expert += counts.float()
        if parts > 1 and terms:  # the sums over the group: the value of the loss (its gradient stays this rank's part)
            total = self._over_seq(torch.stack([loss.detach(), *terms.values()]).detach())
            loss = self.grad_scale * loss
            loss = loss + (total[0] - loss.detach())
            terms = dict(zip(terms, total[1:]))
        if train:
            dropped = (chosen & ~routing_map).sum().float() / chosen.sum().float() \
                if self.capacity_factor is not None else None
            # the load the router asked for (before capacity: padded experts would all read as balanced)
            self.last = {"counts": chosen.sum(0).detach(), "dropped": dropped,
                         **{k: v.detach() for k, v in terms.items()}}
        return probs, routing_map, loss

    def _over_seq(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the ranks routing one sequence's parts (a new tensor; ``t`` itself without them)."""
        return _summed(t, self.seq_groups)

    def _apply(self, fn, recurse=True):
        """Keep the bias and the counts in fp32 through a cast of the model (a bf16 engine casts the buffers too:
        steps of 1e-3 would vanish in bf16), as Megatron-LM's _maintain_float32_expert_bias: restored once
        after each cast, not checked at every forward."""
        super()._apply(fn, recurse)
        if self.expert_bias is not None and self.expert_bias.dtype != torch.float32:
            self.expert_bias.data = self.expert_bias.data.float()
            self.local_tokens_per_expert.data = self.local_tokens_per_expert.data.float()
        return self


def _summed(t: torch.Tensor, groups) -> torch.Tensor:
    """``t`` summed over each of ``groups`` in turn (a new tensor; ``t`` itself for none)."""
    if groups:
        t = t.clone()
    for g in groups:
        dist.all_reduce(t, group=g)
    return t


@torch.no_grad()
def update_expert_bias(model: nn.Module, rate: float, group=None) -> None:
    """Auxiliary-loss-free balancing after an optimizer step (DeepSeek-V3 section 2.1.2; Megatron-LM's
    get_updated_expert_bias, called from finalize_model_grads): each router's bias moves by ``rate`` towards
    the experts that got fewer tokens than the mean over the step (summed over ``group``), then the counts
    restart."""
    for router in (m for m in model.modules() if isinstance(m, TopKRouter) and m.expert_bias is not None):
        counts = router.local_tokens_per_expert
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(counts, group=group)
        # sequence parallelism: each tensor parallel rank counted its part of the tokens (Megatron-LM sums over
        # TP x DP x CP, moe_utils.get_updated_expert_bias; the CP ranks are in ``group``)
        counts.copy_(_summed(counts, router.bias_groups))
        router.expert_bias += torch.sign(counts.mean() - counts) * rate
        counts.zero_()


def _shard(full: torch.Tensor, dim: int, world: int, rank: int, stride: int) -> torch.Tensor:
    """Tensor parallel rank ``rank``'s part of ``full`` split along ``dim`` (with ``stride`` interleaved blocks,
    the [gate; up] of a gated MLP: its part of each), as ``parallel.layers`` splits the dense MLP."""
    blocks = torch.split(full, full.shape[dim] // (world * stride), dim=dim)
    return torch.cat(blocks[rank::world], dim=dim)


class _Stacked(nn.Module):
    """One linear per local expert as one ``[experts, out, in]`` weight (and ``[experts, out]`` bias).
    Global expert ``g`` draws its N(0, ``std``) weight from its own generator, seeded ``seeds[g]``, so an
    expert's initial weights do not depend on the expert parallel size. ``split`` (dim of ``[out, in]``,
    expert tensor parallel size, rank, stride): this rank keeps its part of each drawn weight (of the bias
    too when the output dimension is split), so neither do they depend on the expert tensor parallel size."""

    def __init__(self, seeds: list[int], n_in: int, n_out: int, *, bias: bool, std: float, params_dtype, device,
                 split: tuple[int, int, int, int] | None = None):
        super().__init__()
        dim, world, rank, stride = split or (0, 1, 0, 1)
        shape = [n_out, n_in]
        shape[dim] //= world
        self.weight = nn.Parameter(torch.empty(len(seeds), *shape, dtype=params_dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(len(seeds), shape[0], dtype=params_dtype, device=device)) \
            if bias else None
        if self.weight.device.type != "meta":
            with torch.no_grad():
                for w, seed in zip(self.weight, seeds):
                    drawn = torch.empty(n_out, n_in).normal_(0.0, std, generator=torch.Generator().manual_seed(seed))
                    w.copy_(_shard(drawn, dim, world, rank, stride))
        if world > 1:
            for p in (self.weight, *([self.bias] if dim == 0 and bias else [])):
                # its gradient norm counted on every tensor parallel rank (parallel/layers.py)
                set_tensor_parallel_attributes(p, dim + 1, stride)


def _grouped_mm_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    """torch._grouped_mm (torch >= 2.8) runs on CUDA for bf16 operands whose rows are 16-byte aligned; its CPU
    version (torch 2.13) has no backward."""
    return (hasattr(torch, "_grouped_mm") and x.is_cuda and x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16
            and x.shape[-1] % 8 == 0 and w.shape[1] % 8 == 0)


def grouped_linear(x: torch.Tensor, counts: list[int], layer: _Stacked,
                   device_counts: torch.Tensor | None = None, bias_scale: float | torch.Tensor = 1.0, *,
                   grouped: bool = False) -> torch.Tensor:
    """``x`` (rows sorted by expert, ``counts[e]`` rows of local expert ``e``) through each expert's linear:
    with ``grouped`` (--moe-grouped-gemm) one grouped GEMM where ``_grouped_mm_ok``, else a loop over the
    experts (the same products; Megatron-LM's SequentialMLP without the flag). ``device_counts``: ``counts`` on
    ``x``'s device, copied there once for all of an MLP's linears (else here). ``bias_scale``: what the layer's
    bias (if it has one) is multiplied by: a number, or one per row (``[rows, 1]``)."""
    w = layer.weight
    grouped = grouped and _grouped_mm_ok(x, w)
    if device_counts is None and (layer.bias is not None or grouped):
        device_counts = torch.tensor(counts, device=x.device)
    if grouped:
        offs = device_counts.cumsum(0).to(torch.int32)
        y = torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
    else:
        # no rows (an expert parallel rank that got no routes): still a product, so that the empty output stays in
        # the autograd graph and this rank joins the dispatch's backward all-to-all / all-gather like the others
        y = torch.cat([part @ w[e].t() for e, part in enumerate(x.split(counts))]) if x.shape[0] else x @ w[0].t()
    if layer.bias is not None and isinstance(bias_scale, torch.Tensor):
        y = y + _RowScaledBias.apply(layer.bias, bias_scale, device_counts)
    elif layer.bias is not None:
        b = layer.bias.repeat_interleave(device_counts, dim=0, output_size=y.shape[0])
        y = y + (b if bias_scale == 1.0 else b * bias_scale)
    return y


class _RowScaledBias(torch.autograd.Function):
    """Each row's expert bias times the row's scale (``[rows, 1]``), keeping for backward only the bias and the
    scales: autograd's ``repeat_interleave(bias) * scale`` would keep a ``[rows, out]`` copy of the biases."""

    @staticmethod
    def forward(ctx, bias, scale, counts):
        ctx.save_for_backward(bias, scale, counts)
        return bias.repeat_interleave(counts, dim=0, output_size=scale.shape[0]) * scale

    @staticmethod
    def backward(ctx, grad):
        bias, scale, counts = ctx.saved_tensors
        rows = scale.shape[0]
        grad_scale = (grad * bias.repeat_interleave(counts, dim=0, output_size=rows)).sum(-1, keepdim=True)
        expert = torch.arange(bias.shape[0], device=grad.device).repeat_interleave(counts, output_size=rows)
        grad_bias = torch.zeros_like(bias).index_add_(0, expert, (grad * scale).to(bias.dtype))
        return grad_bias, grad_scale.to(scale.dtype), None


class GroupedExperts(nn.Module):
    """A rank's local experts: ``p * fc2(act(fc1(x)))`` for each routed (token, probability) pair, the
    probability scaling the activation as Megatron-LM's grouped MLPs do (so a bias of fc2 is scaled too:
    p * (fc2(x) + b)). ``grouped``: --moe-grouped-gemm, one torch._grouped_mm per linear on CUDA in bf16 instead of
    a GEMM per expert. Off by default, as upstream's flag is: a speed choice not on by default here until a GPU
    measurement in bench/RESULTS.md shows it pays (the GPU report times both, bench/gpu_report.py)."""

    def __init__(self, cfg, experts: range, ffn: int, *, seed: int, params_dtype, device, grouped: bool = False,
                 etp: int = 1, etp_rank: int = 0):
        super().__init__()
        self.grouped = grouped
        gated = cfg.swiglu or cfg.geglu
        common = dict(bias=cfg.add_bias_linear, params_dtype=params_dtype, device=device)
        std = cfg.init_method_std
        if ffn % etp:
            raise ValueError(f"--moe-ffn-hidden-size {ffn} does not split over expert tensor parallel size {etp}")
        # expert tensor parallelism: fc1's output rows (gate and up alike) and fc2's input columns split, as the
        # dense MLP's column and row parallel linears (Megatron-LM's experts at --expert-tensor-parallel-size)
        self.linear_fc1 = _Stacked([seed + 2 * g for g in experts], cfg.hidden_size, 2 * ffn if gated else ffn,
                                   std=std, split=(0, etp, etp_rank, 2 if gated else 1), **common)
        self.linear_fc2 = _Stacked([seed + 2 * g + 1 for g in experts], ffn, cfg.hidden_size,
                                   std=std / math.sqrt(2.0 * cfg.num_layers), split=(1, etp, etp_rank, 1), **common)
        # split experts' outputs are partial sums over the expert tensor parallel ranks: fc2's bias counts on the
        # first only (x 0 on the others, whose zero gradient keeps the sum of its gradient over them, as a
        # sequence_parallel parameter's, matched on every rank)
        self.fc2_bias_scale = 1.0 if etp_rank == 0 else 0.0
        if etp > 1 and self.linear_fc2.bias is not None:
            self.linear_fc2.bias.sequence_parallel = True
        self.act = mlp_activation(cfg)

    def forward(self, x: torch.Tensor, counts: list[int], probs: torch.Tensor) -> torch.Tensor:
        # the counts on the device, copied once for both linears, only where a bias or the grouped kernel reads them
        needed = self.linear_fc1.bias is not None or (self.grouped and _grouped_mm_ok(x, self.linear_fc1.weight))
        on_device = torch.tensor(counts, device=x.device) if needed else None
        h = self.act(grouped_linear(x, counts, self.linear_fc1, on_device, grouped=self.grouped))
        p = probs.unsqueeze(-1).to(h.dtype)
        # fc2's bias weighted by the route's probability too (Megatron-LM's GroupedMLP._apply_bias: t + b * p)
        return grouped_linear(h * p, counts, self.linear_fc2, on_device, bias_scale=p * self.fc2_bias_scale,
                              grouped=self.grouped)


class SharedExperts(nn.Module):
    """Megatron-LM's SharedExpertMLP: a dense MLP every token goes through (--moe-shared-expert-intermediate-size),
    with --moe-shared-expert-gate its output scaled by sigmoid(gate_weight . x)."""

    def __init__(self, cfg, ffn: int, *, gate: bool, params_dtype, device):
        super().__init__()
        gated = cfg.swiglu or cfg.geglu
        self.linear_fc1 = nn.Linear(cfg.hidden_size, 2 * ffn if gated else ffn, bias=cfg.add_bias_linear,
                                    device=device, dtype=params_dtype)
        self.linear_fc2 = nn.Linear(ffn, cfg.hidden_size, bias=cfg.add_bias_linear, device=device, dtype=params_dtype)
        self.gate_weight = nn.Parameter(torch.empty(1, cfg.hidden_size, device=device, dtype=params_dtype)) \
            if gate else None
        if self.linear_fc1.weight.device.type != "meta":
            with torch.no_grad():
                init_method_normal(cfg.init_method_std)(self.linear_fc1.weight)
                scaled_init_method_normal(cfg.init_method_std, cfg.num_layers)(self.linear_fc2.weight)
                for b in (self.linear_fc1.bias, self.linear_fc2.bias):
                    if b is not None:
                        b.zero_()
                if gate:
                    init_method_normal(cfg.init_method_std)(self.gate_weight)
        self.act = mlp_activation(cfg)

    def forward(self, x):
        y = self.linear_fc2(self.act(self.linear_fc1(x)))
        return y * torch.sigmoid(F.linear(x, self.gate_weight)) if self.gate_weight is not None else y


def permute(tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
    """Megatron-LM's moe_utils.permute: the (token, expert) routes in expert order, then token order ->
    (the routes' tokens, their probabilities, their token ids, routes per expert)."""
    expert_ids, token_ids = routing_map.t().nonzero(as_tuple=True)
    return tokens[token_ids], probs[token_ids, expert_ids], token_ids, routing_map.sum(0)


class _Unpermute(torch.autograd.Function):
    """index_add of the routes into their tokens; its backward needs the token ids only (torch's index_add
    keeps the routes' outputs for backward too, a [routes, hidden] tensor per layer)."""

    @staticmethod
    def forward(ctx, routed, token_ids, tokens: int):
        ctx.save_for_backward(token_ids)
        return routed.new_zeros(tokens, routed.shape[-1]).index_add_(0, token_ids, routed)

    @staticmethod
    def backward(ctx, grad):
        (token_ids,) = ctx.saved_tensors
        return grad.index_select(0, token_ids), None, None


def unpermute(routed: torch.Tensor, token_ids: torch.Tensor, tokens: int) -> torch.Tensor:
    """Megatron-LM's moe_utils.unpermute: each token's routes summed back (their outputs are weighted)."""
    return _Unpermute.apply(routed, token_ids, tokens)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with row splits; its backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (in_splits, out_splits), group
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _AllToAll.apply(grad, *ctx.splits, ctx.group), None, None, None


class MoELayer(nn.Module):
    """Router, this rank's ``experts / ep`` experts, shared experts (module docstring).

    ``ep_size``: the expert parallel size (its group: Megatron-LM's expert grid's, registered as DeepSpeed's,
    ``parallel/groups.py expert_grid``), ``ep_rank``
    this rank's place in it; ``dispatcher``:
    "alltoall" or "allgather" (Megatron-LM's --moe-token-dispatcher-type). ``router`` holds the TopKRouter's
    keyword arguments.

    ``sequence_parallel`` (Megatron sequence parallelism, with ``tp_group``): the input is this tensor parallel
    rank's part of the sequences, so every rank routes distinct tokens, as data parallel ranks do. The router
    and the shared experts are replicated over the tensor parallel group and see only that part: their
    gradients are summed over it (``sequence_parallel`` parameters, ``parallel.layers``), and so are the
    experts' at EP 1 and ETP 1. At EP > 1 with ETP 1 the expert parallel groups are EP consecutive ranks of the
    stage (Megatron-LM's expert grid, ``parallel/groups.py``): the routes travel to the experts over tensor and
    data parallel ranks alike (Megatron-LM's dispatch over its tp_ep group), each expert on one rank of the group.

    ``expert_tp`` (--expert-tensor-parallel-size ETP > 1, with sequence parallelism): each expert's MLP is split over
    the ETP ranks of Megatron-LM's expert grid (parallel/groups.py ``expert_grid``: runs of ETP ranks of the tensor
    parallel group) as the dense MLP is over TP (``GroupedExperts``). The expert tensor parallel group's tokens and
    routing are gathered first, every rank runs its part of the experts on all of them, and the partial outputs
    are reduce-scattered back to the sequence parts (Megatron-LM's token dispatchers: all-to-all over EP, gather
    over expert TP; here the gather comes first, which sends the same routes); at EP > 1 the expert parallel
    groups are the grid's, ranks ETP apart. Where the grid's expert data parallel group is not the data parallel
    group (EP > 1, or 1 < ETP < TP) the experts are DeepSpeed's expert parameters, reduced over it.

    ``cp_group`` (context parallelism): each CP rank routes its two chunks of every sequence, as a data parallel
    rank its samples; the router's balancing and z losses are those of the whole sequences (tokens per expert
    summed over the CP group, Megatron-LM's tp_cp_group) and are trained at CP x this rank's part, the weight
    its language-model loss has (DeepSpeed averages gradients over DP x CP ranks). With ``sequence_parallel`` too
    each rank routes its tensor parallel part of its chunks, and the sums run over TP x CP ranks. Expert parallel
    groups are DeepSpeed's, over its data parallel axis: DP x CP ranks, as Megatron-LM's expert parallelism spans
    data and context parallel ranks."""

    def __init__(self, cfg, experts: int, *, ffn: int, router: dict, shared_ffn: int | None = None,
                 shared_gate: bool = False, ep_size: int = 1, ep_rank: int = 0, dispatcher: str = "alltoall",
                 sequence_parallel: bool = False, tp_group=None, expert_tp: int = 1, grouped_gemm: bool = False,
                 cp_group=None, params_dtype=torch.float32, device=None):
        super().__init__()
        ep = ep_size
        if experts % ep:
            raise ValueError(f"{experts} experts do not divide over expert parallel size {ep}")
        self.num_experts, self.ep, self.ep_rank, self.dispatcher = experts, ep, ep_rank, dispatcher
        self._ep_group = None  # DeepSpeed's expert parallel group, looked up at the first forward (a build on
        # the meta device, --dry-run's, has no process groups)
        self.local = experts // ep
        # the ranks routing the parts of one sequence: tensor parallel ranks under sequence parallelism, context
        # parallel ranks, or both (Megatron-LM's tp_cp_group; class docstring)
        sp_group = tp_group if sequence_parallel else None
        self.router = TopKRouter(cfg.hidden_size, experts, init_std=cfg.init_method_std, params_dtype=params_dtype,
                                 device=device, seq_groups=(sp_group, cp_group), bias_groups=(sp_group,),
                                 grad_scale=tp_world_size(cp_group), **router)
        # the experts' seeds follow this layer's (the generators are seeded just before each layer is built,
        # model/pipeline_model.py), drawn by Python's generator: a build on the meta device has no value to read
        seed = random.Random(torch.initial_seed()).randrange(2 ** 31 - 1 - 2 * experts)
        tp = tp_world_size(tp_group)
        self.tp_group, self.etp = tp_group, expert_tp if sequence_parallel else 1
        if tp % self.etp:
            raise ValueError(f"expert tensor parallel size {self.etp} does not divide the tensor parallel size {tp}")
        # the grid's ETP groups are runs of ETP ranks of the tensor parallel group (parallel/groups.py expert_grid)
        self.experts = GroupedExperts(cfg, range(ep_rank * self.local, (ep_rank + 1) * self.local), ffn, seed=seed,
                                      params_dtype=params_dtype, device=device, grouped=grouped_gemm, etp=self.etp,
                                      etp_rank=tp_rank(tp_group) % self.etp if self.etp > 1 else 0)
        self._etp_group = tp_group if self.etp == tp else None  # else the grid's, looked up at the first forward
        # the experts are DeepSpeed's expert parameters where their expert data parallel group (Megatron-LM's grid)
        # is not the data parallel group: DeepSpeed reduces their gradients over the former
        self.expert_params = ep > 1 or 1 < self.etp < tp
        if self.expert_params and self.etp > 1 and self.experts.linear_fc2.bias is not None:
            # fc2's bias counts on the first ETP rank only, whose gradient is already whole (it adds the bias to all
            # the ETP group's routes): not summed over TP (which may hold other experts' biases), the other ranks'
            # copies keep a zero gradient, so an expert norm summed over the grid counts it once
            self.experts.linear_fc2.bias.sequence_parallel = False
        self.shared_experts = SharedExperts(cfg, shared_ffn, gate=shared_gate, params_dtype=params_dtype,
                                            device=device) if shared_ffn else None
        if self.expert_params:
            ds_compat.mark_expert_parameters(self.experts.parameters(), ep)
            self.engine_marker = ds_compat.moe_engine_marker(experts, ep)
        if sequence_parallel:  # partial gradients of replicated parameters (class docstring)
            replicated = [self.router, self.shared_experts] + ([self.experts] if ep == self.etp == 1 else [])
            for p in (p for m in replicated if m is not None for p in m.parameters()):
                p.sequence_parallel = True

    @property
    def ep_group(self):
        if self._ep_group is None:
            self._ep_group = ds_compat.expert_parallel_group(self.ep)
        return self._ep_group

    @property
    def etp_group(self):
        if self._etp_group is None:
            self._etp_group = expert_tensor_parallel_group()
        return self._etp_group

    def forward(self, x: torch.Tensor):
        seq, batch, hidden = x.shape
        tokens = x.reshape(-1, hidden)
        probs, routing_map, aux = self.router(tokens, seq, batch)
        if self.etp > 1:  # the tensor parallel group's tokens, for every rank's part of the experts (docstring)
            tokens = gather_from_sequence_parallel_region(tokens, self.etp_group)
            probs = gather_from_sequence_parallel_region(probs, self.etp_group)
            routing_map = all_gather_along_first_dim(routing_map.to(torch.uint8), self.etp_group).bool()
        if self.ep == 1:
            routed, route_probs, token_ids, counts = permute(tokens, routing_map, probs)
            out = unpermute(self.experts(routed, counts.tolist(), route_probs), token_ids, tokens.shape[0])
        elif self.dispatcher == "allgather":
            out = self._allgather(tokens, probs, routing_map)
        else:
            out = self._alltoall(tokens, probs, routing_map)
        if self.etp > 1:  # the partial sums of the split experts, summed and back to this rank's sequence part
            out = reduce_scatter_to_sequence_parallel_region(out, self.etp_group)
        out = out.to(x.dtype).view(seq, batch, hidden)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out, aux

    def _allgather(self, tokens, probs, routing_map):
        """MoEAllGatherTokenDispatcher: every EP rank's tokens and routing gathered, this rank's experts run on
        the routes to them, the partial outputs reduce-scattered back to the ranks that own the tokens."""
        all_tokens = gather_from_sequence_parallel_region(tokens, self.ep_group)
        all_probs = gather_from_sequence_parallel_region(probs, self.ep_group)
        all_map = all_gather_along_first_dim(routing_map.to(torch.uint8), self.ep_group).bool()  # gloo: no bool
        mine = slice(self.ep_rank * self.local, (self.ep_rank + 1) * self.local)
        routed, route_probs, token_ids, counts = permute(all_tokens, all_map[:, mine], all_probs[:, mine])
        partial = unpermute(self.experts(routed, counts.tolist(), route_probs), token_ids, all_tokens.shape[0])
        return reduce_scatter_to_sequence_parallel_region(partial, self.ep_group)

    def _alltoall(self, tokens, probs, routing_map):
        """MoEAlltoAllTokenDispatcher: the routes, in global expert order, go to the ranks holding their experts
        (one all-to-all), are regrouped there by local expert (Megatron-LM's sort_chunks_by_idxs), computed, put
        back in arrival order and returned (a second all-to-all), then summed per token."""
        routed, route_probs, token_ids, counts = permute(tokens, routing_map, probs)
        counts = counts.to(torch.int64)
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.ep_group)  # [source rank, local expert]
        # the layer's one device-to-host copy: the routes sent per global expert, received per (source, expert)
        both = torch.cat([counts, received]).tolist()
        sent, got, n = both[:self.num_experts], both[self.num_experts:], self.local
        send = [sum(sent[r * n:(r + 1) * n]) for r in range(self.ep)]
        recv = [sum(got[r * n:(r + 1) * n]) for r in range(self.ep)]
        x = _AllToAll.apply(routed, recv, send, self.ep_group)
        p = _AllToAll.apply(route_probs.unsqueeze(-1), recv, send, self.ep_group).squeeze(-1)
        # arrival order is (source, expert); the experts want (expert, source)
        chunks = torch.arange(x.shape[0], device=x.device).split(got)
        order = torch.cat([chunks[s * n + e] for e in range(n) for s in range(self.ep)]) \
            if x.shape[0] else torch.zeros(0, dtype=torch.int64, device=x.device)
        y = self.experts(x[order], [sum(got[s * n + e] for s in range(self.ep)) for e in range(n)], p[order])
        back = torch.empty_like(y).index_copy(0, order, y)
        y = _AllToAll.apply(back, send, recv, self.ep_group)
        return unpermute(y, token_ids, tokens.shape[0])

# what an MoE GPT of Megatron-LM's layer reports beside "lm loss" and "moe loss" (Megatron-LM's log names; the
# losses unweighted, as its track_moe_metrics prints them), per micro-batch averaged over its MoE layers
ROUTING_NAMES = ("load_balancing_loss", "seq_load_balancing_loss", "z_loss", "tokens per expert max/mean",
                 "tokens per expert cv")


def report_routing(report, layer: MoELayer, layer_number: int | None = None) -> None:
    """The last training forward's routing statistics of ``layer`` to the loss report (nothing in evaluation):
    its losses, the busiest expert's tokens over the mean and the coefficient of variation of the tokens per
    expert (this rank's tokens, as routed before capacity), and the dropped fraction of routes with a capacity
    factor. ``layer_number``
    (--moe-per-layer-logging): its losses also as "<loss> layer <n>"."""
    last = layer.router.last
    if not layer.training or not last:
        return
    for name in ROUTING_NAMES[:3]:
        if name in last:
            report.add(name, last[name])
            if layer_number is not None:
                report.add(f"{name} layer {layer_number}", last[name])
    counts = last["counts"].float()
    mean = counts.mean().clamp(min=1e-9)
    report.add("tokens per expert max/mean", counts.max() / mean)
    report.add("tokens per expert cv", counts.std(unbiased=False) / mean)
    if last["dropped"] is not None:
        report.add(DROP_FRACTION, last["dropped"])
    layer.router.last = {}


def build_mlm_moe(cfg, experts: int, *, ep_size: int = 1, ep_rank: int = 0, sequence_parallel: bool = False,
                  tp_group=None, expert_tp: int = 1, cp_group=None, params_dtype=torch.float32,
                  device=None) -> MoELayer:
    """The MoE layer of a model resolved for Megatron-LM's MoE (``config/moe_selection.py``)."""
    router = dict(topk=cfg.moe_router_topk, score_function=cfg.moe_router_score_function,
                  pre_softmax=cfg.moe_router_pre_softmax, scaling_factor=cfg.moe_router_topk_scaling_factor,
                  expert_bias=cfg.moe_router_enable_expert_bias,
                  router_dtype={"fp32": torch.float32, "fp64": torch.float64}.get(cfg.moe_router_dtype),
                  aux=moe_selection.balancing(cfg),
                  z_loss_coeff=cfg.moe_z_loss_coeff, capacity_factor=cfg.moe_expert_capacity_factor,
                  drop_policy=cfg.moe_token_drop_policy, pad_to_capacity=cfg.moe_pad_expert_input_to_capacity,
                  groups=(cfg.moe_router_num_groups, cfg.moe_router_group_topk) if cfg.moe_router_group_topk else None)
    return MoELayer(cfg, experts, ffn=cfg.moe_ffn_hidden_size, router=router,
                    shared_ffn=cfg.moe_shared_expert_intermediate_size, shared_gate=cfg.moe_shared_expert_gate,
                    ep_size=ep_size, ep_rank=ep_rank, dispatcher=cfg.moe_token_dispatcher_type,
                    sequence_parallel=sequence_parallel, tp_group=tp_group, expert_tp=expert_tp, cp_group=cp_group,
                    grouped_gemm=cfg.moe_grouped_gemm, params_dtype=params_dtype, device=device)
