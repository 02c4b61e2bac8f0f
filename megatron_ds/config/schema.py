"""The command line's flags as dataclasses: one per concern, the single source of truth for every option.

The command-line parser is generated from these classes (see ``arguments.py``): a field
``num_layers`` becomes ``--num-layers`` and the string literal written under a field is its help
text. ``meta(...)`` adds what the generator cannot infer: other spellings of the flag, choices,
``nargs``, or an inverted boolean (``--no-load-optim`` stores False into ``load_optim``).

They are frozen: what the command line said is never edited. ``megatron_ds.config.run.resolve``
turns them into the one object a run reads (``Run``); Megatron-DeepSpeed's overrides return new
values (``megatron_overrides``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from megatron_ds.data.tiktoken_tokenizers import TIKTOKEN_NUM_SPECIAL_TOKENS


def meta(default: Any = None, *, flags: tuple[str, ...] = (), choices: tuple | None = None,
         nargs: str | None = None, invert: bool = False, off_flags: tuple[str, ...] = (),
         default_factory=None, const: Any = None) -> Any:
    """A dataclass field carrying parser hints (see module docstring). ``off_flags``: an
    ``Optional[bool]`` switch's spellings that store False (``flags`` store True; neither: None)."""
    md = {"flags": flags, "choices": choices, "nargs": nargs, "invert": invert, "off_flags": off_flags, "const": const}
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=md)
    return field(default=default, metadata=md)


