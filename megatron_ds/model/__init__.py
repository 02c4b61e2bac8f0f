"""The GPT model: tensor parallel transformer layers, and the layer specs that build it as a DeepSpeed
``PipelineModule`` or as one plain module.

    specs/builders  layer_specs.py  gpt_layer_specs, build_pipeline_gpt, build_sequential_gpt
    GPT pieces      gpt.py          embedding, final norm, output head, gpt_loss_fn
    blocks          transformer.py  attention (SDPA, GQA, rope), MLP (GeLU / SwiGLU), layer
    kernels         kernels.py      kernel choice: optional apex norms, SDPA; describe_kernels() for the log
                    fusions.py      compiled bias-GeLU / bias-SwiGLU / bias-dropout-add / RoPE
                    liger.py        liger-kernel's fused linear + cross entropy (optional extra)
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
