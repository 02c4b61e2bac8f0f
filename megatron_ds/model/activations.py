"""The MLP activations Megatron's flags select (--swiglu, --geglu, --openai-gelu, --squared-relu, --relu, GeLU by
default), unfused: the dense MLP's (model/transformer.py) and Megatron-LM's MoE experts' (model/mlm_moe.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_ds.config.schema import ModelConfig


def openai_gelu(x: torch.Tensor) -> torch.Tensor:
    """--openai-gelu: GeLU's tanh approximation, as Megatron's openai_gelu / GPT-2's gelu_new."""
    return F.gelu(x, approximate="tanh")


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    """--squared-relu: relu(x)^2, as Megatron's squared_relu."""
    return F.relu(x).square()


def mlp_activation(cfg: ModelConfig):
    """The MLP's activation of its first projection's output (gated, --swiglu / --geglu: of its [gate; up]
    halves), unfused: the dense MLP's and Megatron-LM's MoE experts' (``model/mlm_moe.py``)."""
    if cfg.swiglu or cfg.geglu:
        gate_activation = F.silu if cfg.swiglu else openai_gelu

        def gated(x: torch.Tensor) -> torch.Tensor:
            gate, up = x.chunk(2, dim=-1)
            return gate_activation(gate) * up
        return gated
    return openai_gelu if cfg.openai_gelu else squared_relu if cfg.squared_relu else F.relu if cfg.relu else F.gelu
