"""The sequence-length warm-up applied to a live engine (the schedule is ``config.curriculum``).

Megatron-DeepSpeed cuts tokens, position ids, labels and loss mask of every training micro-batch to the
step's length (pretrain_gpt.py ``get_batch_pipe``; gpt_model.py for ``--no-pipeline-parallel``, where the
attention mask is cut too). The model here derives its causal mask (and with --reset-attention-mask the
document boundaries) from the tokens, so cutting the four tensors cuts attention as well. Evaluation
reads its own, uncut iterator. DeepSpeed's pipeline engine caches the activation shapes it sends
between stages; Megatron-DeepSpeed calls ``reset_activation_shape`` whenever the length changes
(megatron/training.py ``evaluate``; DeepSpeed's pipe engine ``train_batch`` before 0.19 for training).
"""
from __future__ import annotations


class SeqlenWarmup:
    """Which length the engine runs next: ``set_length`` before a step or an evaluation, ``cut`` on the
    training micro-batches."""

    def __init__(self, engine, use_pipeline: bool):
        self.engine, self.use_pipeline = engine, use_pipeline
        self.length: int | None = None  # what the engine runs; None before the first step

    def set_length(self, length: int) -> None:
        if self.use_pipeline and self.length is not None and length != self.length:
            self.engine.reset_activation_shape()  # every stage: middle stages receive the new shape
        self.length = length

    def cut(self, batches):
        """The micro-batches ``((tokens, position_ids), (labels, loss_mask))`` cut to the current length."""
        for inputs, labels in batches:
            n = self.length
            yield (tuple(t[:, :n].contiguous() for t in inputs), tuple(t[:, :n].contiguous() for t in labels))
