"""megatron_ds: Megatron-style GPT training on DeepSpeed, built for GPU clusters (ABCI first)."""

__version__ = "0.1.0"
