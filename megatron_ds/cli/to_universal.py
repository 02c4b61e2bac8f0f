"""Convert a megatron_ds checkpoint (ZeRO-1/2, any TP/PP/DP, fp32/bf16/fp16) to a DeepSpeed universal
checkpoint with DeepSpeed's own ``ds_to_universal``, after checking that it can take it.

    python tools/checkpoint/to_universal.py --load CHECKPOINT_DIR [--iteration N] [--workers 4]

writes CHECKPOINT_DIR/global_stepN_universal and CHECKPOINT_DIR/latest_universal; resume at any
layout with ``pretrain_gpt.py ... --load CHECKPOINT_DIR --universal-checkpoint``. The same as
``python -m deepspeed.checkpoint.ds_to_universal --input_folder CHECKPOINT_DIR/global_stepN
--output_folder CHECKPOINT_DIR/global_stepN_universal``, with one-line errors instead of its tracebacks.
"""
from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--load", required=True, help="checkpoint directory (the run's --save)")
    p.add_argument("--iteration", type=int, default=None, help="iteration to convert (default: the tracker's)")
    p.add_argument("--workers", type=int, default=4, help="processes extracting ZeRO fragments (half as many merge)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from megatron_ds.checkpoint.universal import convert  # noqa: PLC0415 - keep --help fast
    from megatron_ds.errors import ConfigError  # noqa: PLC0415
    from megatron_ds.ds_compat import check_deepspeed  # noqa: PLC0415
    from megatron_ds.families import checkpoint_family  # noqa: PLC0415

    try:
        check_deepspeed()  # the universal format is DeepSpeed's internal layout of its files
        out = convert(args.load, args.iteration, workers=args.workers,
                      family=checkpoint_family(args.load, args.iteration))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {out}; resume with: pretrain_gpt.py ... --load {args.load} --universal-checkpoint")
    return 0
