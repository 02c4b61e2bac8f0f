"""Model building blocks every model family builds from: tensor parallel transformer layers, the
language model's embedding, final norm, output layer and loss, MoE layers, and the pipeline modules
that turn a family's layer specs into a DeepSpeed ``PipelineModule`` or one plain module. The
families' own models (the GPT, BERT, T5) are in ``megatron_ds.families``.

    pipeline modules pipeline_model.py  PipelineModel, SequentialModel, stage_of_specs: any layer specs
    language model  language_model.py  embedding, final norm, output layer, language_model_loss
    blocks          transformer.py  attention (SDPA, GQA), MLP (GeLU / SwiGLU), the layer
                    rotary.py       rotary position embeddings (Megatron/Llama "rotate half")
                    norms.py        LayerNorm / RMSNorm, apex's kernels when importable
                    moe_layer.py    DeepSpeed's MoE layer around the expert MLP, which layers hold experts
                    mlm_moe.py      Megatron-LM's MoE layer: router, grouped experts, token dispatch
    kernels         kernels.py      kernel choice: optional apex norms, SDPA; describe_kernels() for the log
                    fusions.py      compiled bias-GeLU / bias-SwiGLU / bias-dropout-add / RoPE
                    liger.py        liger-kernel's fused linear + cross entropy (optional extra)
                    compile_layers.py  --compile-layers: each layer's forward under torch.compile
    inference       kv_cache.py     keys/values of earlier positions for incremental decoding
    loss            loss_report.py  named scalars a loss function reports next to the loss
    optimizer       param_groups.py which parameters decay (shared with the checkpoint readers)

The model chunks of the interleaved schedule are in ``megatron_ds.pipeline.chunks``.
"""
from megatron_ds.model.kernels import describe_kernels
from megatron_ds.model.language_model import document_ids, language_model_loss
from megatron_ds.model.pipeline_model import PARTITION_METHOD, PipelineModel, SequentialModel
from megatron_ds.model.transformer import ParallelTransformerLayer

__all__ = ["PARTITION_METHOD", "PipelineModel", "SequentialModel", "ParallelTransformerLayer", "describe_kernels",
           "document_ids", "language_model_loss"]