@dataclass(frozen=True)
class ModelConfig:
    num_layers: Optional[int] = meta(None, flags=("--num-layers", "--encoder-num-layers"))
    """Number of transformer layers (T5: the encoder's; --encoder-num-layers is its other name)."""
    decoder_num_layers: Optional[int] = None
    """pretrain_t5.py: the decoder's transformer layers (default --num-layers)."""
    hidden_size: Optional[int] = None
    """Transformer hidden size."""
    num_attention_heads: Optional[int] = None
    """Number of attention heads."""
    num_key_value_heads: Optional[int] = None
    """Key/value heads for grouped-query attention (default: --num-attention-heads, i.e. MHA)."""
    group_query_attention: bool = False
    """Megatron-LM: grouped-query attention with --num-query-groups key/value heads (without it, as upstream,
    --num-query-groups is not read)."""
    num_query_groups: Optional[int] = None
    """Megatron-LM: the key/value heads of grouped-query attention (--num-key-value-heads in Megatron-DeepSpeed)."""
    ffn_hidden_size: Optional[int] = None
    """MLP hidden size (default 4*hidden; with --swiglu, 2/3 of that rounded down to a multiple of 64)."""
    kv_channels: Optional[int] = None
    """Per-head projection size (default hidden/heads)."""
    seq_length: Optional[int] = meta(None, flags=("--seq-length", "--encoder-seq-length"))
    """Sequence length of a training sample (T5: the encoder's; --encoder-seq-length is Megatron's
    T5 spelling, which its validate_args copies into --seq-length)."""
    pipeline_model_parallel_split_rank: Optional[int] = None
    """pretrain_t5.py: the first pipeline stage of the decoder; stages before it hold the encoder."""
    max_position_embeddings: Optional[int] = None
    """Size of the learned position table (default --seq-length)."""
    position_embedding_type: str = meta("learned_absolute", choices=("learned_absolute", "rope", "relative", "none"))
    """Position encoding: learned absolute (GPT-2), rope, relative (T5 only: HF T5's bucketed relative
    attention biases, Megatron-LM's --position-embedding-type relative), or none."""
    relative_attention_num_buckets: int = 32
    """--position-embedding-type relative: buckets of relative positions (HF T5Config's default)."""
    relative_attention_max_distance: int = 128
    """--position-embedding-type relative: distance beyond which positions share the last bucket."""
    use_rotary_position_embeddings: bool = False
    """Use rotary position embeddings (same as --position-embedding-type rope)."""
    no_position_embedding: bool = False
    """Do not add learned absolute position embeddings (Megatron-DeepSpeed spelling, used with rope)."""
    rope_theta: float = meta(10000.0, flags=("--rope-theta", "--rotary-base", "--rotary-position-embeddings-theta"))
    """Rotary base frequency."""
    rotary_percent: float = 1.0
    """Fraction of each head's channels that rotary embeddings apply to."""
    use_rope_scaling: bool = False
    """Llama 3.1's RoPE frequency scaling (Megatron-LM's flag; HF rope_scaling type "llama3"): frequencies
    whose wavelength exceeds --rope-scaling-original-max-position-embeddings / low factor are divided by
    --rope-scaling-factor, those under it / high factor kept, those between interpolated smoothly."""
    rope_scaling_factor: float = 8.0
    """--use-rope-scaling: the factor (Megatron-LM's default 8, Llama 3.1's; 32 for Llama 3.2 1B/3B)."""
    rope_scaling_low_freq_factor: float = 1.0
    """--use-rope-scaling: HF's low_freq_factor (Megatron-LM fixes it at Llama 3.1's 1)."""
    rope_scaling_high_freq_factor: float = 4.0
    """--use-rope-scaling: HF's high_freq_factor (Megatron-LM fixes it at Llama 3.1's 4)."""
    rope_scaling_original_max_position_embeddings: int = 8192
    """--use-rope-scaling: HF's original_max_position_embeddings (Megatron-LM fixes it at Llama 3.1's 8192)."""
    rotary_seq_len_interpolation_factor: Optional[float] = None
    """Linear RoPE scaling (HF rope_scaling type "linear"): positions are divided by this factor."""
    add_qkv_bias: bool = False
    """Biases on the query/key/value projection even with --disable-bias-linear (Qwen2 / Qwen2.5)."""
    qk_layernorm: bool = False
    """Normalise each head's query and key (the --normalization kind, one weight of head size shared by
    the heads) before rotary positions (Qwen3)."""
    qk_layernorm_scope: str = meta("head", choices=("head", "projection"))
    """--qk-layernorm over each head's channels (head: Megatron-LM's and Qwen3's) or over the whole query / key
    projection (projection: OLMo 2's and OLMoE's q_norm / k_norm, OLMo-core's use_head_qk_norm false; RMSNorm
    only, its weight split over TP like the projection). Ours: Megatron-LM has no such flag."""
    apply_wd_to_qk_layernorm: bool = False
    """--qk-layernorm: apply weight decay to the query/key norms' weights (Megatron-LM's flag; off: they
    join the no-decay group as the other norms)."""
    window_size: Optional[str] = None
    """Megatron-LM's sliding-window attention "(left,right)" (Mistral: its sliding_window - 1, 0). Accepted
    where the window covers --seq-length (left >= seq - 1 or -1, right 0: it then masks nothing); refused
    otherwise."""
    # -- multi-latent attention (DeepSeek-V2/V3), Megatron-LM's flags and defaults (megatron/training/arguments.py
    # _add_mla_args; the layer is megatron/core/transformer/multi_latent_attention.py MLASelfAttention, ours
    # megatron_ds/model/mla.py)
    multi_latent_attention: bool = False
    """DeepSeek's multi-latent attention (GPT only): queries and keys/values through low-rank latents, plus a
    decoupled rotary key shared by the heads; its own RoPE (--rope-type, YaRN by default) on the
    --qk-pos-emb-head-dim channels. --kv-channels and grouped-query attention are not read."""
    q_lora_rank: Optional[int] = None
    """--multi-latent-attention: rank of the query's latent (None: one plain query projection, DeepSeek-V2-Lite)."""
    kv_lora_rank: int = 32
    """--multi-latent-attention: rank of the keys' and values' shared latent."""
    qk_head_dim: int = 128
    """--multi-latent-attention: query/key channels per head without rotary positions (a head's query is
    --qk-head-dim + --qk-pos-emb-head-dim)."""
    qk_pos_emb_head_dim: int = 64
    """--multi-latent-attention: the rotary query/key channels per head (the rotary key is shared by the heads)."""
    v_head_dim: int = 128
    """--multi-latent-attention: value channels per head."""
    rope_type: Optional[str] = meta(None, choices=("rope", "yarn"))
    """Megatron-LM's RoPE kind of multi-latent attention: yarn (its default) or rope; the other attention
    takes rope only."""
    rotary_scaling_factor: float = 1.0
    """--multi-latent-attention, YaRN: the context-extension factor (DeepSeek-V2/V3: 40)."""
    mscale: float = 1.0
    """--multi-latent-attention, YaRN: mscale of the rotary tables' attention factor."""
    mscale_all_dim: float = 0.0
    """--multi-latent-attention, YaRN: mscale_all_dim; the softmax scale is (0.1 x this x ln(factor) + 1)^2 /
    sqrt(head dim) for a factor > 1."""
    apply_rope_fusion: bool = meta(True, flags=("--no-rope-fusion",), invert=True)
    """Do not compile the rotary embedding's application into one fused kernel (Megatron-LM's flag)."""
    compile_layers: Optional[bool] = meta(None, flags=("--compile-layers",), off_flags=("--no-compile-layers",))
    """Each transformer layer's forward under torch.compile (torchtitan's regional compilation). Neither
    flag: on with CUDA (it took 9 percent off the GPT and Llama-style 1.3B steps on an H200) unless
    --enable-zbh1-pipeline, eager on the CPU (inductor builds C++ at start-up). Graph breaks and
    limits: megatron_ds/model/compile_layers.py."""
    async_tensor_model_parallel_allreduce: Optional[bool] = meta(
        None, flags=("--async-tensor-model-parallel-allreduce",), off_flags=("--no-async-tensor-model-parallel-allreduce",))
    """At TP > 1, overlap the column-parallel layers' input-gradient all-reduce (reduce-scatter under
    --sequence-parallel, after re-gathering the input) with their weight-gradient GEMM
    (megatron_ds/parallel/async_comm.py; Megatron's default). Off unless asked (neither flag, or
    Megatron's --no-async-tensor-model-parallel-allreduce): no GPU measurement has shown it helps
    yet, and layers compiled by torch.compile keep synchronous collectives either way."""
    normalization: str = meta("layernorm", choices=("layernorm", "rmsnorm", "LayerNorm", "RMSNorm"))
    """Normalization layer."""
    layernorm_epsilon: float = meta(1e-5, flags=("--layernorm-epsilon", "--norm-epsilon"))
    """Epsilon of LayerNorm / RMSNorm."""
    swiglu: bool = False
    """SwiGLU MLP instead of GeLU."""
    bias_gelu_fusion: bool = meta(True, flags=("--no-bias-gelu-fusion",), invert=True)
    """Do not fuse the MLP's bias add and GeLU into one compiled kernel."""
    bias_swiglu_fusion: bool = meta(True, flags=("--no-bias-swiglu-fusion",), invert=True)
    """Do not fuse the MLP's bias add and SwiGLU into one compiled kernel."""
    add_bias_linear: bool = meta(True, flags=("--disable-bias-linear",), invert=True)
    """Disable biases in the linear layers (Llama style)."""
    untie_embeddings_and_output_weights: bool = False
    """Separate output projection instead of reusing the input embedding."""
    hidden_dropout: float = 0.1
    """Dropout after attention and MLP."""
    bias_dropout_fusion: bool = meta(True, flags=("--no-bias-dropout-fusion",), invert=True)
    """Do not fuse bias add, dropout and residual add into one compiled kernel."""
    fusions_on_cpu: bool = False
    """Also compile the fusions above when running on the CPU. Off by default: the fused functions
    are compiled (torch.compile) on CUDA only, because inductor builds C++ for each of them in
    every process, which costs a CPU run minutes of start-up for no gain; tests use this."""
    liger_kernel: Optional[bool] = meta(None, flags=("--liger-kernel",), off_flags=("--no-liger-kernel",))
    """Output layer + loss: --liger-kernel uses liger-kernel's fused linear + cross entropy where it
    applies (installed with `pip install megatron_ds[gpu]`, CUDA, tensor parallel size 1, training),
    --no-liger-kernel never. Neither: only where the logits and their gradient would take more than
    15 percent of the GPU's memory (it saves that memory, but ran ~20 percent slower than logits +
    cross entropy for GPT 1.3B, vocabulary 50k, on an H200); the start-up `kernels:` line and
    --dry-run say which."""
    use_z_loss: bool = False
    """PaLM's z-loss, as the Swallow fork of Megatron-LM (okoge-kaz/Megatron-LM) adds it: every loss token's
    cross entropy gains 1e-4 x log(Z)^2, log Z the log-sum-exp of its logits over the vocabulary (the
    coefficient is fixed there too, no flag), in training and validation; reported inside `lm loss`, as
    there. It keeps the softmax normalizer near 1, against logit drift in long bf16 runs. GPT only."""
    attention_dropout: float = 0.1
    """Dropout on attention probabilities."""
    init_method_std: float = 0.02
    """Standard deviation of the normal weight initialization."""
    make_vocab_size_divisible_by: int = 128
    """Pad the vocabulary to a multiple of this times the tensor parallel size (GPU efficiency)."""
    # Megatron-DeepSpeed's model variants (megatron/model/transformer.py)
    openai_gelu: bool = False
    """MLP activation: GeLU's tanh approximation (GPT-2's original "gelu_new") instead of the exact GeLU."""
    squared_relu: bool = False
    """MLP activation: relu(x)^2 instead of GeLU."""
    relu: bool = False
    """MLP activation: relu (the original T5's, HF feed_forward_proj "relu"; T5 only)."""
    geglu: bool = False
    """MLP: gated GeLU, tanh-approximated gate times the up projection (T5 v1.1 / Flan-T5's, HF
    feed_forward_proj "gated-gelu"; a fused [gate; up] projection as --swiglu's; T5 only)."""
    apply_layernorm_1p: bool = False
    """LayerNorm weights centred on zero: the norm multiplies by (1 + weight), weights start at 0."""
    apply_residual_connection_post_layernorm: bool = False
    """Add the residual from each norm's output instead of its input (the original BERT's wiring)."""
    bert_binary_head: bool = meta(True, flags=("--bert-no-binary-head",), invert=True)
    """pretrain_bert.py: no sentence-order (binary) head, no pooler and no token-type embeddings; the
    loss is the masked-LM loss alone (Megatron's --bert-no-binary-head)."""
    fp32_residual_connection: bool = False
    """With --bf16/--fp16: keep the residual stream (the embedding output, every layer's output, what
    crosses pipeline stages) in fp32; norms read it in fp32 and hand their output on in the weights'
    dtype, the branches (attention, MLP) still compute in half precision (Megatron's flag)."""
    # -- mixture of experts, DeepSpeed-MoE as Megatron-DeepSpeed runs it. Defaults and meanings are
    # deepspeedai/Megatron-DeepSpeed megatron/arguments.py (_add_network_size_args, _add_training_args,
    # _add_distributed_args); megatron/model/transformer.py builds deepspeed.moe.layer.MoE from them.
    num_experts: tuple = meta((1,), nargs="+")
    """Experts per MoE layer: one value for every MoE layer, or one per MoE layer (num_layers / --expert-interval
    values); 1 is a dense model (transformer.py get_num_experts_per_layer). Without either family's MoE flags:
    DeepSpeed-MoE with --deepspeed, else Megatron-LM's MoE (top-2 on every layer, docs/moe.md)."""
    expert_interval: int = 2
    """With --num-experts > 1: the MoE layers are those whose 1-based number is a multiple of this (2: every
    second layer, as upstream's default; 1: every layer); the others keep a dense MLP."""
    topk: int = 1
    """Experts each token is routed to: k of DeepSpeed's TopKGate (top-1, top-2, or its general top-k gating)."""
    mlp_type: str = meta("standard", choices=("standard", "residual"))
    """residual: PR-MoE's Residual MoE, a dense MLP beside the experts mixed by a learned 2-way coefficient
    (DeepSpeed MoE(use_residual=True)); standard: the experts alone."""
    moe_train_capacity_factor: float = 1.0
    """Expert capacity in training: tokens an expert takes are at most factor x tokens x k / experts."""
    moe_eval_capacity_factor: float = 1.0
    """Expert capacity in evaluation (as --moe-train-capacity-factor)."""
    moe_min_capacity: int = 4
    """Minimum tokens an expert takes, whatever the capacity factor."""
    moe_loss_coeff: float = 0.1
    """Coefficient of the gates' load-balancing loss added to the language-model loss (pretrain_gpt.py)."""
    disable_moe_token_dropping: bool = False
    """Do not drop tokens beyond an expert's capacity (unlimited capacity; upstream's dest moe_token_dropping)."""
    disable_moe_top2_2nd_expert_sampling: bool = False
    """With --topk 2: take the second expert by argmax instead of sampling it with Gumbel noise (DeepSpeed
    samples by default, in evaluation too)."""
    enable_expert_tensor_parallelism: bool = False
    """Split each expert's MLP across the tensor parallel ranks like the dense MLP (default: every tensor
    parallel rank holds whole experts and DeepSpeed's expert groups span tensor parallel ranks)."""
    # -- mixture of experts, Megatron-LM's (NVIDIA/Megatron-LM core_v0.19.0 megatron/training/arguments.py,
    # transformer_config.py); any of these selects its layer (model/mlm_moe.py, config/moe_selection.py)
    moe_router_topk: Optional[int] = None
    """Megatron-LM's MoE: experts each token is routed to (default 2)."""
    moe_ffn_hidden_size: Optional[int] = None
    """Megatron-LM's MoE: each routed expert's MLP size (default --ffn-hidden-size)."""
    moe_shared_expert_intermediate_size: Optional[int] = None
    """Megatron-LM's MoE: the shared experts' MLP size (all shared experts together), every token goes through."""
    moe_shared_expert_gate: bool = False
    """Megatron-LM's MoE: scale the shared experts' output by sigmoid(gate_weight . x)."""
    moe_layer_freq: Optional[str] = None
    """Megatron-LM's MoE: which layers are MoE layers: N (layers 0, N, 2N, ... counting from 0; default 1, all) or
    a list expression of 0/1 per layer such as "([1]*3+[0]*1)*3"."""
    moe_router_load_balancing_type: Optional[list] = meta(None, nargs="+")
    """Megatron-LM's MoE: aux_loss (Switch/GShard, the default), seq_aux_loss (per sequence, DeepSeek-V2) or none;
    several with one --moe-aux-loss-coeff each; or sinkhorn (S-BASE routing) alone."""
    moe_aux_loss_coeff: Optional[list] = meta(None, nargs="+")
    """Megatron-LM's MoE: the load-balancing loss coefficient(s) (default 0: none)."""
    moe_z_loss_coeff: Optional[float] = None
    """Megatron-LM's MoE: the router z-loss coefficient (ST-MoE; default none)."""
    moe_router_score_function: Optional[str] = meta(None, choices=("softmax", "sigmoid", "sqrtsoftplus"))
    """Megatron-LM's MoE: the router's score function (default softmax)."""
    moe_router_pre_softmax: bool = False
    """Megatron-LM's MoE: softmax over all experts before the top-k (default: softmax over the chosen k)."""
    moe_router_topk_scaling_factor: Optional[float] = None
    """Megatron-LM's MoE: multiply the chosen experts' weights by this."""
    moe_router_num_groups: Optional[int] = None
    """Megatron-LM's MoE: group-limited routing (DeepSeek-V2/V3): the experts split into this many equal groups."""
    moe_router_group_topk: Optional[int] = None
    """Megatron-LM's MoE: group-limited routing: each token's experts come from this many groups, those with the
    largest sums of their top (topk / this) scores."""
    moe_router_enable_expert_bias: bool = False
    """Megatron-LM's MoE: auxiliary-loss-free balancing (DeepSeek-V3): a per-expert bias on the routing scores,
    moved after each step towards the experts that got fewer tokens; needs a sigmoid/sqrtsoftplus score."""
    moe_router_bias_update_rate: Optional[float] = None
    """Megatron-LM's MoE: the expert bias's step per iteration (default 1e-3)."""
    moe_router_dtype: Optional[str] = meta(None, choices=("fp32", "fp64"))
    """Megatron-LM's MoE: compute the router's logits and routing in this precision (default the activations')."""
    moe_expert_capacity_factor: Optional[float] = None
    """Megatron-LM's MoE: each expert takes at most this x tokens x k / experts tokens (default: dropless)."""
    moe_token_drop_policy: Optional[str] = meta(None, choices=("probs", "position"))
    """Megatron-LM's MoE: beyond capacity drop the tokens of lowest probability (probs, the default) or the last."""
    moe_pad_expert_input_to_capacity: bool = False
    """Megatron-LM's MoE: with a capacity factor, every expert computes exactly its capacity (padded)."""
    moe_grouped_gemm: bool = False
    """Megatron-LM's MoE: the experts as one grouped GEMM (torch._grouped_mm on CUDA in bf16); without it, or
    elsewhere, one GEMM per expert, the same products (upstream's SequentialMLP)."""
    moe_token_dispatcher_type: Optional[str] = meta(None, choices=("allgather", "alltoall"))
    """Megatron-LM's MoE: how tokens reach the expert parallel ranks holding their experts (default allgather)."""
    moe_per_layer_logging: bool = False
    """Megatron-LM's MoE: log each MoE layer's balancing and z losses too ("load_balancing_loss layer N" ...)."""
    # -- FP8 (Megatron-DeepSpeed's _add_transformer_engine_args, Megatron-LM's --fp8-format/--fp8-recipe);
    # resolved and checked by config/fp8_flags.py, whose docstring maps each flag to torchao's recipe
    fp8_e4m3: bool = False
    """FP8 GEMMs in the transformer layers' linear layers, every operand E4M3."""
    fp8_hybrid: bool = False
    """FP8 GEMMs in the transformer layers' linear layers, E4M3 forward and E5M2 gradients."""
    fp8_format: Optional[str] = meta(None, choices=("e4m3", "hybrid"))
    """Megatron-LM's spelling of --fp8-e4m3 / --fp8-hybrid."""
    fp8_recipe: Optional[str] = meta(None, choices=("tensorwise", "rowwise", "delayed", "mxfp8", "blockwise"))
    """FP8 scaling: delayed (Transformer Engine's delayed scaling, Megatron-LM's default with --fp8-format),
    tensorwise (current scaling, the default with --fp8-hybrid/--fp8-e4m3), rowwise (one scale per row);
    mxfp8 and blockwise need Transformer Engine and are refused (config/fp8_flags.py)."""
    fp8_margin: Optional[int] = None
    """FP8 scale headroom: scale by 2^-margin below the largest that fits (default 0)."""
    fp8_interval: Optional[int] = None
    """Deprecated in Megatron-DeepSpeed, which ignores it; ignored here too."""
    fp8_amax_history_len: Optional[int] = None
    """Delayed scaling's amax history, in steps (default 1); more than 1 with --fp8-hybrid/--fp8-e4m3 selects
    delayed scaling."""
    fp8_amax_compute_algo: Optional[str] = meta(None, choices=("most_recent", "max"))
    """Delayed scaling's amax from the history: its max, or the most recent (the default)."""
    fp8_param_gather: bool = False
    """Megatron-LM's FP8 parameters, gathered in FP8 (a memory and communication saving): accepted, not made;
    the weights stay bf16/fp32 and are cast to FP8 for each GEMM (docs/fp8.md)."""
    fp8_wgrad: bool = meta(True, flags=("--no-fp8-wgrad", "--disable-fp8-wgrad"), invert=True)
    """--no-fp8-wgrad: the weight-gradient GEMM in bf16/fp32 even in an FP8 run."""

    def __post_init__(self):
        # --num-experts is a tuple of ints however it arrives: the parser's tuple, a checkpoint's saved
        # JSON list, or one int from code
        n = self.num_experts
        object.__setattr__(self, "num_experts", tuple(int(v) for v in (n if isinstance(n, (list, tuple)) else [n])))


