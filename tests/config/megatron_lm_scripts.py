"""Upstream Megatron-LM's example launch scripts, as their launchers pass the arguments: each script run
by bash with ``torchrun`` replaced by a function printing its arguments (so the scripts' own word splitting
of unquoted array expansions happens as on a cluster: ``--split "'99,1,0'"`` keeps its quotes, a quoted
``--step-batch-size-schedule`` value becomes several words). Only the vocabulary, merges, data, checkpoint,
TensorBoard and cache paths are replaced (test fixtures); the world size is what the script launches.

Sources: NVIDIA/Megatron-LM, tag core_v0.19.0 (commit 5be9626709af2722333bf54797c954c09edeada3):
  examples/llama/train_llama3_8b_h100_fp8.sh (its defaults: DTYPE fp8, MOCK data and tokenizer; 8 GPUs)
  examples/gpt3/train_gpt3_175b_distributed.sh (``bash ... CKPT TB VOCAB MERGES DATA``; 8 GPUs per node,
      TP 8 x PP 16: the layout needs 128, the world size used here)

Imports nothing from megatron_ds.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Script:
    name: str
    world: int
    argv: list
    ds_json: None = None  # no DeepSpeed JSON: Megatron-LM's scripts name none


def scripts(files: dict) -> list[Script]:
    """The scripts' command lines with ``files``' paths (vocab, merges, data, ckpt, tb, cache)."""
    llama3 = [
        '--use-mcore-models', '--num-layers', '32', '--hidden-size', '4096', '--ffn-hidden-size', '14336',
        '--num-attention-heads', '32', '--group-query-attention', '--num-query-groups', '8', '--kv-channels',
        '128', '--seq-length', '8192', '--max-position-embeddings', '8192', '--position-embedding-type',
        'rope', '--rotary-base', '1000000', '--rotary-percent', '1.0', '--attention-dropout', '0.0',
        '--hidden-dropout', '0.0', '--swiglu', '--normalization', 'RMSNorm', '--init-method-std', '0.0134',
        '--attention-backend', 'fused', '--apply-layernorm-1p', '--untie-embeddings-and-output-weights',
        '--disable-bias-linear', '--micro-batch-size', '1', '--global-batch-size', '128', '--train-samples',
        '1953125000', '--lr-decay-samples', '1949218748', '--lr-warmup-samples', '3906252', '--lr', '0.00015',
        '--min-lr', '0.00001', '--decoupled-lr', '5.0e-4', '--decoupled-min-lr', '4.5e-5', '--lr-decay-style',
        'cosine', '--clip-grad', '1.0', '--weight-decay', '0.1', '--adam-beta1', '0.9', '--adam-beta2', '0.95',
        '--bf16', '--grad-reduce-in-bf16', '--cross-entropy-loss-fusion', '--calculate-per-token-loss',
        '--manual-gc', '--empty-unused-memory-level', '1', '--exit-duration-in-mins', '235',
        '--use-distributed-optimizer', '--overlap-grad-reduce', '--overlap-param-gather', '--fp8-format',
        'hybrid', '--fp8-amax-history-len', '1024', '--fp8-amax-compute-algo', 'max', '--fp8-param-gather',
        '--tensor-model-parallel-size', '1', '--context-parallel-size', '1', '--sequence-parallel',
        '--mock-data', '--tokenizer-type', 'NullTokenizer', '--vocab-size', '128256', '--data-cache-path',
        files["cache"], '--tiktoken-pattern', 'v2', '--split', "'99,1,0'",
        '--no-create-attention-mask-in-dataloader', '--no-mmap-bin-files', '--num-workers', '1',
        '--log-interval', '1', '--eval-iters', '32', '--eval-interval', '100', '--save-interval', '1000',
        '--log-throughput', '--profile', '--profile-step-start', '4', '--profile-step-end', '6',
        '--ckpt-format', 'torch_dist', '--distributed-timeout-minutes', '60', '--save', files["ckpt"],
        '--load', files["ckpt"], '--tensorboard-dir', files["tb"],
    ]
    gpt3 = [
        '--num-layers', '96', '--hidden-size', '12288', '--num-attention-heads', '96', '--seq-length', '2048',
        '--max-position-embeddings', '2048', '--attention-backend', 'auto', '--micro-batch-size', '1',
        '--global-batch-size', '1536', '--step-batch-size-schedule', '0:16', '2.4B:320', '4.8B:624',
        '7.2B:928', '9.6B:1232', '12B:1536', '--train-iters', '500000', '--weight-decay', '0.1',
        '--adam-beta1', '0.9', '--adam-beta2', '0.95', '--init-method-std', '0.006', '--clip-grad', '1.0',
        '--fp16', '--lr', '6.0e-5', '--lr-decay-style', 'cosine', '--min-lr', '6.0e-6', '--lr-warmup-fraction',
        '.001', '--lr-decay-iters', '430000', '--tensor-model-parallel-size', '8',
        '--pipeline-model-parallel-size', '16', '--data-path', files["data"], '--vocab-file', files["vocab"],
        '--merge-file', files["merges"], '--split', '949,50,1', '--log-interval', '100', '--save-interval',
        '10000', '--eval-interval', '1000', '--save', files["ckpt"], '--load', files["ckpt"], '--eval-iters',
        '10', '--tensorboard-dir', files["tb"],
    ]
    return [Script("llama3_8b_h100_fp8", 8, llama3), Script("gpt3_175b_distributed", 128, gpt3)]
