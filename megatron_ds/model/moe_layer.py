"""Mixture of experts: DeepSpeed's ``deepspeed.moe.layer.MoE`` around our expert MLP, as
Megatron-DeepSpeed builds it (megatron/model/transformer.py ParallelTransformerLayer.__init__).

Which layers: ``experts_per_layer`` (upstream's get_num_experts_per_layer): layer ``n`` (1-based) is
an MoE layer when ``n % expert_interval == 0``; ``--num-experts`` gives one count for all of them or
one per MoE layer.

The layer: ``MoE(hidden, ParallelMLP(expert=True), num_experts, ep_size, k, capacity factors, min
capacity, use_residual, drop_tokens, enable_expert_tensor_parallelism, top2_2nd_expert_sampling)``, so
parameter names are upstream's: ``mlp.deepspeed_moe.gate.wg.weight``,
``mlp.deepspeed_moe.experts.deepspeed_experts.<local expert>.dense_h_to_4h.weight`` ..., and with
``--mlp-type residual`` ``mlp.mlp.*`` (the dense MLP) and ``mlp.coefficient.*``. Without
``--enable-expert-tensor-parallelism`` an expert is whole on every tensor parallel rank (upstream's
``moe=True`` linear layers do not split); DeepSpeed then gives each TP rank a share of every expert's
capacity slots and gathers them back (deepspeed/moe/sharded_moe.py MOELayer.forward, drop_tokens /
gather_tokens). With it, an expert's MLP is split over TP like the dense one.

Initialization: DeepSpeed deep-copies one expert module into every local expert, so upstream's
experts start identical (and identical on every expert parallel rank). Here global expert ``g`` is
drawn from its own seed (derived from the layer's seed), so experts differ from the start and expert
``g`` has the same weights at any expert parallel size: a run at EP 2 is the run at EP 1.

The gate's auxiliary (load-balancing) loss ``l_aux`` of every MoE layer is summed along the layers
and added to the language-model loss times ``--moe-loss-coeff`` (pretrain_gpt.py forward_step /
loss_func); how it travels is ``megatron_ds.model.transformer``'s business. ``DropCounter`` reads
how many of the gate's routes fell beyond the experts' capacity.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from deepspeed.moe.layer import MoE

from megatron_ds import ds_compat
from megatron_ds.config.moe_selection import is_mlm_moe

DROP_FRACTION = "moe drop fraction"
"""The loss report's name of the fraction of (token, expert) routes dropped beyond capacity."""


def experts_per_layer(num_experts, num_layers: int, expert_interval: int) -> list[int]:
    """Experts of each layer (1: a dense MLP), as upstream's get_num_experts_per_layer."""
    num_experts = list(num_experts)
    moe_layers = num_layers // expert_interval
    if len(num_experts) not in (1, moe_layers):
        raise ValueError(f"--num-experts has {len(num_experts)} values; give one, or one per MoE layer "
                         f"({moe_layers}: --num-layers {num_layers} // --expert-interval {expert_interval})")
    if len(num_experts) == 1:
        num_experts = num_experts * moe_layers
    return [num_experts[(n - 1) // expert_interval] if n % expert_interval == 0 else 1
            for n in range(1, num_layers + 1)]


def is_moe_model(cfg) -> bool:
    """Whether any layer of the model (a resolved ``ModelConfig``) is a DeepSpeed-MoE layer (Megatron-LM's
    layers, ``model/mlm_moe.py``, need none of DeepSpeed's expert groups)."""
    return not is_mlm_moe(cfg) and any(n > 1 for n in experts_per_layer(cfg.num_experts, cfg.num_layers,
                                                                         cfg.expert_interval))


def _seeded(seed: int, build):
    """``build()`` with the default CPU generator seeded (our layers draw their weights there)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


class DropCounter:
    """Reads the fraction of routes the gate of ``moe`` dropped in its last forward (a forward hook
    on DeepSpeed's ``TopKGate``: what it returns says which routes it kept, ``ds_compat``)."""

    def __init__(self, moe: MoE):
        self.last: torch.Tensor | None = None
        moe.deepspeed_moe.gate.register_forward_hook(self._hook)

    def _hook(self, gate, args, output) -> None:
        routes = args[0].shape[0] * gate.k  # tokens x experts per token
        kept = ds_compat.moe_gate_kept_routes(output)
        self.last = (1.0 - kept.float() / routes).detach()


@contextlib.contextmanager
def _groups_set_aside(module: torch.nn.Module):
    """Process groups cannot be deep-copied, and DeepSpeed deep-copies the expert it is given
    (deepspeed/moe/experts.py Experts.__init__): set aside the ones a module's layers hold (an expert
    split over tensor parallel ranks keeps its group) while that happens; yields a function that puts
    them back into the module or any copy of it."""
    held = [(name, attr, value) for name, m in module.named_modules() for attr, value in vars(m).items()
            if isinstance(value, dist.ProcessGroup)]
    for name, attr, _ in held:
        setattr(module.get_submodule(name), attr, None)

    def restore(target: torch.nn.Module) -> None:
        for name, attr, value in held:
            setattr(target.get_submodule(name), attr, value)

    try:
        yield restore
    finally:
        restore(module)


def build_moe(hidden_size: int, make_expert, *, num_experts: int, ep_size: int, ep_rank: int, seed: int,
              topk: int, residual: bool, train_capacity_factor: float, eval_capacity_factor: float,
              min_capacity: int, drop_tokens: bool, top2_2nd_expert_sampling: bool,
              expert_tensor_parallel: bool) -> MoE:
    """DeepSpeed's MoE holding this rank's ``num_experts / ep_size`` experts, ``make_expert()`` each.

    ``ep_rank``: this rank's place in its expert parallel group (``ParallelState.expert_parallel_rank``),
    so it holds global experts ``ep_rank * local .. (ep_rank + 1) * local - 1`` (DeepSpeed's all-to-all
    sends expert chunk ``i`` to the ``i``-th rank of the group). ``seed`` derives every expert's seed.
    """
    if num_experts % ep_size:
        raise ValueError(f"{num_experts} experts do not divide over expert parallel size {ep_size}")
    template = _seeded(seed, make_expert)  # the residual MoE's dense MLP; DeepSpeed copies it per expert
    with _groups_set_aside(template) as restore:
        moe = MoE(hidden_size, template, num_experts=num_experts, ep_size=ep_size, k=topk,
                  capacity_factor=train_capacity_factor, eval_capacity_factor=eval_capacity_factor,
                  min_capacity=min_capacity, use_residual=residual, drop_tokens=drop_tokens, use_rts=True,
                  use_tutel=False, enable_expert_tensor_parallelism=expert_tensor_parallel,
                  top2_2nd_expert_sampling=top2_2nd_expert_sampling)
        local = moe.deepspeed_moe.experts.deepspeed_experts
        for expert in local:
            restore(expert)
    if template.dense_h_to_4h.weight.device.type != "meta":  # a meta build has no values to draw
        with torch.no_grad():
            for j, expert in enumerate(local):
                drawn = _seeded(seed + 1 + ep_rank * len(local) + j, make_expert)
                for mine, new in zip(expert.parameters(), drawn.parameters()):
                    mine.copy_(new)
    return moe