@dataclass(frozen=True)
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    """Tensor parallel size (ranks that split each layer)."""
    pipeline_model_parallel_size: int = 1
    """Pipeline parallel size (stages)."""
    num_layers_per_virtual_pipeline_stage: Optional[int] = None
    """Interleaved 1F1B schedule: transformer layers per model chunk; each pipeline rank holds
    num_layers / PP / this many chunks (Megatron's virtual pipeline stages)."""
    virtual_pipeline_model_parallel_size: Optional[int] = meta(
        None, flags=("--virtual-pipeline-model-parallel-size", "--num-virtual-stages-per-pipeline-rank"))
    """Interleaved 1F1B schedule: model chunks per pipeline rank (Megatron-LM's spelling of the above)."""
    enable_zbh1_pipeline: bool = False
    """The ZB-H1 zero-bubble pipeline schedule: weight-gradient passes fill 1F1B's cool-down bubbles."""
    enable_zbh1_exact_semantics: bool = False
    """ZB-H1 splitting every backward of the steady state, so that gradients accumulate in 1F1B's order
    (bit for bit); without it only where needed, and the order changes."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism for LayerNorm/dropout regions (turned off at TP 1, as Megatron)."""
    scatter_gather_tensors_in_pipeline: bool = meta(True, flags=("--no-scatter-gather-tensors-in-pipeline",),
                                                    invert=True)
    """Do not split what crosses a pipeline stage over the tensor parallel ranks. By default, at TP > 1
    each TP rank sends 1/TP of the hidden state (and of its gradient) and the receiving stage all-gathers
    it over its TP ranks, as Megatron-DeepSpeed's megatron/p2p_communication.py (the SC21 paper's
    scatter/gather); DeepSpeed's 1F1B engine does the same ("pipe_partitioned"). Off under --sequence-parallel
    (each TP rank already sends its own sequence shard) and for mixture-of-experts models."""
    ds_sequence_parallel_size: int = 1
    """DeepSpeed-Ulysses: ranks that each hold 1/N of every sequence; attention all-to-alls heads for
    sequence (deepspeed.sequence.layer.DistributedAttention). Needs --no-pipeline-parallel."""
    context_parallel_size: int = 1
    """Megatron-LM's context parallelism: ranks that each hold 2 of the sequence's 2N chunks (chunks i and
    2N-1-i) in every layer; attention exchanges keys and values over them (docs/context-parallel.md)."""
    cp_comm_type: Optional[list] = meta(None, nargs="+", choices=("p2p", "all_gather", "a2a", "a2a+p2p"))
    """How context parallel attention exchanges keys and values: p2p (a ring, Megatron-LM's default) or
    all_gather; one value, or one per layer (all equal here). a2a and a2a+p2p are refused."""
    cp_block_kernel: str = meta("math", choices=("math", "flash"))
    """(ours) The kernel each context parallel attention block runs (parallel/attention_blocks.py): math (the
    explicit fp32 path, the default until a GPU measurement shows flash helps) or flash (torch's fused attention
    operators returning the log-sum-exp: CUDA flash / memory-efficient for fp16 and bf16, the CPU flash operator
    on the CPU)."""
    hierarchical_context_parallel_sizes: Optional[list] = meta(None, nargs="+")
    """Megatron-LM: the sizes of a2a+p2p's two context parallel levels (refused with context parallelism)."""
    no_pipeline_parallel: bool = False
    """Run the model in DeepSpeed's plain engine instead of its pipeline engine (requires PP = 1;
    allows ZeRO 2 and 3)."""
    moe_expert_parallel_size: int = 1
    """Mixture of experts: ranks that split each MoE layer's experts (--num-experts / this experts per rank);
    it divides the data parallel size, and the ranks holding the same experts average their gradients
    (DeepSpeed's expert and expert-data parallel groups)."""
    expert_model_parallel_size: Optional[int] = None
    """Megatron-LM's MoE: data parallel ranks that split each MoE layer's experts (default 1)."""
    expert_tensor_parallel_size: Optional[int] = None
    """Megatron-LM's MoE: tensor parallel ranks each expert is split over (ETP), a divisor of TP; > 1 needs
    --sequence-parallel; ETP x EP divides TP x DP x CP (Megatron-LM's expert grid). Absent: TP, Megatron-LM's
    default."""
    # --pp-partition-method: BigScience's Megatron-DeepSpeed (megatron/arguments.py; GPTModelPipe hands it to
    # PipelineModule as partition_method, default "type:transformer"), the flag of the BLOOM runs
    pipeline_partition_method: str = meta("type:ParallelTransformerLayer",
                                          flags=("--pipeline-partition-method", "--pp-partition-method"))
    """DeepSpeed PipelineModule partition method: uniform, parameters or type:REGEX (balanced layers whose
    class matches; the default balances transformer layers, BLOOM's type:transformer|embedding counts the
    embedding and output layer as layers too), or layers:N1,...,Np (transformer layers per stage)."""
    decoder_first_pipeline_num_layers: Optional[int] = None
    """Transformer layers on the first pipeline stage; the others split evenly over the remaining stages."""
    decoder_last_pipeline_num_layers: Optional[int] = None
    """Transformer layers on the last pipeline stage; the others split evenly over the remaining stages."""
    account_for_embedding_in_pipeline_split: bool = False
    """Count the embedding as a transformer layer of the first stage when splitting layers over the stages."""
    account_for_loss_in_pipeline_split: bool = False
    """Count the output layer and loss as a transformer layer of the last stage when splitting layers."""
    distributed_backend: str = meta(None, choices=("nccl", "gloo", "ccl", "mpi"))
    """torch.distributed backend (default nccl on GPU, gloo on CPU)."""
    distributed_timeout_minutes: float = 10
    """Timeout of collective operations, in minutes (fractions allowed, e.g. 0.5); a rank that never
    arrives ends the run after this long with a line naming the operation."""
    use_mpi: bool = meta(False, flags=("--use-mpi", "--deepspeed_mpi", "--deepspeed-mpi"))
    """Take rank and world size from Open MPI / PMI variables (jobs launched with mpirun)."""
    local_rank: Optional[int] = meta(None, flags=("--local_rank", "--local-rank"))
    """Local rank, passed by the deepspeed launcher."""


