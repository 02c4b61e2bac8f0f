"""Export a megatron_ds checkpoint (any TP/PP/DP/ZeRO/precision) to a Hugging Face transformers
directory, by the model family that wrote it (``ModelFamily.hf``): GPT2LMHeadModel for GPT-2-style
models; for RoPE + SwiGLU + RMSNorm the class the checkpoint was imported from where it can express the
model, else Qwen3ForCausalLM with --qk-layernorm, Qwen2ForCausalLM with --add-qkv-bias alone,
MistralForCausalLM with --window-size, LlamaForCausalLM otherwise (--architecture chooses);
Megatron-LM's MoE layers as DeepseekV2/V3ForCausalLM (with --multi-latent-attention), Qwen2MoeForCausalLM (a
shared expert), Qwen3MoeForCausalLM (--qk-layernorm), OlmoeForCausalLM (--qk-layernorm-scope projection) or
MixtralForCausalLM, DeepSpeed-MoE's as MixtralForCausalLM;
DeepseekV3ForCausalLM with --multi-latent-attention (dense layers);
pretrain_bert.py's BERT as MegatronBertForPreTraining (BertForPreTraining with
--apply-residual-connection-post-layernorm); pretrain_t5.py's T5 as T5ForConditionalGeneration (the
variant HF's T5 computes: no absolute positions, RMS norms, no biases; others are refused). Options a
family's export does not take (BERT and T5: the tokenizer files but their vocab.txt, --from-fp32-masters,
the shard size) change nothing there.

    python tools/checkpoint/to_hf.py --load CHECKPOINT_DIR --out HF_DIR [--iteration N] [--dtype bf16]
        [--from-fp32-masters] [--architecture Qwen2ForCausalLM]

Then ``transformers.AutoModelForCausalLM.from_pretrained(HF_DIR)`` and ``AutoTokenizer`` load it.
"""
from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--load", required=True, help="checkpoint directory (the run's --save)")
    p.add_argument("--out", required=True, help="output directory for the transformers model")
    p.add_argument("--iteration", type=int, default=None, help="iteration to export (default: the tracker's)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None,
                   help="weight dtype (default: the training precision)")
    p.add_argument("--from-fp32-masters", action="store_true",
                   help="export the optimizer's fp32 master weights instead of the module's weights (bf16/fp16 "
                        "runs: more precise, e.g. with --dtype fp32; needs the optimizer files)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="real vocabulary size, for older checkpoints that do not record it")
    p.add_argument("--tokenizer-type", default=None,
                   help="the tokenizer the run trained with, for checkpoints that do not record it (e.g. trained "
                        "on --mock-data); with its files below")
    p.add_argument("--vocab-file", default=None, help="GPT-2 vocab.json, if it moved since training")
    p.add_argument("--merge-file", default=None, help="GPT-2 merges.txt, if it moved since training")
    p.add_argument("--tokenizer-model", default=None, help="SentencePiece model / tokenizer.json, if it moved")
    p.add_argument("--max-shard-size-gb", type=float, default=5.0, help="largest safetensors file")
    p.add_argument("--architecture", default=None,
                   help="GPT family: the transformers class to write (e.g. MistralForCausalLM for a Llama-style "
                        "model); refused naming what it cannot express (default: see above)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from megatron_ds.config.family import ExportOptions  # noqa: PLC0415 - keep --help fast
    from megatron_ds.errors import ConfigError  # noqa: PLC0415
    from megatron_ds.families import checkpoint_family  # noqa: PLC0415

    options = ExportOptions(iteration=args.iteration, dtype=args.dtype, vocab_size=args.vocab_size,
                            tokenizer_type=args.tokenizer_type, vocab_file=args.vocab_file, merge_file=args.merge_file,
                            tokenizer_model=args.tokenizer_model, from_masters=args.from_fp32_masters,
                            max_shard_bytes=int(args.max_shard_size_gb * 2**30), architecture=args.architecture)
    try:
        family = checkpoint_family(args.load, args.iteration)
        if family.hf is None:
            raise ConfigError(f"{args.load} holds a {family.label} model, which has no Hugging Face export")
        family.hf.export(args.load, args.out, options)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except ImportError as exc:
        print(f"error: {exc}; the export needs transformers (pip install 'megatron_ds[hf]')", file=sys.stderr)
        return 1
    return 0
