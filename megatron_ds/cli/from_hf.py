"""Import a local Hugging Face transformers GPT-2 or Llama model directory (safetensors) as a
megatron_ds checkpoint, for continued pretraining at any TP/PP/DP layout (a BERT or Megatron-BERT
directory: a checkpoint for pretrain_bert.py; a T5 directory: one for pretrain_t5.py).

    python tools/checkpoint/from_hf.py --hf-dir HF_DIR --save CHECKPOINT_DIR

It prints the model flags to give pretrain_gpt.py together with ``--load CHECKPOINT_DIR``.
"""
from __future__ import annotations

import argparse
import os
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hf-dir", required=True, help="local transformers model directory (config.json + safetensors)")
    p.add_argument("--save", required=True, help="checkpoint directory to write")
    return p


def _model_type(hf_dir: str) -> str | None:
    import json  # noqa: PLC0415

    try:
        with open(os.path.join(hf_dir, "config.json")) as f:
            return json.load(f).get("model_type")
    except (OSError, ValueError):
        return None  # import_hf names what is missing


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from megatron_ds.checkpoint.import_hf import import_hf  # noqa: PLC0415 - keep --help fast
    from megatron_ds.errors import ConfigError  # noqa: PLC0415

    try:
        if _model_type(args.hf_dir) == "t5":  # a checkpoint for pretrain_t5.py
            from megatron_ds.families.t5.t5_hf import import_hf_t5  # noqa: PLC0415

            import_hf_t5(args.hf_dir, args.save)
            return 0
        if _model_type(args.hf_dir) in ("bert", "megatron-bert"):  # a checkpoint for pretrain_bert.py
            from megatron_ds.families.bert.bert_hf import import_hf_bert  # noqa: PLC0415

            import_hf_bert(args.hf_dir, args.save)
            return 0
        import_hf(args.hf_dir, args.save)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
