"""Model building blocks: tensor parallel transformer layers, the GPT built from them, MoE layers,
and the layer specs that turn a model into a DeepSpeed ``PipelineModule`` or one plain module.
The families' own models (BERT, T5, in ``megatron_ds.families``) are built from these pieces.

    specs/builders  layer_specs.py  gpt_layer_specs, build_pipeline_gpt, build_sequential_gpt
    GPT pieces      gpt.py          embedding, final norm, output head, gpt_loss_fn
    blocks          transformer.py  attention (SDPA, GQA), MLP (GeLU / SwiGLU), the layer
                    rotary.py       rotary position embeddings (Megatron/Llama "rotate half")
                    norms.py        LayerNorm / RMSNorm, apex's kernels when importable
                    moe.py          DeepSpeed's MoE layer around the expert MLP, which layers hold experts
    kernels         kernels.py      kernel choice: optional apex norms, SDPA; describe_kernels() for the log
                    fusions.py      compiled bias-GeLU / bias-SwiGLU / bias-dropout-add / RoPE
                    liger.py        liger-kernel's fused linear + cross entropy (optional extra)
                    compile_layers.py  --compile-layers: each layer's forward under torch.compile
    inference       kv_cache.py     keys/values of earlier positions for incremental decoding
    loss            loss_report.py  named scalars a loss function reports next to the loss
    optimizer       param_groups.py which parameters decay (shared with the checkpoint readers)

The model chunks of the interleaved schedule are in ``megatron_ds.pipeline.chunks``.
"""
from megatron_ds.model.gpt import document_ids, gpt_loss_fn
from megatron_ds.model.kernels import describe_kernels
from megatron_ds.model.layer_specs import (PARTITION_METHOD, GPTPipelineModel, GPTSequential, build_pipeline_gpt,
                                           build_sequential_gpt, gpt_layer_specs)
from megatron_ds.model.transformer import ParallelTransformerLayer

__all__ = ["PARTITION_METHOD", "GPTPipelineModel", "GPTSequential", "ParallelTransformerLayer", "build_pipeline_gpt",
           "build_sequential_gpt", "describe_kernels", "document_ids", "gpt_layer_specs", "gpt_loss_fn"]
