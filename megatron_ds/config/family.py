"""A model family (GPT, BERT, T5): the one object every floor receives about the model it trains.

Each family lives in its own package (``megatron_ds/families/<name>/``), which builds one
``ModelFamily`` and registers it (``families.get_family("bert")``). Every floor that needs the model
is given the family object and reads what differs from its fields -- never its name, and never a
missing family standing for one of them (``tests/test_architecture.py`` checks both):

- config (``layout.build_layout``, ``memory``): ``check`` (the flag combinations it refuses, a
  ConfigError), ``count_parameters``, ``active_parameters`` (mixture of experts), ``activations`` and
  ``pipeline_choice`` (the memory estimate and --dry-run's suggestions), ``partition_activations``,
  ``decoder_seq_length``, ``label`` and ``legacy_unnamed`` (the summary line);
- planner: ``flops``, ``causal_attention``, ``plannable``;
- checkpoint: ``layer_specs`` (what a checkpoint's layer files hold, for the readers), ``tp_split`` and
  ``vocab_parameters`` (how its own layers' parameters split over tensor parallel ranks),
  ``universal_checkpoints``, ``name`` (written as ``model_family``, checked when reading);
- training: ``build_model(run, ps, eod_token, device, loss_report)`` (this rank's module, whose
  ``loss_fn`` adds its named terms to ``loss_report``), ``build_stage(run, stage, tp_group,
  eod_token)`` (one pipeline stage on the meta device, --dry-run), ``build_datasets(run, tokenizer,
  num_samples, log)`` and ``make_collator(run, tokenizer)`` (samples -> DeepSpeed's ``(inputs,
  labels)`` micro-batch), ``loss_names(layout)`` (``"lm loss"`` first), ``flops(layout, seq_length)``
  (the iteration line's model FLOPs), ``default_tokenizer_type`` and ``uses_eod``;
- inference: ``generates`` (generation, perplexity and lm-evaluation-harness run its checkpoints);
- the tools: ``hf`` (the Hugging Face model types it imports and the export), ``evaluation`` (the
  tools/ script that scores its checkpoints), ``quickstart`` (its ``tools/quickstart.py --model``
  steps), ``plannable`` (``tools/plan.py --family``).

A checkpoint records its family's name as ``model_family``, except the family marked
``legacy_unnamed`` (the GPT's, whose checkpoints predate families and stay as they were): a
checkpoint without the field is that family's, ``UNRECORDED_FAMILY`` (the registry checks that the
two agree).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

# the ``model_family`` of a checkpoint (or a saved signature) without one: checkpoints from before
# families were recorded, and the legacy_unnamed family's (pretrain_gpt.py's), which still write none
UNRECORDED_FAMILY = "gpt"


@dataclass(frozen=True)
class HFMapping:
    """A family's Hugging Face transformers conversions (``tools/checkpoint/from_hf.py``, ``to_hf.py``)."""
    # the config.json ``model_type`` s it imports (from_hf.py picks the family by it)
    model_types: tuple[str, ...]
    # (hf_dir, save_dir, log) -> None: a checkpoint of this family from a transformers directory
    import_dir: Callable
    # (load_dir, out_dir, ExportOptions, log=print) -> None: the checkpoint as a transformers directory
    export: Callable
    architectures: str  # what it exports to, for messages ("GPT2LMHeadModel, LlamaForCausalLM ...")


@dataclass(frozen=True)
class ExportOptions:
    """``tools/checkpoint/to_hf.py``'s options; a family's export reads those it supports."""
    iteration: int | None = None
    dtype: str | None = None
    vocab_size: int | None = None
    # the tokenizer files, where they moved since training (None: the checkpoint's record)
    tokenizer_type: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    tokenizer_model: str | None = None
    from_masters: bool = False
    max_shard_bytes: int = 5 * 2**30
    architecture: str | None = None  # the transformers class to write (None: the family's rule)


