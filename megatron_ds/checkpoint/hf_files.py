"""Hugging Face transformers files, whatever the model family: the safetensors tensors of a model
directory read lazily by name (``HFWeights``), written in shards under HF's names (``ShardWriter``),
and our fused QKV projection split into HF's separate q/k/v and back (``split_qkv``, ``fuse_qkv``).
Each family's mapping of names and configs is its own (``families/<name>/*_hf.py``).
"""
from __future__ import annotations

import json
import os

import torch

from megatron_ds.config.schema import ModelConfig
from megatron_ds.errors import ConfigError


class HFWeights:
    """Lazy access to a directory's safetensors tensors by name (sharded or not)."""

    def __init__(self, hf_dir: str):
        from safetensors import safe_open  # noqa: PLC0415

        index = os.path.join(hf_dir, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        elif os.path.isfile(os.path.join(hf_dir, "model.safetensors")):
            files = ["model.safetensors"]
        else:
            raise ConfigError(f"{hf_dir} has no model.safetensors(.index.json); save the model with "
                              f"safe_serialization=True (pytorch_model.bin is not read: it is a pickle)")
        self.handles = [safe_open(os.path.join(hf_dir, f), framework="pt") for f in files]
        self.where = {name: h for h in self.handles for name in h.keys()}

    def get(self, name: str) -> torch.Tensor | None:
        for candidate in (name, name.removeprefix("transformer.")):  # GPT-2 hub files lack the prefix
            if candidate in self.where:
                return self.where[candidate].get_tensor(candidate).to(torch.float32)
        return None

    def require(self, name: str) -> torch.Tensor:
        t = self.get(name)
        if t is None:
            raise ConfigError(f"the model has no tensor {name!r}")
        return t


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


class ShardWriter:
    """Collects tensors and writes safetensors shards in HF's naming."""

    def __init__(self, out_dir: str, max_bytes: int):
        self.out_dir, self.max_bytes = out_dir, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.size, self.files, self.weight_map = 0, [], {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.size + nbytes > self.max_bytes:
            self._flush()
        self.pending[name] = tensor.contiguous()
        self.size += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file  # noqa: PLC0415

        path = os.path.join(self.out_dir, f".shard-{len(self.files)}.safetensors")
        save_file(self.pending, path, metadata={"format": "pt"})
        # safetensors creates its files 0600; ABCI groups share directories: follow the umask instead
        os.chmod(path, 0o666 & ~_umask())
        self.files.append((path, list(self.pending)))
        self.pending, self.size = {}, 0

    def close(self) -> int:
        """Write what is left and give the shards their final names; returns the total bytes."""
        if self.pending or not self.files:
            self._flush()
        total = sum(os.path.getsize(p) for p, _ in self.files)
        n = len(self.files)
        for i, (path, names) in enumerate(self.files):
            final = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(path, os.path.join(self.out_dir, final))
            self.weight_map.update({name: final for name in names})
        if n > 1:
            with open(os.path.join(self.out_dir, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": self.weight_map}, f, indent=2)
        return total


def split_qkv(w: torch.Tensor, m: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Our fused per-group QKV (weight or bias) -> (q, k, v) with heads in HF order."""
    groups, hpg, d = m.num_key_value_heads, m.num_attention_heads // m.num_key_value_heads, m.kv_channels
    rest = w.shape[1:]
    w = w.reshape(groups, hpg + 2, d, *rest)
    return (w[:, :hpg].reshape(groups * hpg * d, *rest), w[:, hpg].reshape(groups * d, *rest),
            w[:, hpg + 1].reshape(groups * d, *rest))


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: ModelConfig) -> torch.Tensor:
    groups, hpg, d = m.num_key_value_heads, m.num_attention_heads // m.num_key_value_heads, m.kv_channels
    rest = q.shape[1:]
    parts = (q.reshape(groups, hpg, d, *rest), k.reshape(groups, 1, d, *rest), v.reshape(groups, 1, d, *rest))
    return torch.cat(parts, dim=1).reshape(groups * (hpg + 2) * d, *rest)