@dataclass(frozen=True)
class OptimizerConfig:
    optimizer: str = meta("adam", choices=("adam", "sgd"))
    """Optimizer (adam means AdamW with decoupled weight decay, as Megatron)."""
    lr: Optional[float] = None
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate floor after decay."""
    lr_decay_style: str = meta("linear", choices=("constant", "linear", "cosine", "inverse-square-root", "WSD"))
    """Learning rate decay shape (WSD: warmup, stable at --lr, then decay over the last --lr-wsd-decay-iters)."""
    lr_wsd_decay_style: str = meta("exponential", choices=("exponential", "linear", "cosine", "minus_sqrt"))
    """Megatron-LM: the shape of WSD's final decay from --lr to --min-lr."""
    lr_wsd_decay_iters: Optional[int] = None
    """Megatron-LM: WSD's decay phase, the last iterations of the decay span (iteration-based runs)."""
    lr_wsd_decay_samples: Optional[int] = None
    """Megatron-LM: WSD's decay phase, the last samples of the decay span (with --train-samples)."""
    lr_decay_iters: Optional[int] = None
    """Iterations to decay over (default --train-iters)."""
    lr_decay_samples: Optional[int] = None
    """Samples to decay over (with --train-samples)."""
    lr_warmup_fraction: Optional[float] = None
    """Warmup as a fraction of the decay span."""
    lr_warmup_iters: int = 0
    """Warmup iterations."""
    lr_warmup_samples: int = 0
    """Warmup samples (with --train-samples)."""
    lr_decay_tokens: Optional[int] = None
    """Tokens to decay over; overrides the iteration/sample decay span (Megatron-DeepSpeed)."""
    lr_warmup_tokens: Optional[int] = None
    """Tokens to warm up over; overrides the iteration/sample warmup (Megatron-DeepSpeed)."""
    weight_decay: float = 0.01
    """Decoupled weight decay (not applied to biases and norm weights)."""
    clip_grad: float = 1.0
    """Gradient clipping by global norm (0 disables)."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    sgd_momentum: float = 0.9
    """SGD momentum."""
    # Megatron-DeepSpeed's weight-decay increment (megatron/optimizer_param_scheduler.py)
    start_weight_decay: Optional[float] = None
    """Weight decay at the first iteration, with --weight-decay-incr-style linear or cosine."""
    end_weight_decay: Optional[float] = None
    """Weight decay reached at the end of training, with --weight-decay-incr-style linear or cosine."""
    weight_decay_incr_style: str = meta("constant", choices=("constant", "linear", "cosine"))
    """How weight decay goes from --start-weight-decay to --end-weight-decay (constant: --weight-decay)."""
    override_lr_scheduler: bool = meta(False, flags=("--override-lr-scheduler", "--override-opt_param-scheduler",
                                                        "--override-opt-param-scheduler"))
    """On load, use the command line's schedule instead of the checkpoint's."""
    use_checkpoint_lr_scheduler: bool = meta(False, flags=("--use-checkpoint-lr-scheduler",
                                                          "--use-checkpoint-opt_param-scheduler",
                                                          "--use-checkpoint-opt-param-scheduler"))
    """On load, take the schedule from the checkpoint even if the command line differs."""
    # -- the CPU optimizer of ZeRO-Offload (Megatron-DeepSpeed's flags) --
    cpu_optimizer: bool = False
    """ZeRO-Offload's optimizer, as Megatron-DeepSpeed builds it: DeepSpeedCPUAdam (AdamW on the CPU). The
    offload itself is the DeepSpeed JSON's "zero_optimization": {"offload_optimizer": {"device": "cpu"}}."""
    cpu_torch_adam: bool = meta(False, flags=("--cpu_torch_adam",))
    """With --cpu-optimizer: torch.optim.AdamW instead of DeepSpeedCPUAdam (the JSON then needs
    "zero_force_ds_cpu_optimizer": false)."""
    decoupled_lr: Optional[float] = None
    """Megatron-LM's flag: the peak learning rate of the input embedding and the output layer weights
    (the word embedding, tied or not, and the untied output layer; not the position table), which follow
    the same warmup and decay as the other parameters between it and --decoupled-min-lr. Default: --lr."""
    decoupled_min_lr: Optional[float] = None
    """Megatron-LM's flag: the floor of --decoupled-lr's decay (default --min-lr). Needs --decoupled-lr."""
    # MoE optimizer groups, as megatron/optimizer/__init__.py get_megatron_optimizer makes them
    create_moe_param_group: bool = False
    """Put expert parameters in optimizer groups of their own (deepspeed.moe.utils.
    split_params_into_different_moe_groups_for_optimizer), as DeepSpeed's ZeRO optimizer needs for MoE."""


