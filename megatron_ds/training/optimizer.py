"""Optimizer construction: parameter groups, the fastest available AdamW, and a NaN guard.

apex is optional. On GPU with apex importable, its FusedAdam is used; otherwise torch's AdamW
(``fused=True`` on CUDA, the plain loop on CPU). With --cpu-optimizer (ZeRO-Offload), what
Megatron-DeepSpeed builds there (megatron/optimizer/__init__.py): DeepSpeedCPUAdam, or torch's AdamW
with --cpu_torch_adam. The choice is returned so start-up can log it.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from deepspeed.moe.utils import is_moe_param

from megatron_ds import ds_compat
from megatron_ds.model.mlm_moe import MoELayer
from megatron_ds.model.param_groups import param_groups


SGD, TORCH_CPU_ADAM, DS_CPU_ADAM = "torch.optim.SGD", "torch.optim.AdamW (--cpu_torch_adam)", \
    "deepspeed.ops.adam.DeepSpeedCPUAdam"
APEX_ADAM, TORCH_FUSED_ADAM = "apex.optimizers.FusedAdam", "torch.optim.AdamW(fused=True)"


def build_optimizer(model: torch.nn.Module, settings, device: torch.device):
    """Returns (optimizer, description). ``settings``: the run's ``OptimizerSettings``."""
    # --decoupled-lr: the embedding and output layer weights' groups carry their own peak and floor LR
    decoupled = None if settings.decoupled_lr is None else (
        settings.decoupled_lr, settings.min_lr if settings.decoupled_min_lr is None else settings.decoupled_min_lr)
    # Megatron-LM's MoE whose experts are DeepSpeed's expert parameters (model/mlm_moe.py: EP > 1, or ETP between 1
    # and TP) always gets DeepSpeed's expert optimizer groups: its bf16 and ZeRO optimizers reduce, partition and
    # clip marked experts by them
    moe_groups = settings.create_moe_param_group or any(isinstance(m, MoELayer) and m.expert_params
                                                        for m in model.modules())
    groups = param_groups(model, settings.weight_decay, moe_groups=moe_groups, decoupled_lr=decoupled)
    if settings.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=settings.lr, momentum=settings.sgd_momentum), SGD
    kwargs = dict(lr=settings.lr, betas=(settings.adam_beta1, settings.adam_beta2), eps=settings.adam_eps)
    if settings.cpu_optimizer and settings.cpu_torch_adam:
        return torch.optim.AdamW(groups, **kwargs), TORCH_CPU_ADAM
    if settings.cpu_optimizer:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # noqa: PLC0415 - builds its CPU op on first use

        return DeepSpeedCPUAdam(groups, adamw_mode=True, **kwargs), DS_CPU_ADAM
    if device.type == "cuda":
        try:
            from apex.optimizers import FusedAdam  # noqa: PLC0415 - optional dependency
            return FusedAdam(groups, adam_w_mode=True, **kwargs), APEX_ADAM
        except (ImportError, RuntimeError):  # RuntimeError: apex installed without its CUDA extensions
            return torch.optim.AdamW(groups, fused=True, **kwargs), TORCH_FUSED_ADAM
    return torch.optim.AdamW(groups, foreach=True, **kwargs), "torch.optim.AdamW(foreach=True)"


def describe_cuda_optimizer(settings) -> str:
    """What ``build_optimizer`` picks on a CUDA device, without building anything (--dry-run, any host:
    building DeepSpeedCPUAdam would compile its op)."""
    if settings.optimizer == "sgd":
        return SGD
    if settings.cpu_optimizer:
        return TORCH_CPU_ADAM if settings.cpu_torch_adam else DS_CPU_ADAM
    return f"{APEX_ADAM} where apex's CUDA extension imports, else {TORCH_FUSED_ADAM}"


def _with_expert_norm(dense: float, grads: list[torch.Tensor], groups: tuple) -> float:
    """The norm of the dense gradients (``dense``; -1: not finite, DeepSpeed's convention) and ``grads``, this rank's
    expert gradients, whose squares are summed over ``groups`` in turn (inf where either is not finite)."""
    squares = torch.stack([g.detach().float().square().sum() for g in grads]).sum()
    for group in groups:
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(squares, group=group)
    return math.sqrt(dense * dense + float(squares)) if dense >= 0 else float("inf")


