"""Reading the user's DeepSpeed JSON (the only file the config layer reads)."""
from __future__ import annotations

import json
import os

from megatron_ds.config.derive import ConfigError


def load_ds_template(path: str | None) -> dict | None:
    """The DeepSpeed JSON as a dict, or None when no --deepspeed_config was given."""
    if not path:
        return None
    if not os.path.isfile(path):
        raise ConfigError(f"--deepspeed_config {path}: no such file")
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--deepspeed_config {path}: invalid JSON at line {exc.lineno} column {exc.colno}: "
                          f"{exc.msg}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--deepspeed_config {path}: expected a JSON object, got {type(data).__name__}")
    return data