@dataclass(frozen=True)
class TrainingConfig:
    micro_batch_size: Optional[int] = None
    """Samples per micro-batch per data parallel rank."""
    global_batch_size: Optional[int] = None
    """Samples per optimizer step over all data parallel ranks (default micro * DP)."""
    rampup_batch_size: Optional[list] = meta(None, nargs="*")
    """Batch-size ramp-up `START INCREMENT SAMPLES`: start at global batch START and grow by INCREMENT
    in equal sample intervals until --global-batch-size is reached after SAMPLES samples (Megatron)."""
    step_batch_size_schedule: Optional[list] = meta(None, nargs="+")
    """Megatron-LM: a step-wise global batch size, `THRESHOLD:BATCH ...` (thresholds in tokens, suffixes K M
    B T; the first 0): each batch size from the step at which that many tokens were consumed. Instead of
    --global-batch-size (the last batch size is the run's). Given quoted or split into words alike."""
    train_iters: Optional[int] = None
    """Optimizer steps to train for."""
    train_samples: Optional[int] = None
    """Samples to train for (alternative to --train-iters)."""
    train_tokens: Optional[int] = None
    """Stop once this many tokens are consumed (with --train-samples/--train-iters as a cap)."""
    gradient_accumulation_fusion: Optional[bool] = meta(
        None, flags=("--gradient-accumulation-fusion",), off_flags=("--no-gradient-accumulation-fusion",))
    """The tensor-parallel linear layers' weight-gradient GEMMs add their fp32 result straight into
    DeepSpeed's fp32 gradient of the weight instead of writing a 16-bit .grad that DeepSpeed adds in
    after (Megatron's default, into its main_grad; megatron_ds/parallel/weight_grad.py). Applies where
    DeepSpeed keeps fp32 gradients: --bf16 with ZeRO 1 and "grad_accum_dtype": "fp32"
    (ds_configs/zero1_bf16.json). Off unless asked (neither flag, or Megatron's
    --no-gradient-accumulation-fusion): no GPU measurement has shown it helps yet."""
    exit_interval: Optional[int] = None
    """Save (if --save) and exit when the iteration is a multiple of this."""
    exit_duration_in_mins: Optional[float] = None
    """Save (if --save) and exit once this many minutes have passed (keep it under the walltime)."""
    exit_signal_handler: bool = meta(True, flags=("--no-exit-signal-handler",), invert=True)
    """Do not handle SIGTERM/SIGUSR1/SIGUSR2 (by default the first one finishes the iteration, saves and
    exits 0; a second one exits at once)."""
    eval_interval: int = 1000
    """Run validation every this many iterations."""
    eval_iters: int = 100
    """Micro-batch steps (global batches) per validation; 0 or -1 (Megatron-LM's spelling): no validation or
    test passes."""
    skip_train: bool = False
    """Only evaluate."""
    seed: int = 1234
    """Random seed (data order, initialization, dropout)."""
    fp16: bool = False
    """fp16 mixed precision with dynamic loss scaling (GPU only)."""
    bf16: bool = False
    """bf16 mixed precision."""
    loss_scale: Optional[float] = None
    """Static loss scale for fp16 (default: the JSON's, else dynamic)."""
    initial_loss_scale: Optional[float] = None
    """Initial dynamic loss scale (default: the JSON's, else 2^32)."""
    min_loss_scale: Optional[float] = None
    """Minimum dynamic loss scale (default: the JSON's, else 1)."""
    loss_scale_window: Optional[int] = None
    """Steps without overflow before the loss scale grows (default: the JSON's, else 1000)."""
    hysteresis: Optional[int] = None
    """Overflows tolerated before the loss scale shrinks (default: the JSON's, else 2)."""
    checkpoint_activations: bool = False
    """Recompute each transformer layer in backward (same as --recompute-granularity full)."""
    recompute_granularity: Optional[str] = meta(None, choices=("full", "selective"))
    """Activation recomputation: full layers, or selective (attention core only)."""
    recompute_method: str = meta("uniform", choices=("uniform",))
    """How recomputed layers are grouped: uniform chunks of --recompute-num-layers (Megatron's
    "block" method is not supported)."""
    activations_checkpoint_method: Optional[str] = meta(None, choices=("uniform",))
    """Old Megatron-LM name of --recompute-method; as there, setting it turns on full recomputation."""
    recompute_num_layers: int = meta(1, flags=("--recompute-num-layers", "--checkpoint-num-layers",
                                               "--activations-checkpoint-num-layers"))
    """Layers per recomputed chunk."""
    deepspeed_activation_checkpointing: bool = False
    """Megatron-DeepSpeed flag; our checkpointing already restores RNG state, so this only implies
    --checkpoint-activations."""
    max_consecutive_nan_iters: int = 20
    """Stop the run after this many NaN/inf losses in a row."""
    empty_unused_memory_level: int = 0
    """Release cached accelerator memory: 0 never, 1 after each step, 2 also after validation."""
    # -- curriculum learning (Megatron-DeepSpeed's flag) --
    curriculum_learning_legacy: bool = False
    """Sequence-length warm-up from the DeepSpeed JSON's legacy "curriculum_learning" block (whose
    "enabled" decides when present, as in Megatron-DeepSpeed)."""
    # more of Megatron-DeepSpeed's flags (megatron/arguments.py: training, network size, initialization)
    recompute_activations: bool = False
    """Megatron's switch for selective recomputation (same as --recompute-granularity selective)."""
    kill_switch_file: Optional[str] = None
    """When this file exists (checked after every iteration, agreed across ranks), save (if --save) and
    exit 0; a run started while it exists exits at once."""
    calculate_per_token_loss: bool = False
    """Megatron-LM's flag: the language-model loss is the sum of the token losses over the loss tokens of
    the whole global batch (every micro-batch, every data parallel rank) instead of the mean of each
    micro-batch's own token mean; the gradients and the reported `lm loss` (training and validation) both.
    Differs from the default where the micro-batches keep different numbers of loss tokens (--eod-mask-loss,
    masked data). Costs one scalar all-reduce per step. GPT without MoE or DeepSpeed-Ulysses."""
    data_parallel_random_init: bool = False
    """A random seed per data parallel rank (dropout differs across them; initial weights are still
    data parallel rank 0's, which DeepSpeed's engine broadcasts); checkpoints keep every rank's RNG state."""
    # Megatron-LM's garbage-collection switches (megatron/training/config/training_config.py TrainingConfig;
    # megatron/training/training.py train() and post_training_step_callbacks)
    manual_gc: bool = False
    """Turn Python's automatic garbage collector off for training and collect by hand, at the same points
    on every rank (a collection on one rank stalls the others at the next collective): once before the
    first iteration, every --manual-gc-interval iterations, and around each validation (Megatron-LM's flag)."""
    manual_gc_interval: int = 0
    """With --manual-gc: run gc.collect() after every this many training iterations (0: never between
    iterations, only before training and around validation)."""
    manual_gc_eval: bool = meta(True, flags=("--no-manual-gc-eval", "--disable-manual-gc-eval"), invert=True)
    """With --manual-gc: no collection around validation (by default a full one before each validation
    during training and a young-generation one after it)."""


