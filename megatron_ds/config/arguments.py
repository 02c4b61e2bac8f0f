"""The command-line parser, generated from the dataclasses in ``schema.py``.

Flag names and meanings are Megatron-DeepSpeed's, so existing launch scripts run unchanged.
Three kinds of foreign flags are handled on purpose rather than by accident:
  * CUDA fusion / performance knobs that make no difference here are accepted, recorded, and
    reported once as a warning (``IGNORED_FLAGS``);
  * features we do not have are rejected with a message saying what to do instead
    (``UNSUPPORTED_FLAGS``) -- silently training something else would be worse;
  * anything else is an argparse error naming the closest known flag (``--num_layers``, ``--num-layer``:
    did you mean --num-layers?). Abbreviations are disabled, as in Megatron-DeepSpeed
    (``argparse.ArgumentParser(..., allow_abbrev=False)`` in megatron/arguments.py parse_args): a
    launch script valid here stays valid there, and a shortened or misspelt flag (``--global-batch``)
    is refused with the full name to use instead of being taken for a longer flag.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import re
import textwrap
import typing
from functools import lru_cache

from megatron_ds.config.megatron_lm_flags import MEGATRON_LM_IGNORED, MEGATRON_LM_REFUSED
from megatron_ds.config.megatron_lm_flags import VALUES as MEGATRON_LM_VALUES
from megatron_ds.config.schema import SECTIONS, Config
from megatron_ds.errors import closest

# flag -> number of values it takes (0 = boolean switch)
IGNORED_FLAGS: dict[str, int] = {
    **{f: 0 for f in (
        "--no-masked-softmax-fusion", "--masked-softmax-fusion",
        "--no-persist-layer-norm",
        "--use-flash-attn", "--use-flash-attn-v1", "--use-flash-attn-v2", "--use-flash-attn-triton",
        "--apply-query-key-layer-scaling", "--no-query-key-layer-scaling",
        "--attention-softmax-in-fp32", "--accumulate-allreduce-grads-in-fp32",
        "--use-contiguous-buffers-in-local-ddp", "--no-contiguous-buffers-in-local-ddp",
        "--partition-activations", "--contigious-checkpointing", "--contiguous-checkpointing",
        "--checkpoint-in-cpu", "--synchronize-each-layer", "--profile-backward", "--mmap-warmup",
        "--use-cpu-initialization", "--log-num-zeros-in-grad",
        "--log-optimizer-states-to-tensorboard", "--log-world-size-to-tensorboard",
        "--no-barrier-with-level-1-timing", "--no-log-loss-scale-to-tensorboard",
        "--disable-log-loss-scale-to-tensorboard", "--use-ring-exchange-p2p",
        "--no-initialization", "--fp16-lm-cross-entropy", "--log-params-norm",
        # Megatron-DeepSpeed only allocates a buffer for it that its DeepSpeed path never uses
        # (megatron/initialize.py _initialize_mem_buffs; the checkpoint call sites pass
        # --distribute-saved-activations / DeepSpeed's partition_activations instead).
        "--distribute-checkpointed-activations",
        "--exit-signal-handler",  # SIGTERM/SIGUSR1 handling is on by default here
    )},
    **{f: 1 for f in (
        "--DDP-impl", "--timing-log-level", "--timing-log-option", "--tensorboard-queue-size",
        "--tensorboard-log-interval",  # scalars are written every --log-interval
    )},
}

# flag -> what to do instead
UNSUPPORTED_FLAGS: dict[str, tuple[int, str]] = {}

# --- the rest of Megatron-DeepSpeed's megatron/arguments.py (deepspeedai/Megatron-DeepSpeed,
# commit 4efb479; tests/config/megatron_flags.py transcribes it). Comments name the upstream file that says so.
_NEVER_READ = "Megatron-DeepSpeed declares it but never reads it"
_KERNEL = "a CUDA kernel choice with no counterpart here"
# flag -> (number of values, why it changes nothing here); reported with the reason (``describe_ignored``)
IGNORED_WITH_REASON: dict[str, tuple[int, str]] = {
    **{f: (0, _NEVER_READ + "; ZeRO settings belong in the DeepSpeed JSON") for f in (
        "--zero-reduce-scatter", "--zero-contigious-gradients", "--use-pin-memory")},
    **{f: (1, _NEVER_READ + "; ZeRO settings belong in the DeepSpeed JSON") for f in (
        "--zero-reduce-bucket-size", "--zero-allgather-bucket-size")},
    "--memory-centric-tiled-linear": (0, _NEVER_READ),  # a switch upstream (store_true)
    "--scattered-embeddings": (0, _NEVER_READ),
    "--tile-factor": (1, _NEVER_READ),
    # megatron/initialize.py: it only doubles num_checkpoints for DeepSpeed's contiguous checkpointing
    "--split-transformers": (0, "only sizes DeepSpeed's contiguous-checkpointing buffers, ignored here too"),
    # deepspeed/moe/sharded_moe.py: Tutel's kernels (an optional package) replace the einsum dispatch and the
    # cumsum of top-1 gating by faster ones computing the same routing; without tutel installed DeepSpeed
    # itself proceeds without them, as it does here
    "--use-tutel": (0, "Tutel's optional top-1 dispatch kernels compute the same routing as DeepSpeed's "
                       "default dispatch, which runs here (tutel is not a dependency)"),
    "--use-flash-attn-builder": (0, _KERNEL + "; attention runs torch SDPA"),
    "--disable-mem-efficient-ln": (0, _KERNEL + ": apex's memory-efficient LayerNorm"),
    "--ds_fused_adam": (0, _KERNEL + "; Adam is apex FusedAdam or torch's fused AdamW, logged at start-up"),
    # megatron/model/transformer.py: onnx_safe picks erf_gelu, x*0.5*(erf(x/1.41421)+1): exact GeLU
    "--onnx-safe": (1, "selects an erf GeLU (x / 1.41421 for x / sqrt 2), the GeLU computed here already"),
    # megatron/text_generation/*: read only by Megatron's generation server, not by training
    **{f: (1, "read only by Megatron's text generation server") for f in (
        "--inference-batch-times-seqlen-threshold", "--max-tokens-to-oom")},
    "--ds-inference": (0, "read only by Megatron's generation scripts; tools/generate_samples_gpt.py here"),
    # megatron/arguments.py: it only skips the model-shape checks for dataset-building tools
    "--use-dataset-only": (1, "only relaxes Megatron's argument checks for dataset-only tools"),
    # read by Megatron's own interleaved schedule, which its DeepSpeed path never runs; no effect on numerics
    "--overlap-p2p-communication": (0, "a communication-overlap knob of Megatron's own pipeline schedule"),
    "--trust-remote-code": (0, "HF tokenizers are read from tokenizer.json here; no repository code runs"),
    "--adlr-autoresume-interval": (1, "read only with --adlr-autoresume, which is refused"),
    # megatron/model/language_model.py casts the table to fp32 for the lookup and the result back: a gather,
    # so the values are the same bf16/fp16 ones
    "--embedding-weights-in-fp32": (0, "an fp32 lookup cast back to bf16/fp16 gives the same embeddings"),
    # megatron/checkpointing.py reads it only without --deepspeed: DeepSpeed's engine always saves the optimizer
    "--no-save-optim": (0, "Megatron-DeepSpeed's DeepSpeed path saves the optimizer state regardless"),
    # megatron/model/transformer.py: it routes attention through DistributedAttention at any size; at
    # --ds-sequence-parallel-size 1 that is the local attention, and above 1 it is used anyway
    "--force-ds-sequence-parallel": (0, "DeepSpeed's DistributedAttention at sequence parallel size 1 is the "
                                        "local attention; above 1 it runs regardless"),
}

_BERT_T5 = "BERT and T5 models are not supported (GPT only): drop the flag"
_FPDT = ("DeepSpeed-Ulysses' FPDT (chunked, offloaded attention) is not supported; plain Ulysses "
         "(--ds-sequence-parallel-size) is")
_INDEX_FILES = "index files are built once and cached under --data-cache-path; drop the flag"
# flag -> (number of values, what to do instead)
REFUSED_FLAGS: dict[str, tuple[int, str]] = {
    "--output-bert-embeddings": (0, _BERT_T5),
    **{f: (1, _BERT_T5) for f in ("--bert-embedder-type", "--retriever-seq-length", "--sample-rate")},
    # megatron/model/transformer.py SwitchMLP: Megatron-LM's own top-1 MoE, every expert on every rank run one
    # after the other, no capacity, no auxiliary loss, no expert parallelism
    "--num-experts-switch": (1, "Megatron's own SwitchMLP is not supported; DeepSpeed-MoE's top-1 gating is: "
                                "--num-experts N --topk 1 (with --expert-interval 1 for every layer)"),
    **{f: (0, _FPDT) for f in ("--ds-sequence-parallel-fpdt", "--ds-sequence-parallel-fpdt-offloading")},
    "--ds-sequence-parallel-fpdt-chunk-size": (1, _FPDT),
    # megatron/arguments.py validate_args asserts these deprecated ones are unset, naming the new flag
    "--batch-size": (1, "no longer valid (as in Megatron-DeepSpeed); use --micro-batch-size"),
    "--warmup": (1, "no longer valid (as in Megatron-DeepSpeed); use --lr-warmup-fraction or --lr-warmup-iters"),
    "--model-parallel-size": (1, "no longer valid (as in Megatron-DeepSpeed); use --tensor-model-parallel-size"),
    "--distribute-saved-activations": (0, "splitting recomputed layers' inputs across tensor parallel ranks is "
                                          "not supported; use --sequence-parallel"),
    "--random-ltd": (0, "random layerwise token dropping (DeepSpeed data efficiency) is not supported; drop it"),
    # megatron/training.py reads the JSON's data_efficiency block under this flag: DeepSpeed's own sampler
    "--data-efficiency-curriculum-learning": (0, "DeepSpeed's data-efficiency curriculum (its own sampler) is not "
                                                 "supported; for a sequence-length warm-up use the JSON's legacy "
                                                 "\"curriculum_learning\" block with --curriculum-learning-legacy"),
    "--inference": (0, "a model without an optimizer is for evaluation: use tools/evaluate.py"),
    "--lazy-mpu-init": (1, "initialisation by an external process-group manager is not supported; drop it"),
    "--standalone-embedding-stage": (0, "not supported; balance stages with --pipeline-partition-method"),
    "--aml-data-download-path": (1, "Azure ML data download is not supported; give full prefixes to --data-path"),
    "--return-data-index": (0, "returning sample indices (data-efficiency analysis) is not supported; drop it"),
    **{f: (1, _INDEX_FILES) for f in ("--train-idx-path", "--train-desc-path", "--train-doc-idx-path",
                                      "--train-sample-idx-path", "--train-shuffle-idx-path")},
    # megatron/arguments.py core_transformer_config_from_args passes TransformerConfig a scaled_init_method
    # it has no field for, so Megatron-DeepSpeed stops at start-up with this flag
    "--init-method-xavier-uniform": (0, "Megatron-DeepSpeed itself fails at start-up with it; use --init-method-std"),
    "--adlr-autoresume": (0, "NVIDIA's ADLR autoresume is not supported; use --exit-duration-in-mins or "
                             "SIGTERM/SIGUSR1 (save and exit)"),
}

# Megatron-DeepSpeed's flags of other model families (megatron/arguments.py _add_retro_args,
# _add_vision_args, _add_biencoder_args and its knowledge-distillation flags): refused naming the family,
# whatever values follow (-1: any number), so that no flag of theirs is unknown here.
_OTHER_FAMILIES = {
    "retrieval-augmented (RETRO) models": (
        "--retro-workdir --retro-add-retriever --retro-cyclic-train-iters --retro-encoder-layers "
        "--retro-encoder-hidden-dropout --retro-encoder-attention-dropout --retro-num-neighbors "
        "--retro-num-retrieved-chunks --retro-return-doc-ids"),
    "biencoder (ICT/ORQA retriever) training": (
        "--ict-head-size --biencoder-projection-dim --biencoder-shared-query-context-model --ict-load --bert-load "
        "--titles-data-path --query-in-block-prob --use-one-sent-docs --evidence-data-path "
        "--retriever-report-topk-accuracies --retriever-score-scaling --block-data-path --embedding-path "
        "--indexer-batch-size --indexer-log-interval"),
    "vision models (ViT, Swin, DINO, inpainting)": (
        "--num-classes --img-h --img-w --num-channels --patch-dim --classes-fraction --data-per-class-fraction "
        "--no-data-sharding --head-lr-mult --vision-pretraining --vision-pretraining-type --vision-backbone-type "
        "--swin-backbone-type --mask-type --mask-factor --iter-per-epoch --dino-local-img-size "
        "--dino-local-crops-number --dino-head-hidden-size --dino-bottleneck-size --dino-freeze-last-layer "
        "--dino-norm-last-layer --dino-warmup-teacher-temp --dino-teacher-temp --dino-warmup-teacher-temp-epochs"),
    "knowledge distillation (teacher models, MoS)": (
        "--num-layers-teacher --num-experts-teacher --hidden-size-teacher --num-attention-heads-teacher --mos --kd "
        "--kd-alpha-ce --kd-beta-ce --kd-temp --reset-iteration --load-teacher"),
}
REFUSED_FLAGS.update({flag: (-1, f"{family} are not part of megatron_ds, which pretrains GPT and Llama-style "
                                 f"models; drop the flag")
                      for family, flags in _OTHER_FAMILIES.items() for flag in flags.split()})

# Flags accepted at the values that mean what megatron_ds does, others refused: flag -> (nargs, the accepted
# values (the first is a bare "?" flag's), what an accepted value means here or None, the refusal) -- Megatron-
# LM's (config/megatron_lm_flags.py) and Megatron-DeepSpeed's features we do not have, at the value that turns
# them off (upstream scripts pass it explicitly)
ACCEPTED_VALUES: dict[str, tuple[int | str, tuple[str, ...], str | None, str]] = {
    **MEGATRON_LM_VALUES,
    # pretrain_gpt.py passes it to deepspeed.zero.Init (ZeRO-3 initialisation on a remote device)
    "--remote-device": ("?", ("none",), None, "ZeRO-3 initialisation on a remote device is not supported; use "
                                              "\"offload_param\" in the DeepSpeed JSON"),
}
# Why each IGNORED_FLAGS flag changes nothing (the rest: a CUDA fusion or performance knob)
_CHECKPOINTING = "a DeepSpeed activation-checkpointing option; recomputation here is torch's checkpoint"
_LOGGING = "a Megatron logging or timer detail not reproduced here"
_OWN_DDP = "configures Megatron's own data parallel wrapper, which its DeepSpeed path replaces by DeepSpeed's engine"
_OWN_P2P = ("torch.distributed.ring_exchange, which only a patched PyTorch has; the pipeline messages here are "
            "isend/irecv pairs (DeepSpeed's engine, pipeline/p2p.py)")
_IGNORED_REASONS: dict[str, str] = {
    **{f: _CHECKPOINTING for f in ("--partition-activations", "--contigious-checkpointing",
                                   "--contiguous-checkpointing", "--checkpoint-in-cpu", "--synchronize-each-layer",
                                   "--profile-backward")},
    **{f: _LOGGING for f in ("--log-params-norm", "--log-num-zeros-in-grad", "--log-optimizer-states-to-tensorboard",
                             "--log-world-size-to-tensorboard", "--no-log-loss-scale-to-tensorboard",
                             "--disable-log-loss-scale-to-tensorboard",
                             "--timing-log-level", "--timing-log-option", "--no-barrier-with-level-1-timing",
                             "--tensorboard-queue-size")},
    **{f: _OWN_DDP for f in ("--DDP-impl", "--use-contiguous-buffers-in-local-ddp",
                             "--no-contiguous-buffers-in-local-ddp", "--accumulate-allreduce-grads-in-fp32")},
    "--use-ring-exchange-p2p": _OWN_P2P,
    "--tensorboard-log-interval": "scalars are written every --log-interval",
    "--exit-signal-handler": "SIGTERM/SIGUSR1 handling is on by default here",
    "--distribute-checkpointed-activations": "Megatron-DeepSpeed only allocates a buffer for it that its DeepSpeed "
                                             "path never uses",
    "--no-initialization": "skips initialising weights that --load then overwrites",
    "--mmap-warmup": "warms the page cache; the samples read are the same",
}
# --- end of the rest of Megatron-DeepSpeed's megatron/arguments.py

@lru_cache(maxsize=None)
def field_docs(cls: type) -> dict[str, str]:
    """Map field name -> the string literal written right under the field (its docstring)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _scalar_type(annotation) -> type:
    """int / float / str / bool / list behind an annotation such as Optional[int]."""
    t = annotation
    if isinstance(t, str):
        t = eval(t, vars(typing))  # annotations are strings under `from __future__ import annotations`
    if typing.get_origin(t) is typing.Union:
        t = next(a for a in typing.get_args(t) if a is not type(None))
    return typing.get_origin(t) or t


