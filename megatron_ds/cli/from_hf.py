"""Import a local Hugging Face transformers model directory (safetensors) as a megatron_ds checkpoint,
for continued pretraining at any TP/PP/DP layout: its config.json's ``model_type`` picks the model
family that imports it (GPT-2, Llama 1 to 3.3, Qwen2/2.5, Qwen3, Mistral, DeepSeek-V2/V3, and the MoE models
Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE on Megatron-LM's MoE layer: a checkpoint for pretrain_gpt.py; BERT or Megatron-BERT: pretrain_bert.py; T5: pretrain_t5.py; ``ModelFamily.hf``).

    python tools/checkpoint/from_hf.py --hf-dir HF_DIR --save CHECKPOINT_DIR

It prints the model flags to give pretrain_gpt.py together with ``--load CHECKPOINT_DIR``.
"""
from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hf-dir", required=True, help="local transformers model directory (config.json + safetensors)")
    p.add_argument("--save", required=True, help="checkpoint directory to write")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from megatron_ds.errors import ConfigError  # noqa: PLC0415 - keep --help fast
    from megatron_ds.families import hf_dir_family  # noqa: PLC0415

    try:
        hf_dir_family(args.hf_dir).hf.import_dir(args.hf_dir, args.save)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