@dataclass(frozen=True)
class DataConfig:
    data_path: Optional[list] = meta(None, nargs="*")
    """Data prefixes, optionally weighted: `PREFIX` or `W1 PREFIX1 W2 PREFIX2 ...`."""
    split: str = "969, 30, 1"
    """Train/valid/test proportions of documents, e.g. 949,50,1."""
    train_data_path: Optional[list] = meta(None, nargs="*")
    """Separate train data (overrides --data-path/--split)."""
    valid_data_path: Optional[list] = meta(None, nargs="*")
    """Separate validation data."""
    test_data_path: Optional[list] = meta(None, nargs="*")
    """Separate test data."""
    data_cache_path: Optional[str] = None
    """Where sample-index caches go (default: beside the data)."""
    data_impl: str = meta("mmap", choices=("mmap", "infer", "lazy", "cached"))
    """Indexed dataset implementation; only mmap exists (Megatron's default)."""
    mock_data: bool = False
    """Synthetic random tokens instead of files (benchmarks, smoke tests)."""
    num_workers: int = 2
    """Data loader worker processes."""
    tokenizer_type: Optional[str] = None
    """Tokenizer the data was preprocessed with: GPT2BPETokenizer, SentencePieceTokenizer,
    GPTSentencePieceTokenizer, Llama2Tokenizer, HuggingFaceTokenizer (or HFTokenizer), TikTokenizer,
    Llama3Tokenizer (Meta's tiktoken tokenizer.model), NullTokenizer or JapaneseSentencePiece (the
    SentencePiece tokenizer of ABCI users' forks) (default GPT2BPETokenizer, the args_defaults of
    Megatron-DeepSpeed's pretrain_gpt.py; --mock-data alone needs none). docs/data.md lists their BOS/EOS."""
    vocab_file: Optional[str] = None
    """GPT-2 vocab.json; for JapaneseSentencePiece, the SentencePiece model."""
    merge_file: Optional[str] = None
    """GPT-2 merges.txt."""
    tokenizer_model: Optional[str] = None
    """SentencePiece model, HF tokenizer.json / directory, TikTokenizer's JSON vocabulary or Llama 3's
    tiktoken tokenizer.model."""
    tiktoken_pattern: Optional[str] = meta(None, choices=("v1", "v2"))
    """TikTokenizer's pre-tokenization regex: Megatron-LM's v1 or v2 (default v2)."""
    tiktoken_num_special_tokens: int = TIKTOKEN_NUM_SPECIAL_TOKENS
    """TikTokenizer's special-token ids 0..N-1 (--tokenizer-special-tokens, then `<SPECIAL_i>` fillers)."""
    tokenizer_special_tokens: Optional[list] = meta(None, nargs="+")
    """TikTokenizer's special tokens (ids in order); must include `<unk> <s> </s> <mask> <pad> <cls>
    <sep>` (the default list)."""
    tokenizer_hf_no_include_special_tokens: bool = False
    """HuggingFaceTokenizer: encode without the tokenizer's special tokens (no BOS from Llama 3's
    files) and decode dropping them."""
    vocab_size: Optional[int] = None
    """Vocabulary size for NullTokenizer / --mock-data; TikTokenizer's (default 131072)."""
    eod_mask_loss: bool = False
    """Do not compute loss on end-of-document tokens."""
    reset_position_ids: bool = False
    """Restart position ids after each end-of-document token."""
    reset_attention_mask: bool = False
    """Stop attention across end-of-document tokens."""
    # Megatron-DeepSpeed's sampler choice (megatron/data/data_samplers.py)
    dataloader_type: str = meta("single", choices=("single", "cyclic"))
    """Sampler: single (sequential over the shuffled samples, Megatron's default) or cyclic (a new
    permutation of each data parallel rank's share every epoch, going round for as long as training runs)."""
    repeated_dataloader: bool = False
    """Start each data loader again when it runs out (DeepSpeed's RepeatingLoader), instead of ending."""
    train_data_exact_num_epochs: Optional[int] = None
    """Build the training samples from exactly this many epochs of the train split (instead of the fewest
    that hold --train-iters x global batch samples); with 1, pair it with --repeated-dataloader."""


