#!/usr/bin/env python
"""Generation throughput: new tokens per second with and without the KV cache.

By default a randomly initialized GPT of 4 layers x 256, seq 128, the shape of bench/RESULTS.md's
figures (they do not depend on the weights: decoding runs all max-new-tokens with --no-stop-at-eod
semantics); --load takes a checkpoint instead. Prompts of 32 tokens, greedy, one process; the
device is the GPU when there is one (bf16), else the CPU (fp32).

    python bench/generate.py [--load CKPT] [--new-tokens 96] [--batch-sizes 1 8]
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

from megatron_ds.config.layout import resolve_model_config
from megatron_ds.config.schema import ModelConfig
from megatron_ds.families.gpt.gpt_family import GPT
from megatron_ds.families.gpt.gpt_model import build_sequential_gpt
from megatron_ds.inference.generate import SamplingConfig, generate
from megatron_ds.inference.model import ModelWeights, build_inference_model

SHAPE = dict(num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=128)
PADDED_VOCAB = 4096
PROMPT = 32


def weights_from(args) -> ModelWeights:
    if args.load:
        from megatron_ds.checkpoint import load_consolidated  # noqa: PLC0415

        c = load_consolidated(args.load, log=lambda *a: None, family=GPT)
        return ModelWeights(c.model, c.padded_vocab_size, c.vocab_size, c.state_dict)
    cfg = resolve_model_config(ModelConfig(**SHAPE, hidden_dropout=0.0, attention_dropout=0.0))
    module = build_sequential_gpt(cfg, padded_vocab_size=PADDED_VOCAB, seed=1)
    return ModelWeights(cfg, PADDED_VOCAB, PADDED_VOCAB, module.state_dict())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", default=None)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    weights = weights_from(args)
    new = min(args.new_tokens, weights.model.max_position_embeddings - PROMPT)
    model = build_inference_model(weights, device=device, dtype=dtype, family=GPT)
    m = weights.model
    print(f"GPT {m.num_layers} layers, hidden {m.hidden_size}, vocab {weights.padded_vocab_size}; {device} "
          f"{str(dtype).replace('torch.', '')}, {torch.get_num_threads()} threads; prompt {PROMPT}, {new} new tokens")
    print("| batch | KV cache tokens/s | no cache tokens/s | speed-up |\n|---:|---:|---:|---:|")
    g = torch.Generator().manual_seed(0)
    for b in args.batch_sizes:
        prompts = torch.randint(0, weights.vocab_size or PADDED_VOCAB, (b, PROMPT), generator=g).tolist()
        cfg = SamplingConfig(max_new_tokens=new, greedy=True, stop_at_eod=False)
        generate(model, prompts, dataclasses.replace(cfg, max_new_tokens=4), eod=0)  # warm-up
        cached = generate(model, prompts, cfg, eod=0).tokens_per_second
        plain = generate(model, prompts, dataclasses.replace(cfg, use_cache=False), eod=0).tokens_per_second
        print(f"| {b} | {cached:.1f} | {plain:.1f} | {cached / plain:.1f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
