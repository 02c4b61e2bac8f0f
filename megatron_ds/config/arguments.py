"""The command-line parser, generated from the dataclasses in ``schema.py``.

Flag names and meanings are Megatron-DeepSpeed's, so existing launch scripts run unchanged.
Three kinds of foreign flags are handled on purpose rather than by accident:
  * CUDA fusion / performance knobs that make no difference here are accepted, recorded, and
    reported once as a warning (``IGNORED_FLAGS``);
  * features we do not have are rejected with a message saying what to do instead
    (``UNSUPPORTED_FLAGS``) -- silently training something else would be worse;
  * anything else is an argparse error. Abbreviations are disabled so a typo never matches a
    longer flag.
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

from megatron_ds.config.schema import SECTIONS, Config

# flag -> number of values it takes (0 = boolean switch)
IGNORED_FLAGS: dict[str, int] = {
    **{f: 0 for f in (
        "--no-masked-softmax-fusion", "--masked-softmax-fusion",
        "--no-gradient-accumulation-fusion",
        "--no-persist-layer-norm", "--no-async-tensor-model-parallel-allreduce",
        "--use-flash-attn", "--use-flash-attn-v1", "--use-flash-attn-v2", "--use-flash-attn-triton",
        "--apply-query-key-layer-scaling", "--no-query-key-layer-scaling",
        "--attention-softmax-in-fp32", "--accumulate-allreduce-grads-in-fp32",
        "--use-contiguous-buffers-in-local-ddp", "--no-contiguous-buffers-in-local-ddp",
        "--partition-activations", "--contigious-checkpointing", "--contiguous-checkpointing",
        "--checkpoint-in-cpu", "--synchronize-each-layer", "--profile-backward", "--mmap-warmup",
        "--use-cpu-initialization", "--log-num-zeros-in-grad", "--no-scatter-gather-tensors-in-pipeline",
        "--log-optimizer-states-to-tensorboard", "--log-world-size-to-tensorboard",
        "--no-barrier-with-level-1-timing", "--no-log-loss-scale-to-tensorboard", "--use-ring-exchange-p2p",
        "--no-initialization", "--fp16-lm-cross-entropy", "--log-params-norm",
        # Megatron-DeepSpeed only allocates a buffer for it that its DeepSpeed path never uses
        # (megatron/initialize.py _initialize_mem_buffs; the checkpoint call sites pass
        # --distribute-saved-activations / DeepSpeed's partition_activations instead).
        "--distribute-checkpointed-activations",
        # MoE switches, meaningless at --num-experts 1 (the only value accepted; see OFF_VALUE_FLAGS);
        # Megatron-DeepSpeed's dense MoE-family scripts pass them anyway
        "--create-moe-param-group", "--disable-moe-token-dropping",
        "--exit-signal-handler",  # SIGTERM/SIGUSR1 handling is on by default here
    )},
    **{f: 1 for f in (
        "--DDP-impl", "--timing-log-level", "--timing-log-option", "--tensorboard-queue-size",
        "--tensorboard-log-interval",  # scalars are written every --log-interval
        "--ds-inference", "--pipeline-model-parallel-split-rank", "--memory-centric-tiled-linear",
        "--moe-expert-parallel-size", "--moe-loss-coeff", "--moe-train-capacity-factor",
        "--moe-eval-capacity-factor", "--moe-min-capacity",
    )},
}

# flag -> what to do instead
UNSUPPORTED_FLAGS: dict[str, tuple[int, str]] = {
    "--use-distributed-optimizer": (0, "use --zero-stage 1 (DeepSpeed ZeRO shards optimizer state)"),
    "--enable-zbh1-pipeline": (0, "zero-bubble pipeline schedules are not supported (DeepSpeed's pipeline "
                                  "engine runs 1F1B here); drop the flag"),
    "--enable-zbh1-exact-semantics": (0, "zero-bubble pipeline schedules are not supported; drop the flag"),
}

# Megatron-DeepSpeed flags of features we do not have, accepted at the value that turns them off
# (upstream scripts pass it explicitly): flag -> (nargs, off value, what to do instead).
OFF_VALUE_FLAGS: dict[str, tuple[str, str, str]] = {
    "--ds-sequence-parallel-size": ("?", "1", "DeepSpeed-Ulysses sequence parallelism is not supported; use "
                                              "--sequence-parallel with --tensor-model-parallel-size"),
    "--num-experts": ("+", "1", "mixture-of-experts models are not supported"),  # upstream nargs='+', default [1]
}


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
            kind = str
        kwargs["type"] = kind
        if md.get("choices"):
            kwargs["choices"] = md["choices"]
        if default is not None:
            kwargs["help"] = f"{doc} (default: {default})"
    group.add_argument(*flags, **kwargs)


class _Ignored(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        namespace.__dict__.setdefault("_ignored", []).append(option_string)


class _Unsupported(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string}: {UNSUPPORTED_FLAGS[option_string][1]}")


class _OffValue(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        _, off, reason = OFF_VALUE_FLAGS[option_string]
        given = values if isinstance(values, list) else [values]
        if any(v != off for v in given):
            parser.error(f"{option_string} {' '.join(given)}: {reason} ({option_string} {off} is accepted)")


class _Parser(argparse.ArgumentParser):
    """Errors as one line plus a pointer to --help: the full usage of ~150 flags buries the message."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # `--lr -1e-3` must reach the range check (which names the flag) rather than fail as
        # "expected one argument": before Python 3.13, argparse takes -1e-3 for an option.
        self._negative_number_matcher = re.compile(r"^-\.?\d")

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n(see {self.prog} --help)\n")


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
    for flag, (nvals, _) in UNSUPPORTED_FLAGS.items():
        nargs = "*" if nvals < 0 else nvals
        parser.add_argument(flag, action=_Unsupported, nargs=nargs, default=argparse.SUPPRESS,
                            help=argparse.SUPPRESS)
    for flag, (nargs, _, _) in OFF_VALUE_FLAGS.items():
        parser.add_argument(flag, action=_OffValue, nargs=nargs, const="1", default=argparse.SUPPRESS,
                            help=argparse.SUPPRESS)
    return parser


def parse_args(argv=None) -> tuple[Config, list[str]]:
    """Parse a command line into a Config. Returns (config, ignored compatibility flags)."""
    ns = vars(build_parser().parse_args(argv))
    ignored = ns.pop("_ignored", [])
    sections: dict[str, dict] = {name: {} for name in SECTIONS}
    top = {}
    for key, value in ns.items():
        section, _, name = key.rpartition(".")
        (sections[section] if section else top)[name] = value
    return Config(**{name: _section_class(name)(**values) for name, values in sections.items()}, **top), ignored
