"""Weights & Biases logging of the same scalars as TensorBoard (optional: `pip install wandb`).

Megatron-DeepSpeed semantics (megatron/global_vars.py ``_set_wandb_writer``): only the last rank logs
(it holds the losses); W&B is on when --wandb-project or --wandb-exp-name/--wandb-name is given;
the local run files go to --wandb-save-dir, else ``--save``/wandb; a missing wandb package is a
warning, not an error. Compute nodes without internet: ``WANDB_MODE=offline`` writes the run to
that directory and ``wandb sync DIR/wandb/offline-run-*`` uploads it later.
"""
from __future__ import annotations

import math
import os
import sys


class WandB:
    """A wandb run on the logging rank, or nothing."""

    def __init__(self, *, project: str | None, name: str | None, entity: str | None, save_dir: str | None,
                 checkpoint_dir: str | None, enabled_rank: bool, config: dict):
        self.run = None
        if not enabled_rank or not (project or name):
            return
        try:
            import wandb  # noqa: PLC0415 - optional dependency
        except ImportError:
            print("WARNING: --wandb-project/--wandb-name given but wandb is not installed "
                  "(pip install wandb); not logging to W&B", file=sys.stderr, flush=True)
            return
        directory = save_dir or (os.path.join(checkpoint_dir, "wandb") if checkpoint_dir else os.getcwd())
        os.makedirs(directory, exist_ok=True)
        self.run = wandb.init(project=project or None, name=name or None, entity=entity or None, dir=directory,
                              config=config)
        print(f"> logging to W&B run {self.run.name!r} (mode {os.environ.get('WANDB_MODE', 'online')}, "
              f"files in {directory})", flush=True)

    def scalars(self, step: int, values: dict) -> None:
        if self.run is None:
            return
        finite = {k: v for k, v in values.items() if v is not None and math.isfinite(v)}
        if finite:
            self.run.log(finite, step=step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


class ScalarWriters:
    """Fan the loop's scalars out to every writer (TensorBoard, W&B): same keys, same steps."""

    def __init__(self, *writers):
        self.writers = writers

    def scalars(self, step: int, values: dict) -> None:
        for writer in self.writers:
            writer.scalars(step, values)

    def close(self) -> None:
        for writer in self.writers:
            writer.close()