def _add_field(group, section: str | None, f: dataclasses.Field, hints: dict, doc: str) -> None:
    md = f.metadata
    dest = f"{section}.{f.name}" if section else f.name
    flags = list(md.get("flags") or ()) or ["--" + f.name.replace("_", "-")]
    kind = _scalar_type(hints[f.name])
    default = f.default if f.default is not dataclasses.MISSING else None
    kwargs = dict(dest=dest, help=doc or None, default=argparse.SUPPRESS)
    if kind is not bool:
        kwargs["metavar"] = f.name.upper()
    if kind is bool:
        kwargs["action"] = "store_false" if md.get("invert") else "store_true"
    else:
        if md.get("nargs"):
            kwargs["nargs"] = md["nargs"]
            if kind is tuple:  # a tuple of ints (frozen, hashable), e.g. --num-experts 8 16
                kwargs["action"] = _StoreTuple
                kind = int
            else:
                kind = str
        kwargs["type"] = kind
        if md.get("choices"):
            kwargs["choices"] = md["choices"]
        if md.get("const") is not None:  # nargs="?": the value of the flag given alone
            kwargs["const"] = md["const"]
        if default is not None:
            shown = " ".join(map(str, default)) if isinstance(default, tuple) else default
            kwargs["help"] = f"{doc} (default: {shown})"
    group.add_argument(*flags, **kwargs)
    if md.get("off_flags"):  # the other half of an Optional[bool] switch (neither given: None)
        group.add_argument(*md["off_flags"], dest=dest, action="store_false", default=argparse.SUPPRESS,
                           help=f"the opposite of {flags[0]}")


