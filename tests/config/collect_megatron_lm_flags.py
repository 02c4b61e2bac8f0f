"""Writes tests/config/megatron_lm_flags.py: every flag of upstream Megatron-LM's parser, collected by
running it (``megatron.training.arguments.add_megatron_arguments``): most of its flags are generated from
dataclasses (``ArgumentGroupFactory`` over TransformerConfig, CheckpointConfig, LoggerConfig ...), so a
grep of ``add_argument`` finds only half of them.

    python -m tests.config.collect_megatron_lm_flags MEGATRON_LM_CHECKOUT COMMIT > tests/config/megatron_lm_flags.py

Optional imports the parser's modules make (triton, Transformer Engine ...) are replaced by empty modules,
and ``typing.override`` (Python 3.12) by a pass-through: only the parser is built, nothing runs.
"""
from __future__ import annotations

import argparse
import os
import sys
import types
import typing
from unittest import mock

# a value a launch script passes with flags whose type is one of Megatron-LM's own parsers
_SPECIAL_VALUES = {"tuple_type": "128,0", "moe_freq_type": "1", "no_rope_freq_type": "4",
                   "la_freq_type": "1", "_parse_cuda_graph_modules_arg": "attn",
                   "enum_type_handler": None}


class _Absent(types.ModuleType):
    def __init__(self, name):
        super().__init__(name)
        self.__path__ = []

    def __getattr__(self, key):
        if key == "__version__":
            return "99.0.0"
        if key.startswith("__"):
            raise AttributeError(key)
        return mock.MagicMock(name=f"{self.__name__}.{key}")


def megatron_lm_parser(checkout: str) -> argparse.ArgumentParser:
    sys.path.insert(0, checkout)
    if not hasattr(typing, "override"):
        typing.override = lambda f: f
    for _ in range(100):
        try:
            from megatron.training.arguments import add_megatron_arguments  # noqa: PLC0415
            break
        except ModuleNotFoundError as exc:
            if exc.name.startswith("megatron"):
                raise
            for name in [n for n in sys.modules if n.startswith("megatron")]:
                del sys.modules[name]
            parts = exc.name.split(".")
            for i in range(1, len(parts) + 1):
                sys.modules[".".join(parts[:i])] = _Absent(".".join(parts[:i]))
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_megatron_arguments(parser)
    return parser


def _value(action: argparse.Action) -> tuple[str, ...]:
    if action.nargs == 0:
        return ()
    type_name = getattr(action.type, "__name__", "")
    if action.choices:
        names = [getattr(c, "name", str(c)) for c in action.choices]
        default = getattr(action.default, "name", action.default)
        return (str(default) if str(default) in names else names[0],)
    if type_name in _SPECIAL_VALUES:
        return (_SPECIAL_VALUES[type_name],)
    if type_name == "int":
        return (str(action.default) if isinstance(action.default, int) and action.default > 0 else "2",)
    if type_name == "float":
        return (str(action.default) if isinstance(action.default, float) and action.default > 0 else "0.5",)
    return ("x",)


def main(checkout: str, commit: str) -> None:
    parser = megatron_lm_parser(checkout)
    rows = []
    for group in parser._action_groups:
        for action in group._group_actions:
            if not action.option_strings or "--help" in action.option_strings:
                continue
            rows.append((group.title, tuple(action.option_strings), _value(action)))
    print(f'''"""Upstream Megatron-LM's command-line flags (NVIDIA/Megatron-LM, tag core_v0.19.0, commit {commit}),
collected by running its parser (tests/config/collect_megatron_lm_flags.py): {len(rows)} rows, each
(its argument group, the flag and its aliases, a value a launch script passes with it: none for switches,
the default where it is one, else one of its choices or one its type parses). Imports nothing.
"""
from __future__ import annotations

COMMIT = "{commit}"

FLAGS: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (''')
    for group, flags, values in rows:
        print(f"    ({group!r}, {flags!r}, {values!r}),")
    print(")")


if __name__ == "__main__":
    main(os.path.abspath(sys.argv[1]), sys.argv[2])