@dataclass(frozen=True)
class CheckpointConfig:
    save: Optional[str] = None
    """Directory to save checkpoints to."""
    load: Optional[str] = None
    """Directory to load the latest checkpoint from."""
    save_interval: Optional[int] = meta(None, flags=("--save-interval", "--persistent-save-interval"))
    """Save every this many iterations."""
    load_optim: bool = meta(True, flags=("--no-load-optim",), invert=True)
    """Do not load optimizer state."""
    load_rng: bool = meta(True, flags=("--no-load-rng",), invert=True)
    """Do not load RNG state."""
    load_lr_state: bool = meta(True, flags=("--no-load-lr-state",), invert=True)
    """Do not load the learning-rate schedule's state (start this run's schedule afresh)."""
    save_rng: bool = meta(True, flags=("--no-save-rng",), invert=True)
    """Do not save RNG state."""
    finetune: bool = False
    """Load weights only and start from iteration 0 (implies --no-load-optim --no-load-rng)."""
    universal_checkpoint: bool = False
    """--load holds a DeepSpeed universal checkpoint (ds_to_universal's output, found through
    DIR/latest_universal), ours or Megatron-DeepSpeed's; loaded at any TP/PP/DP/ZeRO 0-2/precision."""
    ckpt_step: Optional[int] = None
    """Load exactly this iteration's checkpoint from --load (an error if it is damaged) instead of the
    newest complete one (Megatron-LM's --ckpt-step)."""
    keep_last: Optional[int] = None
    """After each complete save, once its weights gave a finite loss (the next iteration, or the run's end),
    delete complete checkpoints in --save older than the newest N."""
    allow_vocab_change: bool = False
    """Load a --load checkpoint trained with another tokenizer (ours; loading refuses one otherwise):
    its embedding and output rows are resized to this tokenizer's vocabulary, new rows starting at the
    mean of the saved ones."""
    # Megatron-DeepSpeed's other checkpoint flags (megatron/arguments.py _add_checkpointing_args)
    load_tag: Optional[str] = None
    """Load this checkpoint directory of --load (global_stepN, as DeepSpeed names them; same as --ckpt-step N)."""
    exit_on_missing_checkpoint: bool = False
    """If --load holds no checkpoint (a path typo), exit instead of training from scratch."""
    pretrained_checkpoint: Optional[str] = None
    """Megatron-LM's: where --load holds no checkpoint (no latest_checkpointed_iteration.txt), start from this
    one's weights as --finetune does (iteration 0, no optimizer or RNG state); once the run has saved into
    --load, the same command resumes from there. Continual pretraining's resubmittable job: --load and
    --save the run's directory, --pretrained-checkpoint the imported model."""
    use_checkpoint_args: bool = False
    """Take the model shape, tokenizer type and parallel sizes from the flags the --load checkpoint was
    saved with (as Megatron's load_args_from_checkpoint: sizes fill unset flags, switches and parallel sizes win)."""
    # Megatron-LM's (megatron/training/arguments.py, core_v0.19.0)
    async_save: bool = False
    """Write checkpoints in a background process while training goes on (Megatron-LM's flag): training
    waits only while the state is copied to host memory; the files, their CRCs and fsync are written in
    the background, the manifest and tracker once every rank's writer has finished (checked at each
    iteration, waited for before the next save and at exit). Same guarantees as a synchronous save."""
    use_persistent_ckpt_worker: bool = False
    """With --async-save: one background writer process for the whole run instead of one per save
    (Megatron-LM's flag)."""