class _StoreTuple(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, tuple(values))


class _Ignored(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        namespace.__dict__.setdefault("_ignored", []).append(option_string)


class _Unsupported(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        reason = {**UNSUPPORTED_FLAGS, **REFUSED_FLAGS, **MEGATRON_LM_REFUSED}[option_string][1]
        parser.error(f"{option_string}: {reason}")


class _AcceptedValues(argparse.Action):
    """A flag taken at the values that mean what megatron_ds does (``ACCEPTED_VALUES``)."""

    def __call__(self, parser, namespace, values, option_string=None):
        _, accepted, note, refusal = ACCEPTED_VALUES[option_string]
        given = values if isinstance(values, list) else [values]
        if any(v not in accepted for v in given):
            parser.error(f"{option_string} {' '.join(given)}: {refusal} ({option_string} {' or '.join(accepted)} "
                         f"is accepted)")
        if note is not None:
            namespace.__dict__.setdefault("_ignored", []).append(option_string)


class _Parser(argparse.ArgumentParser):
    """Errors as one line plus a pointer to --help: the full usage of ~150 flags buries the message."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # `--lr -1e-3` must reach the range check (which names the flag) rather than fail as
        # "expected one argument": before Python 3.13, argparse takes -1e-3 for an option.
        self._negative_number_matcher = re.compile(r"^-\.?\d")

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n(see {self.prog} --help)\n")

    def parse_args(self, args=None, namespace=None):
        # argparse's own refusal of unknown arguments, with the flag each one probably meant
        namespace, unknown = self.parse_known_args(args, namespace)
        if unknown:
            self.error(f"unrecognized arguments: {' '.join(unknown)}{self._did_you_mean(unknown)}")
        return namespace

    def _did_you_mean(self, unknown: list[str]) -> str:
        """" (did you mean --num-layers?)" for the flags among ``unknown`` (their values are there too),
        each matched with underscores read as hyphens; "" when none is close to a known flag."""
        known = sorted(s for s in self._option_string_actions if s.startswith("--"))
        hints = []
        for arg in unknown:
            if not arg.startswith("-") or self._negative_number_matcher.match(arg):
                continue
            flag = arg.split("=", 1)[0]
            # compared without the leading dashes: shared by every flag, they would lift unrelated names
            # over the similarity cutoff
            match = closest(flag, known, normalize=lambda s: s.lstrip("-").lower().replace("_", "-"))
            if match is not None:
                hints.append((flag, match))
        if len(hints) == 1:
            return f" (did you mean {hints[0][1]}?)"
        return f" (did you mean {', '.join(f'{m} for {a}' for a, m in hints)}?)" if hints else ""


def _section_class(section: str) -> type:
    return {f.name: f.default_factory for f in dataclasses.fields(Config)}[section]


def build_parser(prog: str = "pretrain_gpt.py") -> argparse.ArgumentParser:
    parser = _Parser(
        prog=prog, allow_abbrev=False,
        description="Train a GPT model with Megatron-style tensor parallelism on DeepSpeed. "
                    "Flags follow Megatron-DeepSpeed.")
    for section in SECTIONS:
        cls = _section_class(section)
        group = parser.add_argument_group(section)
        hints = typing.get_type_hints(cls)
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            _add_field(group, section, f, hints, docs.get(f.name, ""))
    run = parser.add_argument_group("run")
    run.add_argument("--dry-run", dest="dry_run", action="store_true", default=argparse.SUPPRESS,
                     help="Validate flags and print the resolved layout and DeepSpeed JSON without "
                          "starting distributed; exits 0 if the run would start.")
    run.add_argument("--world-size", dest="world_size", type=int, default=argparse.SUPPRESS,
                     help="World size to validate against with --dry-run.")
    run.add_argument("--gpu-memory-gb", dest="gpu_memory_gb", default=argparse.SUPPRESS,
                     help="With --dry-run: the GPU memory to check the per-GPU memory estimate against, "
                          "in GB or as an ABCI resource type (rt_F, rt_AF, rt_HF) or GPU name (v100, h200).")
    compat = parser.add_argument_group("accepted for compatibility (no effect here)")
    for flag, nvals in IGNORED_FLAGS.items():
        compat.add_argument(flag, action=_Ignored, nargs=nvals or 0, default=argparse.SUPPRESS,
                            help=argparse.SUPPRESS)
    for flag, (nvals, _) in IGNORED_WITH_REASON.items():
        compat.add_argument(flag, action=_Ignored, nargs=nvals, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    for flag, (nvals, _) in MEGATRON_LM_IGNORED.items():
        compat.add_argument(flag, action=_Ignored, nargs=nvals, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    for flag, (nvals, _) in {**UNSUPPORTED_FLAGS, **REFUSED_FLAGS}.items():
        nargs = "*" if nvals < 0 else nvals
        parser.add_argument(flag, action=_Unsupported, nargs=nargs, default=argparse.SUPPRESS,
                            help=argparse.SUPPRESS)
    for flag, (nvals, accepted, _, _) in ACCEPTED_VALUES.items():
        parser.add_argument(flag, action=_AcceptedValues, nargs=nvals if nvals != 1 else None, const=accepted[0],
                            default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    for flag in MEGATRON_LM_REFUSED:  # refused whatever follows: the values are never unrecognized arguments
        parser.add_argument(flag, action=_Unsupported, nargs="*", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return parser


def describe_ignored(flags) -> str:
    """The ignored flags with why each changes nothing, for the start-up warning and --dry-run."""
    reasons = {**_IGNORED_REASONS, **{f: why for f, (_, why) in {**IGNORED_WITH_REASON, **MEGATRON_LM_IGNORED}.items()},
               **{f: note for f, (_, _, note, _) in ACCEPTED_VALUES.items() if note}}
    return "; ".join(f"{f} ({reasons.get(f, 'a CUDA fusion or performance knob with no counterpart here')})"
                     for f in flags)


def parse_args(argv=None, prog: str = "pretrain_gpt.py") -> tuple[Config, list[str]]:
    """Parse a command line into a Config. Returns (config, ignored compatibility flags). ``prog``:
    the entry point its error lines name (pretrain_bert.py, pretrain_t5.py)."""
    flags, ignored, _ = parse_args_with(argv, prog)
    return flags, ignored


def parse_args_with(argv=None, prog: str = "pretrain_gpt.py",
                    extra_args_provider=None) -> tuple[Config, list[str], argparse.Namespace]:
    """``parse_args`` with the flags of another entry point too, as Megatron's ``initialize_megatron(
    extra_args_provider=...)``: ``extra_args_provider(parser)`` adds them and returns their dests,
    which come back apart as a Namespace (one parser: a typo of either kind gets the same one-line error)."""
    parser = build_parser(prog)
    # an entry point's own flag wins over a Megatron-LM flag of the same name answered for pretraining
    # (tasks/main.py's --pretrained-checkpoint, Megatron's finetuning flag, is refused for pretrain_gpt.py)
    parser.conflict_handler = "resolve"
    extra_dests = extra_args_provider(parser) if extra_args_provider is not None else ()
    ns = vars(parser.parse_args(argv))
    extra = argparse.Namespace(**{dest: ns.pop(dest) for dest in extra_dests})
    ignored = ns.pop("_ignored", [])
    sections: dict[str, dict] = {name: {} for name in SECTIONS}
    top = {}
    for key, value in ns.items():
        section, _, name = key.rpartition(".")
        (sections[section] if section else top)[name] = value
    flags = Config(**{name: _section_class(name)(**values) for name, values in sections.items()}, **top)
    return flags, ignored, extra
