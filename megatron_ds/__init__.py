"""megatron_ds: Megatron-DeepSpeed-compatible pretraining (GPT, BERT, T5) on DeepSpeed, built for GPU
clusters (ABCI first): the same flags, data files, log lines and checkpoints."""

__version__ = "0.1.0"