@dataclass(frozen=True)
class LoggingConfig:
    log_interval: int = 100
    """Print the iteration line every this many iterations."""
    tensorboard_dir: Optional[str] = None
    """Write TensorBoard scalars here."""
    log_validation_ppl_to_tensorboard: bool = False
    """Also write validation perplexity to TensorBoard."""
    log_memory_to_tensorboard: bool = False
    """Also write peak memory to TensorBoard."""
    log_batch_size_to_tensorboard: bool = False
    """Also write the global batch size to TensorBoard."""
    log_timers_to_tensorboard: bool = False
    """Also write iteration time to TensorBoard."""
    # Megatron-DeepSpeed's profiler flags (megatron/profiler.py)
    profile: Optional[str] = meta(None, choices=("pt", "pt-full", "window"), nargs="?", const="window")
    """Record torch profiler traces of --profile_steps into --tensorboard-dir (pt-full: with Python stacks).
    Given alone (Megatron-LM's switch; "window"): the torch profiler over the steps from --profile-step-start
    to --profile-step-end instead."""
    profile_step_start: int = 10
    """Megatron-LM: with --profile alone, the iteration at which profiling starts: the step after it is the first
    traced (megatron/training/training.py: iterations [start, end) before their step)."""
    profile_step_end: int = 12
    """Megatron-LM: with --profile alone, the iteration at which profiling stops (the last traced step)."""
    profile_steps: str = meta("2,3", flags=("--profile_steps",))
    """`FIRST,LAST`: the training steps of this process to profile, counted from 1, both included."""
    profile_ranks: Optional[list] = meta(None, nargs="+")
    """Global ranks that record a trace (default: all)."""
    log_learning_rate_to_tensorboard: bool = meta(True, flags=("--no-log-learnig-rate-to-tensorboard",), invert=True)
    """Do not write the learning rate to TensorBoard (Megatron-DeepSpeed's spelling, typo included)."""
    wandb_project: Optional[str] = None
    """Weights & Biases project: log the TensorBoard scalars there too (needs `pip install wandb`;
    WANDB_MODE=offline on nodes without internet, `wandb sync` later)."""
    wandb_exp_name: Optional[str] = meta(None, flags=("--wandb-exp-name", "--wandb-name"))
    """Weights & Biases run name."""
    wandb_entity: Optional[str] = None
    """Weights & Biases entity (user or team)."""
    wandb_save_dir: Optional[str] = None
    """Directory for W&B's local run files (default: ./wandb)."""
    # Megatron-LM's logging flags (megatron/training/config/training_config.py LoggerConfig, read by
    # megatron/training/training.py training_log and save_checkpoint_and_time, initialize.py setup_logging)
    log_throughput: bool = False
    """Add Megatron-LM's `throughput per GPU (TFLOP/s/GPU): X |` to the iteration line, after the time per
    iteration (model FLOPs of the iteration / its time / GPUs, the value of the line's `TFLOP/s per GPU`)."""
    log_progress: bool = False
    """Append Megatron-LM's progress log to --save/progress.txt: a `Starting job` line per job and, after each
    checkpoint, the job's and the cumulative TFLOP/s per GPU, the model FLOPs and tokens trained so far."""
    logging_level: Optional[int] = None
    """Level of Python's logging (10 DEBUG, 20 INFO, 30 WARNING, ...) for the root logger and megatron_ds's
    loggers, whose records go to stdout (INFO and below) and stderr (default 20, or the environment
    variable MEGATRON_LOGGING_LEVEL, as Megatron-LM)."""
    # Megatron-LM's straggler detector (megatron/training/config/resilience_config.py
    # StragglerDetectionConfig; megatron/core/utils.py StragglerDetector)
    log_straggler: bool = False
    """Every --log-interval iterations, rank 0 logs the ranks with the shortest and longest forward time
    per iteration and the lowest and highest estimated TFLOP/s (Megatron-LM's straggler report)."""
    disable_straggler_on_startup: bool = False
    """With --log-straggler: start with the report off; a connection to --straggler-ctrlr-port turns it on."""
    straggler_ctrlr_port: int = 65535
    """With --log-straggler: rank 0 listens on this TCP port; each connection (`curl HOST:PORT`) switches
    the report on or off at the next --log-interval."""
    straggler_minmax_count: int = 1
    """With --log-straggler: above 1 (and below the world size), also list this many ranks with the lowest
    and the highest estimated TFLOP/s."""


@dataclass(frozen=True)
class DeepSpeedConfig:
    deepspeed: bool = False
    """Use DeepSpeed (always on here; accepted for script compatibility)."""
    deepspeed_config: Optional[str] = meta(None, flags=("--deepspeed_config", "--deepspeed-config",
                                                        "--deepscale_config"))
    """DeepSpeed JSON: ZeRO, buckets, loss-scale knobs. Batch sizes and precision come from the
    command line."""
    zero_stage: Optional[int] = meta(None, choices=(0, 1, 2, 3))
    """ZeRO stage (default: the JSON's, else 0; with Megatron-LM's --use-distributed-optimizer 1)."""
    # Megatron-LM's data parallel flags (megatron/training/arguments.py, core_v0.19.0), read as DeepSpeed's
    # (config/layout.py ``engine_from_megatron_lm``); a Megatron-DeepSpeed command line (--deepspeed) ignores them
    use_distributed_optimizer: bool = False
    """Megatron-LM: shard the optimizer state over the data parallel ranks, i.e. ZeRO stage 1 (fp32 main
    weights and gradients, as Megatron keeps them) unless --zero-stage or the JSON names a stage of 1 or more.
    Megatron-DeepSpeed's DeepSpeed path does not read it."""
    overlap_grad_reduce: bool = False
    """Megatron-LM: overlap the gradient reduction with the backward pass: DeepSpeed's "overlap_comm" (ZeRO 1-3)."""
    overlap_param_gather: bool = False
    """Megatron-LM: overlap the updated parameters' all-gather with the next forward: DeepSpeed's "overlap_comm"
    prefetch at ZeRO 3; at ZeRO 1/2 DeepSpeed gathers them at the end of the step (the same values)."""
    ddp_bucket_size: Optional[int] = None
    """Megatron-LM: elements per gradient-reduction bucket: DeepSpeed's "reduce_bucket_size"."""
    grad_reduce_in_bf16: bool = False
    """Megatron-LM: with --bf16, accumulate and reduce gradients in bf16 (DeepSpeed's "grad_accum_dtype" and
    "communication_data_type" bf16) instead of Megatron-LM's default fp32."""
    use_megatron_fsdp: bool = False
    """Megatron-LM's FSDP: DeepSpeed ZeRO at the stage --data-parallel-sharding-strategy names (default 3)."""
    data_parallel_sharding_strategy: Optional[str] = meta(None, choices=("no_shard", "optim", "optim_grads",
                                                                          "optim_grads_params"))
    """With --use-megatron-fsdp: what is sharded: no_shard (ZeRO 0), optim (1), optim_grads (2),
    optim_grads_params (3, Megatron-LM's default)."""


@dataclass(frozen=True)
class MaskedLMDataConfig:
    """BERT / T5 samples (Megatron-DeepSpeed's megatron/arguments.py _add_data_args; read by its
    megatron/data/bert_dataset.py and t5_dataset.py through pretrain_bert.py / pretrain_t5.py)."""

    mask_prob: float = 0.15
    """Fraction of a sample's tokens to mask (BERT: by [MASK] 8 times in 10, kept 1 in 10, a random
    token 1 in 10; T5: whole spans, each replaced by one sentinel)."""
    short_seq_prob: float = 0.1
    """Probability that a sample's target length is drawn at random in [2, max] instead of the maximum."""
    vocab_extra_ids: int = 0
    """T5 sentinel tokens <extra_id_0>.. added to a BERT WordPiece vocabulary (T5 uses 100)."""
    decoder_seq_length: Optional[int] = None
    """T5 decoder sequence length (the encoder's is --seq-length / --encoder-seq-length)."""


@dataclass(frozen=True)
class Config:
    """Every flag of the command line, grouped by concern (``parse_args``'s result)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    masked_lm: MaskedLMDataConfig = field(default_factory=MaskedLMDataConfig)
    dry_run: bool = False
    world_size: Optional[int] = None
    gpu_memory_gb: Optional[str] = None  # --dry-run: GB, an ABCI resource type or a GPU name

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


SECTIONS = ("model", "parallel", "optimizer", "training", "data", "checkpoint", "logging", "deepspeed", "masked_lm")
