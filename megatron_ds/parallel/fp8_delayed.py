"""Delayed scaling: the FP8 recipe of Transformer Engine's ``DelayedScaling`` (Megatron-LM's default
``--fp8-recipe delayed``), for the linear layers' three GEMM operands.

Each FP8 linear layer keeps, per operand (input, weight, gradient of the output), an amax history of
``--fp8-amax-history-len`` steps and the scale its casts use; both are module buffers, so they are
saved in checkpoints, resharded with them and restored on resume. Transformer Engine's rules
(NVIDIA/TransformerEngine, transformer_engine/pytorch/fp8.py, ``_update_amax_history``,
``_default_get_amax_and_update_history``, ``_default_sf_compute``; ``reduce_and_update_fp8_tensors``):

- a cast scales by the *stored* scale, not by the tensor's own amax, and writes the tensor's amax into
  the history's slot 0 (here: the largest over the step's micro-batches and recomputations);
- at the update, slot 0 is all-reduced (MAX) over the amax reduction group, Megatron-LM's
  ``get_amax_reduction_group``: tensor parallel x data parallel (with the context / sequence parallel
  ranks), so every rank casts with the same scale; then the amax is the history's max (``max``) or
  slot 0 (``most_recent``), the scale ``(fp8_max / amax) / 2**margin`` (kept when the amax is 0 or not
  finite, fp32's max when it overflows), the history rolled one slot (slot 0 goes to the end, the
  oldest entry drops) and slot 0 zeroed;
- the first step casts with scale 1 (the history is empty), as Transformer Engine's first step does.

Transformer Engine updates the forward operands' scales when each micro-batch's ``fp8_autocast``
exits and the gradients' after its backward; here all three are updated once per optimizer step
(``update_delayed_scaling`` after the step), so with gradient accumulation every micro-batch of a step
casts with the same scales and slot 0 holds the step's largest amax. With one micro-batch per step the
two coincide.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

ROLES = ("input", "weight", "grad_output")
# the attribute under which a linear layer holds its DelayedScaling (parallel/layers.py): its buffers'
# checkpoint names are "<layer>.fp8_scaling.amax_history" and "<layer>.fp8_scaling.scale"
STATE_NAME = "fp8_scaling"


def is_fp8_state(name: str) -> bool:
    """Whether a state-dict name is a delayed-scaling buffer (replicated over TP: the amax is reduced)."""
    return f".{STATE_NAME}." in f".{name}"
# the largest finite value of each FP8 format: E4M3 (torch.float8_e4m3fn) 448, E5M2 57344
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


class DelayedScaling(torch.nn.Module):
    """One FP8 linear layer's delayed-scaling state: ``amax_history`` [history_len, 3] and ``scale`` [3]
    (columns: input, weight, grad_output), fp32 buffers; ``recipe`` says the formats, margin, algorithm."""

    def __init__(self, recipe, tp_group, device=None):
        super().__init__()
        self.recipe, self.tp_group = recipe, tp_group
        self.register_buffer("amax_history", torch.zeros(recipe.amax_history_len, len(ROLES), dtype=torch.float32,
                                                         device=device))
        self.register_buffer("scale", torch.ones(len(ROLES), dtype=torch.float32, device=device))

    def _apply(self, fn, recurse=True):
        """Moves with the model, but stays fp32 when the model is cast (DeepSpeed's ``module.bfloat16()`` /
        ``.half()``): an amax or a scale rounded to 8 bits would not be Transformer Engine's."""
        before = dict(self._buffers)
        super()._apply(fn, recurse)
        for name, old in before.items():
            if self._buffers[name].dtype != old.dtype:
                self._buffers[name] = old.to(device=self._buffers[name].device)
        return self

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        """A checkpoint without delayed-scaling state (a bf16 or current-scaling run's) loads: this layer
        starts from an empty history and scale 1, as a fresh run does."""
        saved = state_dict.get(prefix + "amax_history")
        if saved is not None and saved.shape != self.amax_history.shape:
            error_msgs.append(f"{prefix}amax_history: saved with --fp8-amax-history-len {saved.shape[0]}, this run's "
                              f"is {self.amax_history.shape[0]}; resume with {saved.shape[0]}")
            return
        before = len(missing_keys)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        missing_keys[before:] = [k for k in missing_keys[before:] if not k.startswith(prefix)]

    def scale_for(self, role: str) -> torch.Tensor:
        return self.scale[ROLES.index(role)]

    @torch.no_grad()
    def record(self, role: str, t: torch.Tensor) -> None:
        """Slot 0 keeps the largest amax the operand has had this step."""
        i = ROLES.index(role)
        amax = t.detach().abs().amax().to(torch.float32)
        self.amax_history[0, i] = torch.maximum(self.amax_history[0, i], amax)

    def fp8_max(self) -> torch.Tensor:
        fwd, bwd = self.recipe.dtypes()
        return torch.tensor([FP8_MAX[fwd], FP8_MAX[fwd], FP8_MAX[bwd]], dtype=torch.float32,
                            device=self.scale.device)

    @torch.no_grad()
    def update(self) -> None:
        """The scale from the (already reduced) history, then the history rolled (Transformer Engine's order)."""
        history = self.amax_history
        amax = history.amax(dim=0) if self.recipe.amax_compute_algo == "max" else history[0].clone()
        sf = (self.fp8_max() / amax) / (2.0 ** self.recipe.margin)
        sf = torch.where(amax > 0.0, sf, self.scale)
        sf = torch.where(torch.isfinite(amax), sf, self.scale)
        sf = torch.where(torch.isinf(sf), torch.full_like(sf, torch.finfo(torch.float32).max), sf)
        self.scale.copy_(sf)
        if history.shape[0] > 1:
            history.copy_(torch.roll(history, -1, 0))
        history[0].zero_()


def drop_fp8_state(state_dict: dict, prefix: str) -> None:
    """A layer without delayed scaling loading a checkpoint with it (a run resumed in another recipe):
    the saved amax history and scales mean nothing to it."""
    for key in [k for k in state_dict if k.startswith(prefix + STATE_NAME + ".")]:
        del state_dict[key]


def delayed_scaling_states(module: torch.nn.Module) -> list[DelayedScaling]:
    return [m for m in module.modules() if isinstance(m, DelayedScaling)]


@torch.no_grad()
def update_delayed_scaling(module: torch.nn.Module, dp_group) -> int:
    """After an optimizer step: slot 0 of every layer's history all-reduced (MAX) over the layers' tensor
    parallel group and then ``dp_group`` (max over both: the TP x DP group's), one collective each for the model,
    then each layer's scale and history updated. Returns how many layers were updated (0: no delayed scaling)."""
    states = delayed_scaling_states(module)
    if not states:
        return 0
    current = torch.stack([s.amax_history[0] for s in states])
    for group in (states[0].tp_group, dp_group):
        if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(current, op=dist.ReduceOp.MAX, group=group)
    for s, amax in zip(states, current):
        s.amax_history[0].copy_(amax)
        s.update()
    return len(states)
