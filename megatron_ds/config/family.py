"""A model family (GPT, BERT, T5): the one object every floor receives about the model it trains.

Each family lives in its own package (``megatron_ds/families/<name>/``), which builds one
``ModelFamily`` and registers it (``families.get_family("bert")``). The floors below take that
object and read what differs from its fields -- never its name:

- config (``layout.build_layout``, ``memory``): ``check`` (the flag combinations it refuses, a
  ConfigError), ``count_parameters`` (``layout.count_parameters``'s signature and result),
  ``activations`` and ``pipeline_choice`` (the memory estimate and --dry-run's suggestions),
  ``partition_activations``, ``decoder_seq_length``, ``moe_layers``, ``label`` and ``legacy_unnamed``
  (the summary line);
- checkpoint: ``layer_specs`` (what a checkpoint's layer files hold, for the readers),
  ``universal_checkpoints``, ``name`` (written as ``model_family``, checked when reading);
- training: ``build_model(run, ps, eod_token, device, loss_report)`` (this rank's module, whose
  ``loss_fn`` adds its named terms to ``loss_report``), ``build_stage(run, stage, tp_group,
  eod_token)`` (one pipeline stage on the meta device, --dry-run), ``build_datasets(run, tokenizer,
  num_samples, log)`` and ``make_collator(run, tokenizer)`` (samples -> DeepSpeed's ``(inputs,
  labels)`` micro-batch), ``loss_names`` (``"lm loss"`` first), ``flops(layout, seq_length)`` (the
  iteration line's model FLOPs), ``default_tokenizer_type`` and ``uses_eod``.

A floor that is given no family (``None``) runs the GPT, whose terms are that floor's own generic
code: the dense transformer's counts (``layout.count_parameters``), the GPT layer specs
(``model/layer_specs.py``). A checkpoint records its family's name as ``model_family``; one without it
was written by the GPT (``UNRECORDED_FAMILY``), as every checkpoint from before families were recorded.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

# the family of a checkpoint (or a saved signature) without "model_family": pretrain_gpt.py's
UNRECORDED_FAMILY = "gpt"


@dataclass(frozen=True)
class ModelFamily:
    name: str  # pretrain_<name>.py; a checkpoint's "model_family"
    label: str  # how lines and messages name it ("BERT")
    # config: (flags, pipeline size) -> None or ConfigError; (model, padded vocab, tp, pp, partition
    # method, ep=) -> (unique total, per-stage StageParams), as layout.count_parameters
    check: Callable
    count_parameters: Callable
    # training: the builders (module docstring) and (layout, sequence length) -> model FLOPs of one iteration
    build_model: Callable
    build_stage: Callable
    build_datasets: Callable
    make_collator: Callable
    flops: Callable
    # checkpoint: (model, padded vocab, **spec kwargs) -> the pipeline layer specs its checkpoints' files follow
    layer_specs: Callable
    # DeepSpeed's pipeline may split the first activation over TP ranks and send no other gradient:
    # False where more than one tensor between stages needs its gradient (T5's encoder output)
    partition_activations: bool = True
    # (layout, stage) -> (runs of the stage's layers' ``memory.LayerActivations``, bytes of its input/output
    # buffers per micro-batch), for the memory estimate; None: the GPT's (``memory.gpt_stage_activations``)
    activations: Callable | None = None
    # (model, pipeline size) -> (the model at that size, the flags it adds) or None where its layers cannot split
    # so, for --dry-run's suggestions; None: the GPT's (--num-layers divides over the stages, nothing added).
    # A family that has one divides its layers over the stages itself (its ``check`` says where they cannot).
    pipeline_choice: Callable | None = None
    # (flags) -> the decoder's sequence length, for a family with a decoder stack of its own length (T5)
    decoder_seq_length: Callable | None = None
    moe_layers: bool = False  # --num-experts builds mixture-of-experts layers into its model
    # DeepSpeed's universal checkpoints hold it (the parameter patterns of ``checkpoint/universal.py``)
    universal_checkpoints: bool = False
    # runs and checkpoints from before families were named (the GPT's): the layout summary shows no
    # label and the saved signature no "model_family", so both stay as they were
    legacy_unnamed: bool = False
    loss_names: tuple[str, ...] = ()  # the terms its loss reports; () the GPT's (``lm loss``, MoE's terms)
    # --tokenizer-type when the command line names none (Megatron-DeepSpeed's args_defaults of its script)
    default_tokenizer_type: str | None = None
    uses_eod: bool = True  # the model reads the tokenizer's end-of-document id (--reset-attention-mask)
    # a query sees only the keys before it (the planner's time model counts half of the attention
    # scores a fused kernel computes); False for a bidirectional encoder
    causal_attention: bool = True

    def eod_token(self, tokenizer) -> int | None:
        """What the builders get as ``eod_token``: None for a family without documents in a sample
        (a BERT WordPiece tokenizer has no end-of-document token)."""
        return tokenizer.eod if self.uses_eod else None