@dataclass(frozen=True)
class ModelFamily:
    name: str  # pretrain_<name>.py; a checkpoint's "model_family"
    label: str  # how lines and messages name it ("BERT")
    # config: (flags, pipeline size) -> None or ConfigError; (model, padded vocab, tp, pp, partition
    # method, ep=, etp=) -> (unique total, per-stage ``layout.StageParams``)
    check: Callable
    count_parameters: Callable
    # (layout, stage) -> (runs of the stage's layers' ``memory.LayerActivations``, bytes of its input/output
    # buffers per micro-batch), for the memory estimate (``memory.stack_activations``: a plain stack's)
    activations: Callable
    # training: the builders (module docstring) and (layout, sequence length) -> model FLOPs of one iteration
    build_model: Callable
    build_stage: Callable
    build_datasets: Callable
    make_collator: Callable
    flops: Callable
    # checkpoint: (model, padded vocab, **spec kwargs) -> the pipeline layer specs its checkpoints' files follow
    layer_specs: Callable
    # (layout) -> the named terms its loss reports (``model/loss_report.py``), "lm loss" first; () none
    loss_names: Callable = lambda layout: ()
    # DeepSpeed's pipeline may split the first activation over TP ranks and send no other gradient:
    # False where more than one tensor between stages needs its gradient (T5's encoder output)
    partition_activations: bool = True
    # (model, pipeline size) -> (the model at that size, the flags it adds) or None where its layers cannot split
    # so, for --dry-run's suggestions; None: its --num-layers divides over the stages, nothing added. A
    # family that has one divides its layers over the stages itself (its ``check`` says where they cannot).
    pipeline_choice: Callable | None = None
    # (flags) -> the decoder's sequence length, for a family with a decoder stack of its own length (T5)
    decoder_seq_length: Callable | None = None
    # (model, padded vocab) -> the parameters one token goes through, for a family whose --num-experts builds
    # mixture-of-experts layers into its model; None: it builds none (--num-experts is refused)
    active_parameters: Callable | None = None
    # (module name, parameter name) -> the dim its own layers split over tensor parallel ranks, beyond the
    # shared layers' (``checkpoint/tp.py``); of which those with a row per vocabulary entry
    tp_split: Mapping[tuple[str, str], int] = field(default_factory=dict)
    vocab_parameters: tuple[tuple[str, str], ...] = ()
    # DeepSpeed's universal checkpoints hold it (the parameter patterns of ``checkpoint/universal.py``)
    universal_checkpoints: bool = False
    # runs and checkpoints from before families were named (the GPT's): the layout summary shows no
    # label and the saved signature no "model_family", so both stay as they were
    legacy_unnamed: bool = False
    # --tokenizer-type when the command line names none (Megatron-DeepSpeed's args_defaults of its script)
    default_tokenizer_type: str | None = None
    uses_eod: bool = True  # the model reads the tokenizer's end-of-document id (--reset-attention-mask)
    # a query sees only the keys before it (the planner's time model counts half of the attention
    # scores a fused kernel computes); False for a bidirectional encoder
    causal_attention: bool = True
    plannable: bool = True  # tools/plan.py --family <name> plans its layouts
    hf: HFMapping | None = None  # None: no Hugging Face conversion
    evaluation: str | None = None  # the tools/ script that scores its checkpoints ("tools/evaluate.py")
    # a decoder-only language model whose layer specs are an embedding, transformer layers, a final norm and
    # an output layer: what inference/ runs with a KV cache (generation, perplexity, lm-evaluation-harness)
    generates: bool = False
    quickstart: object | None = None  # its tools/quickstart.py --model steps (``families/quickstart_steps.py``)

    def eod_token(self, tokenizer) -> int | None:
        """What the builders get as ``eod_token``: None for a family without documents in a sample
        (a BERT WordPiece tokenizer has no end-of-document token)."""
        return tokenizer.eod if self.uses_eod else None

    @property
    def recorded_name(self) -> str | None:
        """Its ``model_family`` in a checkpoint's meta and signature (None: the field is left out)."""
        return None if self.legacy_unnamed else self.name