class GuardedOptimizer(torch.optim.Optimizer):
    """Wraps the fp32 ZeRO-0 optimizer so a non-finite gradient skips the step, as DeepSpeed's
    bf16/fp16/ZeRO optimizers already do: computes the global grad norm (TP/PP aware, via DeepSpeed's
    ``get_grad_norm`` with the engine's ``mpu``), sets ``overflow`` (DeepSpeed then counts a skipped
    step and does not advance the LR schedule), else clips and steps. ``_global_grad_norm`` is what
    the engine reports as the grad norm.

    Mixture of experts (``expert_group``: DeepSpeed's name of the model's expert groups): expert
    gradients are different experts on each expert parallel rank, so their norm is summed over the
    expert parallel group by DeepSpeed's ``get_norm_with_moe_layers``, as its bf16 optimizer does. Every
    rank of an MoE model joins those reductions, with a zero where its stage holds no expert.
    ``expert_norm_groups`` (Megatron-LM's expert grid, parallel/groups.py): the groups one copy of every expert
    shard spans, its ETP x EP ranks and the pipeline stages, over which the experts' squared norm is summed instead
    (DeepSpeed's helper sums over TP x PP, then EP: several copies of a shard when ETP < TP)."""

    def __init__(self, inner: torch.optim.Optimizer, clip_grad: float, expert_group: str | None = None,
                 expert_norm_groups: tuple | None = None):
        self.inner = inner
        self.clip_grad = clip_grad
        self.expert_group, self.expert_norm_groups = expert_group, expert_norm_groups
        self.mpu = None  # set once the engine exists
        # both read by DeepSpeed's engine after each step (checked: ds_compat._READ_BY_DEEPSPEED)
        self.overflow = False
        self._global_grad_norm = 0.0
        # share, not copy, the inner optimizer's state so schedulers and checkpoints see one truth
        self.param_groups = inner.param_groups
        self.state = inner.state
        self.defaults = inner.defaults
        ds_compat.act_as_torch_optimizer(self, "GuardedOptimizer.zero_grad")

    def _params(self):
        return [p for g in self.param_groups for p in g["params"] if p.grad is not None]

    def _grads_for_norm(self, params):
        """As DeepSpeed's bf16 optimizer selects them: each gradient counted once across the model
        copies -- tied copies marked ds_pipe_replicated skipped, TP-replicated ones only on TP rank 0."""
        tp_rank = self.mpu.get_tensor_model_parallel_rank() if self.mpu is not None else 0
        return [p.grad for p in params
                if not ds_compat.is_pipe_replicated(p) and not is_moe_param(p)
                and (tp_rank == 0 or getattr(p, "tensor_model_parallel", False) or getattr(p, "model_parallel", False))]

    def _global_norm(self, params) -> float:
        """DeepSpeed's helpers report a non-finite norm as -1."""
        from megatron_ds.ds_compat import get_global_norm_of_tensors  # noqa: PLC0415 - imports deepspeed

        grads = self._grads_for_norm(params)
        # a rank holding nothing to count must still join the reduction
        norm = float(get_global_norm_of_tensors(grads or [torch.zeros(1, device=params[0].device)], mpu=self.mpu))
        if self.expert_group is None:
            return norm
        experts = [p.grad for p in params if is_moe_param(p)] or [torch.zeros(1, device=params[0].device)]
        if self.expert_norm_groups is not None:
            return _with_expert_norm(norm, experts, self.expert_norm_groups)
        return ds_compat.norm_with_expert_grads(norm, self.mpu, {self.expert_group: experts})

    @torch.no_grad()
    def step(self, closure=None):
        params = self._params()
        norm = self._global_norm(params)
        self.overflow = not (0.0 <= norm < float("inf"))
        self._global_grad_norm = norm if not self.overflow else float("inf")
        if self.overflow:
            for p in params:
                p.grad = None
            return None
        if self.clip_grad > 0 and norm > self.clip_grad:
            ds_compat.scale_grads_([p.grad for p in params], self.clip_grad / (norm + 1e-6))
        return self.inner.step(closure)

    def zero_grad(self, set_to_none: bool = True):
        self.inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state_dict):
        self.inner.load_state_dict(state_dict)
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state
