"""Per-GPU memory estimate of a layout, so an out-of-memory layout fails before the queue.

``estimate_memory(layout)`` adds up, for the pipeline stage that needs the most, the bytes one GPU
holds: weights, gradients and optimizer states (by precision and ZeRO stage, following what
DeepSpeed's optimizer wrappers allocate), activations (by recompute setting and micro batch, times
the micro-batches a 1F1B pipeline keeps in flight), the vocabulary-parallel logits and cross
entropy, DeepSpeed's communication buckets and a runtime reserve. ``check_memory`` compares the
total with the GPU's memory and, when it does not fit, raises a ``ConfigError`` naming the biggest
term and the single changes (TP, PP, recompute, ZeRO, micro batch) that would fit.

What a stage's layers keep comes from the model family (``ModelFamily.activations``): a plain
stack of transformer layers' ``stack_activations`` below (the GPT's), BERT's (the same layers, plus its
MLM head) in ``families/bert/bert_params.py``, T5's (encoder and decoder layers at their own lengths, cross-attention,
the encoder output on decoder stages) in ``families/t5/t5_params.py``.

Pure arithmetic on the ``Layout``: ``pretrain_gpt.py --dry-run`` runs it on a login node.
Sizes are decimal GB (1e9 bytes), as GPU memory is sold ("V100 16 GB"), which keeps the comparison
on the safe side of the real capacity (16 GiB = 17.2 GB).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import math
from dataclasses import dataclass

from megatron_ds.config.deepspeed_json import grad_accum_bytes
from megatron_ds.config.layout import Layout
from megatron_ds.config.moe_selection import is_mlm_moe
from megatron_ds.config.moe_params import expert_data_parallel_size, model_experts
from megatron_ds.config.schema import ParallelConfig
from megatron_ds.errors import ConfigError
from megatron_ds.parallel.chunked_cross_entropy import CHUNK_ELEMENTS
from megatron_ds.parallel.partition import EXPLICIT
from megatron_ds.parallel.utils import pad_vocab_size

GB = 1e9

# GPU memory per device, GB, by ABCI resource type and by GPU name (--gpu-memory-gb accepts either).
# ABCI 2.0: rt_F/rt_G.* are V100 16 GB nodes, rt_AF/rt_AG.small A100 40 GB; ABCI 3.0: rt_HF/rt_HG
# H200 141 GB (https://docs.abci.ai/v3/en/job-execution/ "Available Resource Types";
# https://docs.abci.ai/en/job-execution/ for ABCI 2.0).
GPU_MEMORY_GB = {
    "rt_F": 16, "rt_G.large": 16, "rt_G.small": 16, "rt_AF": 40, "rt_AG.small": 40,
    "rt_HF": 141, "rt_HG": 141,
    "v100": 16, "a100": 40, "a100-80": 80, "h100": 80, "h200": 141,
}

# CUDA context, NCCL's buffers and the caching allocator's fragmentation: none of it is a tensor
# the terms above count. A fixed part (context + NCCL, ~1 GB in practice) and a share of the rest.
RESERVE_FIXED_BYTES = int(1.5 * GB)
RESERVE_FRACTION = 0.05

# Bytes per logit element on the last stage (tests/config/test_memory.py measures what is saved).
# fp32: the reference vocab-parallel cross entropy (parallel/cross_entropy.py) holds the logits, a
# shifted copy and exp() (turned into the softmax kept for backward) at once. bf16/fp16: the chunked
# one (parallel/chunked_cross_entropy.py) keeps only the half-precision logits, and backward makes
# their gradient while they are alive; its fp32 chunks (a copy, exp, a gradient) are a fixed extra.
LOGIT_BYTES_FP32 = 4 + 4 + 4
LOGIT_BYTES_HALF = 2 + 2
CHUNK_BYTES = 3 * CHUNK_ELEMENTS * 4


def _liger_installed() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def logits_bytes(layout: Layout) -> float:
    """The last stage's output layer and loss beyond the hidden states, one micro-batch.

    Where liger-kernel's fused linear + cross entropy runs (model/liger.py: installed, tensor
    parallel size 1, chosen by ``choose_fused_loss``, weights not ZeRO-3 partitions; on the GPU) no [tokens, vocab]
    tensor exists: it computes the gradients during forward a chunk of about tokens*h logits at a
    time (bf16, upcast to fp32 inside), keeping the input's gradient and the weight's (model dtype)."""
    m = layout.model
    # the output layer's length: the decoder's for T5
    tokens = (layout.decoder_seq_length or m.seq_length) // (layout.sp * layout.cp) * layout.micro_batch_size
    vocab = layout.padded_vocab_size / layout.tp
    if layout.tp == 1 and m.liger_kernel and layout.zero_stage != 3 and _liger_installed():
        act_bytes = 4 if layout.precision == "fp32" else 2
        return tokens * m.hidden_size * (act_bytes + 4 + act_bytes) + vocab * m.hidden_size * act_bytes
    return unfused_logits_bytes(layout)


def unfused_logits_bytes(layout: Layout) -> float:
    """``logits_bytes`` of the logits + vocab-parallel cross entropy path: the [tokens, vocab / TP]
    logits and their gradient (and the fp32 chunks or copies the cross entropy adds)."""
    tokens = (layout.decoder_seq_length or layout.model.seq_length) // (layout.sp * layout.cp) * layout.micro_batch_size
    vocab = layout.padded_vocab_size / layout.tp
    if layout.precision == "fp32":
        return tokens * vocab * LOGIT_BYTES_FP32
    return tokens * vocab * LOGIT_BYTES_HALF + min(CHUNK_BYTES, tokens * vocab * 4 * 3)


# liger-kernel's fused linear + cross entropy (model/liger.py) only where the logits would take more
# than this share of a GPU: it never materialises them, but recomputes the projection a chunk at a
# time and ran ~20% slower per iteration than logits + cross entropy at GPT 1.3B (vocabulary 50k,
# hidden 2048, micro batch 4, seq 2048: logits 1.6 GB) on an H200; it pays where the logits crowd
# out the activations (large micro batch x seq x vocabulary on a small GPU).
FUSED_LOSS_SHARE = 0.15
# The GPU a choice is made for when neither the device nor --gpu-memory-gb says (a --dry-run on a
# login node): ABCI 3.0's H200.
ASSUMED_GPU = "h200"


def choose_fused_loss(layout: Layout, gpu_bytes: float | None) -> tuple[bool, str]:
    """(use liger's fused linear + cross entropy, why) for this layout on a GPU of ``gpu_bytes``
    (None: ``ASSUMED_GPU``): as --liger-kernel / --no-liger-kernel say, else by ``FUSED_LOSS_SHARE``."""
    asked = layout.model.liger_kernel
    if layout.model.use_z_loss:  # the vocab-parallel cross entropy adds it; liger's fused loss here does not
        if asked:
            raise ConfigError("--liger-kernel with --use-z-loss: the z-loss is added by the vocab-parallel cross "
                              "entropy, not by liger's fused loss; drop --liger-kernel")
        return False, "--use-z-loss (the vocab-parallel cross entropy adds the z-loss)"
    if asked is not None:
        return asked, "--liger-kernel" if asked else "--no-liger-kernel"
    gpu = f"{gpu_bytes / GB:.0f} GB" if gpu_bytes else f"{GPU_MEMORY_GB[ASSUMED_GPU]} GB ({ASSUMED_GPU}, assumed)"
    gpu_bytes = gpu_bytes or GPU_MEMORY_GB[ASSUMED_GPU] * GB
    logits = unfused_logits_bytes(layout)
    share = logits / gpu_bytes
    fused = share > FUSED_LOSS_SHARE
    return fused, (f"logits + cross entropy {logits / GB:.1f} GB = {100 * share:.1f}% of {gpu} "
                   f"{'>' if fused else '<='} {100 * FUSED_LOSS_SHARE:.0f}%")


def gpu_memory_bytes(value: str | float | None) -> float | None:
    """--gpu-memory-gb: a number of GB, a resource type (rt_HF) or a GPU name (h200)."""
    if value is None or value == "":
        return None
    key = str(value).strip()
    if key.lower() in GPU_MEMORY_GB or key in GPU_MEMORY_GB:
        return GPU_MEMORY_GB.get(key, GPU_MEMORY_GB.get(key.lower())) * GB
    try:
        gb = float(key)
    except ValueError:
        raise ConfigError(f"--gpu-memory-gb {value}: give GB (e.g. 40), an ABCI resource type "
                          f"or a GPU name ({', '.join(sorted(GPU_MEMORY_GB))})") from None
    if gb <= 0:
        raise ConfigError(f"--gpu-memory-gb {value} must be positive")
    return gb * GB


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of one tensor-parallel shard: replicated on every DP rank or split over
    DP (ZeRO); ``transient`` parts exist only between backward and the optimizer step."""
    weights: float
    weights_split: float = 0.0
    grads: float = 0.0
    grads_split: float = 0.0
    grads_transient: float = 0.0
    grads_transient_split: float = 0.0
    optimizer: float = 0.0
    optimizer_split: float = 0.0
    optimizer_path: str = ""
    # of the transient gradients, those that exist during backward (from the first micro-batch's
    # backward on); the rest (fp32 copies and partitions for the step) only from its end
    grads_backward: float = 0.0
    grads_backward_split: float = 0.0


def state_bytes(layout: Layout) -> StateBytes:
    """Which DeepSpeed optimizer wrapper this layout gets and what it allocates per parameter.

    The choice follows DeepSpeed's ``engine._do_optimizer_sanity_check`` (0.19): ZeRO 1 with bf16
    weights and fp32 gradient accumulation, or bf16 in the pipeline engine without ZeRO, uses
    ``BF16_Optimizer``; other ZeRO stages ``DeepSpeedZeroOptimizer`` (stage 1/2) or stage 3; fp16
    (and bf16 outside the pipeline engine) without ZeRO ``FP16_Optimizer``; fp32 without ZeRO the
    bare torch optimizer. Adam keeps two fp32 moments (8 bytes) per parameter it steps.
    """
    lp = 4 if layout.precision == "fp32" else 2
    acc = grad_accum_bytes(layout.ds_config, layout.precision)
    zero = layout.zero_stage
    if layout.precision == "fp32" and zero == 0:
        # the gradients live from backward until the engine zeroes them after the step
        return StateBytes(weights=4, grads_transient=4, optimizer=8, optimizer_path="torch AdamW, fp32",
                          grads_backward=4)
    bf16_wrapper = layout.precision == "bf16" and (
        (zero == 1 and acc == 4) or (zero == 0 and layout.use_pipeline and acc == 2))
    if bf16_wrapper:
        # BF16_Optimizer: a full-size gradient accumulation buffer (acc bytes) beside the model's
        # bf16 grads, which are folded into it after backward; fp32 master weights and moments
        # split over DP; a gradient held in bf16 is cast to an fp32 partition for the step.
        return StateBytes(weights=2, grads=acc, grads_transient=2,
                          grads_transient_split=4 if acc != 4 else 0, optimizer_split=4 + 8,
                          optimizer_path="DeepSpeed BF16_Optimizer", grads_backward=2)
    if zero == 0:
        # FP16_Optimizer: fp32 master weights and moments full size on every rank; the 16-bit
        # gradients and their fp32 copy for the step are freed after it.
        return StateBytes(weights=lp, grads_transient=lp + 4, optimizer=4 + 8,
                          optimizer_path="DeepSpeed FP16_Optimizer", grads_backward=lp)
    if zero in (1, 2):
        # DeepSpeedZeroOptimizer: stage 1 keeps the full 16-bit gradients until the reduction at
        # the accumulation boundary, stage 2 only this rank's partition, plus the fp32 gradient of
        # the master partition during the step; all of them are freed after it.
        return StateBytes(weights=lp, grads_transient=lp if zero == 1 else 0,
                          grads_transient_split=4 + (lp if zero == 2 else 0), optimizer_split=4 + 8,
                          optimizer_path=f"DeepSpeed ZeRO stage {zero}", grads_backward=lp if zero == 1 else 0,
                          grads_backward_split=lp if zero == 2 else 0)
    return StateBytes(weights=0, weights_split=lp, grads_split=lp, grads_transient_split=4,
                      optimizer_split=4 + 8, optimizer_path="DeepSpeed ZeRO stage 3")


def activation_bytes_per_layer(layout: Layout, *, recompute: str | None, experts: int = 1) -> float:
    """Bytes of activations one transformer layer keeps for backward, for one micro-batch on one GPU.

    Megatron's ``s b h (34 + 5 a s / h)`` (Korthikanti et al. 2022) without the ``5 a s / h``: the
    fused attention kernels this model runs on a GPU never store the ``[s, s]`` scores. The rest is
    counted term by term from what this model's layer saves (q, k, v with their own head counts, the
    ffn size, SwiGLU, RoPE's copies, dropout masks, the attention logsumexp), then divided by TP where
    the tensor is split; ``recompute`` is the layout's setting ("selective" drops the logsumexp; full
    recompute is the caller's), ``experts`` > 1 an MoE layer at its capacity slots. Counted as a GPU
    runs the layer: the compiled RoPE and SwiGLU fusions keep less than their unfused paths, which the
    CPU takes unless ``--fusions-on-cpu`` (their flags switch them off). The terms, with sequence
    parallelism (Ulysses) and MoE, are in docs/memory.md; tests/config/test_memory.py measures them
    with saved-tensor hooks, fused and unfused.
    """
    m = layout.model
    # context parallelism (CP): each rank holds seq / CP of every sequence's tokens
    s, b, h, a, t = m.seq_length // (layout.sp * layout.cp), layout.micro_batch_size, m.hidden_size, m.num_attention_heads, \
        layout.tp
    d = m.kv_channels or h // a
    g = m.num_key_value_heads or a
    f = m.ffn_hidden_size or 4 * h
    masks = 2 * (2 if m.bias_dropout_fusion else 1) if m.hidden_dropout > 0 else 0
    residual = 4 if m.fp32_residual_connection else 2  # the flag is refused with fp32 weights (validation.py)
    replicated = residual + residual + 2 + 2 + masks
    qkv = 2 * (a + 2 * g) * d / h
    # the fused split + RoPE (fusions.rope_qkv, compiled on the GPU) keeps no rotated copies: its
    # backward needs only cos and sin
    # (--qk-layernorm takes the unfused path: the norms sit between the split and the rotation)
    unfused_rope = m.position_embedding_type == "rope" and layout.sp == 1 and not (m.apply_rope_fusion
                                                                                   and not m.qk_layernorm)
    rope = 2 * (a + g) * d / h if unfused_rope else 0.0
    # --qk-layernorm: each norm keeps its normalised input for the weight's gradient
    rope += 2 * (a + g) * d / h if m.qk_layernorm else 0.0
    core = 2 * a * d / h * (2 if layout.sp > 1 else 1) + (4 * a / h if recompute != "selective" else 0.0)
    if m.swiglu and m.bias_swiglu_fusion:
        mlp = (4 + 2) * f / h  # the fused SwiGLU keeps its input and recomputes SiLU(gate) in backward
    else:
        mlp = (4 + 2 + 2) * f / h if m.swiglu or m.geglu else (2 + 2) * f / h
    if experts > 1 and is_mlm_moe(m):
        replicated += 4 * experts / h  # the router's fp32 logits (and scores)
        mlp = _mlm_moe_mlp_bytes(m, experts, s * b)
    elif experts > 1:
        factor = m.moe_train_capacity_factor * m.topk
        tokens = s * b
        capacity = max(math.ceil(tokens / experts * factor), m.moe_min_capacity)
        slots = experts * capacity
        replicated += 4 + 4 * experts / h + 2 * m.topk + (4 if m.mlp_type == "residual" else 0)
        mlp = mlp * slots / tokens + 2 * slots / tokens + (mlp if m.mlp_type == "residual" else 0.0)
    if m.multi_latent_attention:  # model/mla.py: q, k, v and the context, the rotary parts' copies, the latents
        q_head, v_head, rope_d = m.qk_head_dim + m.qk_pos_emb_head_dim, m.v_head_dim, m.qk_pos_emb_head_dim
        qkv = 2 * a * (2 * q_head + v_head) / h
        rope = 2 * 2 * (a + 1) * rope_d / h
        core = 2 * a * v_head / h + (4 * a / h if recompute != "selective" else 0.0)
        replicated += 2 * (2 * (m.q_lora_rank or 0) + 2 * m.kv_lora_rank + rope_d) / h
    split = qkv + rope + core + mlp
    per_layer = s * b * h * ((replicated / t if layout.sequence_parallel else replicated) + split / t)
    return per_layer * (2 if layout.precision == "fp32" else 1)


def _mlm_moe_mlp_bytes(m, experts: int, tokens: int) -> float:
    """Megatron-LM's MoE layer's MLP side (model/mlm_moe.py), bytes per token over h: per route (tokens x k,
    or each expert's capacity with a capacity factor) the permuted input and the unfused expert MLP's tensors
    (fc1 output, activation, its probability-scaled copy), plus the shared experts' MLP per token."""
    def unfused(f):
        return (4 + 2 + 2) * f / m.hidden_size if m.swiglu or m.geglu else (2 + 2) * f / m.hidden_size

    routes = tokens * m.moe_router_topk
    if m.moe_expert_capacity_factor is not None:
        cap = experts * math.ceil(routes / experts * m.moe_expert_capacity_factor)
        routes = cap if m.moe_pad_expert_input_to_capacity else min(routes, cap)
    per_route = 2 + unfused(m.moe_ffn_hidden_size) + 2 * m.moe_ffn_hidden_size / m.hidden_size
    shared = unfused(m.moe_shared_expert_intermediate_size) if m.moe_shared_expert_intermediate_size else 0.0
    return per_route * routes / tokens + shared


@dataclass(frozen=True)
class LayerActivations:
    """What one transformer layer keeps for backward, one micro-batch on one GPU (bytes)."""
    kept: float  # under the layout's recompute setting, full recompute aside
    working: float  # without recompute: what full recompute rebuilds while it re-runs the layer
    chunk_input: float  # its input hidden state: what full recompute keeps of a chunk starting here


def stack_activations(layout: Layout, stage) -> tuple[list[list[LayerActivations]], float]:
    """``ModelFamily.activations`` of a plain stack of transformer layers (the GPT's; BERT's adds its head):
    the stage's transformer layers as runs that full recompute may chunk together (one run here), and the
    bytes per micro-batch of the stage's input/output hidden state buffers."""
    m = layout.model
    # the hidden state kept per recomputed chunk and crossing stages: the residual stream
    act_bytes = 4 if layout.precision == "fp32" or m.fp32_residual_connection else 2
    shard = layout.tp if layout.sequence_parallel else 1
    sbh = m.seq_length // (layout.sp * layout.cp) * layout.micro_batch_size * m.hidden_size
    experts = model_experts(m)[stage.layers[0]:stage.layers[1]]
    kept = {e: activation_bytes_per_layer(layout, recompute=layout.recompute, experts=e) for e in set(experts)}
    working = {e: activation_bytes_per_layer(layout, recompute=None, experts=e) for e in set(experts)}
    run = [LayerActivations(kept[e], working[e], sbh * act_bytes / shard) for e in experts]
    return [run], sbh * act_bytes


def stage_activation_bytes(layout: Layout, stage) -> float:
    """The activations a stage holds at its peak: the micro-batches in flight times what each keeps
    (with full recompute only each chunk's input, plus one chunk's working set re-run in backward),
    and the stage's input/output buffers. The family's ``activations`` says what its layers keep."""
    runs, boundary = layout.family.activations(layout, stage)
    in_flight = in_flight_micro_batches(layout, stage.stage)
    layers = [layer for run in runs for layer in run]
    if layout.recompute == "full":
        # Only each recomputed chunk's input is kept; backward re-runs one chunk at a time (a chunk
        # ends where the run of layers does: model/pipeline_model.py checkpoints transformer layers only).
        chunk = max(1, min(layout.recompute_num_layers, len(layers)))
        kept = sum(layer.chunk_input for run in runs for layer in run[::chunk])
        # the largest chunk's layers (MoE layers keep more than dense ones)
        working = chunk * max((layer.working for layer in layers), default=0.0)
        activations = in_flight * kept + working
    else:
        activations = in_flight * sum(layer.kept for layer in layers)
    return activations + in_flight * boundary


def in_flight_micro_batches(layout: Layout, stage: int) -> int:
    """Micro-batches whose activations a stage holds at once: DeepSpeed's 1F1B TrainSchedule keeps
    min(stages - stage_id, micro_batches) buffers (at least 2) -- the first stage the most; ZB-H1
    holds the first stage's count on every stage."""
    if not layout.use_pipeline or layout.pp == 1:
        return 1
    if layout.zbh1 is not None:
        # ZB-H1: a micro-batch waiting for its weight pass keeps its linear layers' inputs and output
        # gradients, up to min(pp, m) on every stage (zbh1_schedule); counted whole, an upper bound
        return max(2, min(layout.pp, layout.grad_accum_steps))
    return max(2, min(layout.pp - stage, layout.grad_accum_steps))


@dataclass(frozen=True)
class MemoryEstimate:
    stage: int  # the pipeline stage the terms are for (the one needing the most)
    terms: tuple[tuple[str, float], ...]  # (name, bytes per GPU)
    persistent: float  # weights + gradient buffers + optimizer states that live between steps
    optimizer_path: str
    # bytes counted in two terms that never exist at once: the gradients made for the optimizer step
    # (after backward) and the activations and logits (freed by backward); see ``_peak``
    not_at_once: float = 0.0
    peak_at: str = "backward"  # when the total is reached: "backward" (its start) or "optimizer step"

    @property
    def total(self) -> float:
        return sum(v for _, v in self.terms) - self.not_at_once

    def biggest(self) -> tuple[str, float]:
        return max(self.terms, key=lambda kv: kv[1])

    def describe(self, budget: float | None = None) -> str:
        parts = ", ".join(f"{name} {v / GB:.2f}" for name, v in self.terms)
        head = f"memory per GPU (stage {self.stage}, GB): {parts}; total {self.total / GB:.2f}"
        when = "in backward" if self.peak_at == "backward" else "at the optimizer step"
        overlap = f"; peak {when}: {self.not_at_once / GB:.2f} of the gradients and activations above " \
                  f"never exist at once" if self.not_at_once else ""
        if budget is None:
            return head + f" (no --gpu-memory-gb given: not compared){overlap}"
        verdict = "fits" if self.total <= budget else "DOES NOT FIT"
        return head + f" of {budget / GB:.0f} GB: {verdict} ({self.optimizer_path}){overlap}"


@dataclass(frozen=True)
class ParameterState:
    """Bytes one GPU holds for the parameters of its shard of the model."""
    weights: float
    gradients: float  # the buffers below plus what exists only between backward and the step
    grad_buffers: float  # gradient buffers that live between steps
    optimizer: float


def parameter_state(layout: Layout, params: int, weight_bytes: float | None = None,
                    sb: StateBytes | None = None, expert_params: int = 0) -> ParameterState:
    """Weights, gradients and optimizer states of ``params`` parameters of one tensor parallel
    shard, on one GPU. ``weight_bytes``: what those parameters take in the module as built (the
    meta-device build of --dry-run); the default is the compute precision's bytes per parameter.
    ZeRO-3 keeps 1/DP of the module's weights on each GPU. Under DeepSpeed-Ulysses ZeRO partitions
    over the sequence data parallel group (SP x DP ranks hold the same weights: runtime/engine.py
    hands ZeRO ``seq_data_parallel_group``). ``expert_params`` of the ``params`` are MoE experts', which ZeRO
    splits over the expert data parallel group instead (config/moe_params.py)."""
    sb = sb or state_bytes(layout)
    dp = layout.dp * layout.sp * layout.cp  # CP ranks hold the same weights too (parallel/groups.py)
    if expert_params:
        # the experts split over DeepSpeed's data parallel axis, DP x CP ranks (parallel/groups.py)
        edp = expert_data_parallel_size(layout.model, tp=layout.tp, dp=layout.dp * layout.cp, ep=layout.ep,
                                        etp=layout.etp)
        dense_bytes = expert_bytes = None
        if weight_bytes is not None:  # the built module's bytes, shared in proportion (one dtype)
            expert_bytes = weight_bytes * expert_params / params
            dense_bytes = weight_bytes - expert_bytes
        a = _state(sb, params - expert_params, dp, dense_bytes)
        e = _state(sb, expert_params, edp, expert_bytes)
        return ParameterState(*(x + y for x, y in zip(dataclasses.astuple(a), dataclasses.astuple(e))))
    return _state(sb, params, dp, weight_bytes)


def _state(sb: StateBytes, params: int, dp: int, weight_bytes: float | None) -> ParameterState:
    """``parameter_state`` of ``params`` replicated on ``dp`` ranks, which ZeRO splits them over."""
    per_weight = sb.weights + sb.weights_split / dp
    # the module holds sb.weights + sb.weights_split bytes per weight before ZeRO-3 splits them
    weights = params * per_weight if weight_bytes is None else weight_bytes * per_weight / (
        sb.weights + sb.weights_split)
    grad_buffers = params * (sb.grads + sb.grads_split / dp)
    grads = grad_buffers + params * (sb.grads_transient + sb.grads_transient_split / dp)
    return ParameterState(weights, grads, grad_buffers, params * (sb.optimizer + sb.optimizer_split / dp))


def _stage_estimate(layout: Layout, stage, sb: StateBytes) -> MemoryEstimate:
    p = stage.params_per_tp_rank
    state = parameter_state(layout, p, sb=sb, expert_params=stage.expert_params_per_tp_rank)
    backward_grads = parameter_state(layout, p, sb=dataclasses.replace(
        sb, grads=0.0, grads_split=0.0, grads_transient=sb.grads_backward,
        grads_transient_split=sb.grads_backward_split), expert_params=stage.expert_params_per_tp_rank).gradients
    activations = stage_activation_bytes(layout, stage)
    last = stage.stage == layout.pp - 1
    logits = logits_bytes(layout) if last else 0.0
    working = backward_working_bytes(layout, stage, last)
    buckets = _bucket_bytes(layout, p)
    terms = [("weights", state.weights), ("gradients", state.gradients), ("optimizer states", state.optimizer),
             ("activations", activations), ("logits", logits), ("backward working set", working),
             ("communication buckets", buckets)]
    # Backward frees the activations and logits while it makes the gradients: the peak is the larger
    # of its start (with the gradients earlier micro-batches left, where there are several) and the
    # optimizer step (all gradients, no activations). Between the two both change in step, layer by
    # layer, so neither end is exceeded.
    transient = state.gradients - state.grad_buffers
    during_backward = activations + logits + working + (backward_grads if layout.grad_accum_steps > 1 else 0.0)
    not_at_once = transient + during_backward - max(transient, during_backward)
    peak_at = "backward" if during_backward >= transient else "optimizer step"
    reserve = RESERVE_FIXED_BYTES + RESERVE_FRACTION * (sum(v for _, v in terms) - not_at_once)
    terms.append(("runtime reserve", reserve))
    return MemoryEstimate(stage.stage, tuple(terms), state.weights + state.grad_buffers + state.optimizer,
                          sb.optimizer_path, not_at_once, peak_at)


def backward_working_bytes(layout: Layout, stage, last: bool) -> float:
    """What backward holds beyond the kept activations at its largest: the first weight gradient it
    makes (the output layer's, [vocab / TP, h], on the last stage; elsewhere a layer's MLP output
    projection) and, while a layer runs its backward, the gradients of what that layer kept (about as
    large). Measured on an H200 the first term is the whole gap between the peak and weights +
    optimizer states + activations + logits (bench/RESULTS.md); the second bounds non-last stages."""
    m = layout.model
    grad_bytes = 4 if layout.precision == "fp32" else 2
    ffn = m.ffn_hidden_size or 4 * m.hidden_size
    first = (layout.padded_vocab_size if last else ffn) / layout.tp * m.hidden_size * grad_bytes
    runs, _ = layout.family.activations(layout, stage)
    layer = max((one.kept for run in runs for one in run), default=0.0)
    return first + layer


def _bucket_bytes(layout: Layout, params: int) -> float:
    """DeepSpeedZeroOptimizer's gradient reduction buffers (reduce_bucket_size elements, two with
    overlap_comm) and the all-gather of updated weights; never more than the parameters."""
    zero_cfg = layout.ds_config.get("zero_optimization") or {}
    if layout.zero_stage == 0 or state_bytes(layout).optimizer_path == "DeepSpeed BF16_Optimizer":
        return 0.0
    lp = 4 if layout.precision == "fp32" else 2
    reduce_elems = min(float(zero_cfg.get("reduce_bucket_size", 5e8)), params)
    copies = 2 if zero_cfg.get("overlap_comm") else 1
    gather_key = "stage3_prefetch_bucket_size" if layout.zero_stage == 3 else "allgather_bucket_size"
    gather_elems = min(float(zero_cfg.get(gather_key, 5e8)), params)
    return (copies * reduce_elems + gather_elems) * lp


def estimate_stages(layout: Layout) -> list[MemoryEstimate]:
    """One estimate per pipeline stage (a GPU of that stage)."""
    sb = state_bytes(layout)
    return [_stage_estimate(layout, stage, sb) for stage in layout.stages]


def describe_stages(layout: Layout) -> str:
    """Each pipeline stage's transformer layers and estimated total: uneven partitions (the first stage with the
    embedding, the last with the output layer and loss) differ per stage, and the largest decides."""
    parts = [f"{s.stage}: {s.layers[1] - s.layers[0]} layers {e.total / GB:.2f}"
             for s, e in zip(layout.stages, estimate_stages(layout))]
    return "memory per pipeline stage (GB): " + ", ".join(parts)


def estimate_memory(layout: Layout) -> MemoryEstimate:
    """The estimate for the stage needing the most memory (see the module docstring)."""
    return max(estimate_stages(layout), key=lambda e: e.total)


def relayout(layout: Layout, *, tp: int | None = None, pp: int | None = None, zero_stage: int | None = None,
             recompute: str | None = "keep", micro_batch_size: int | None = None,
             use_pipeline: bool | None = None, model=None) -> Layout:
    """The layout with some choices changed (same world size and global batch), for suggestions."""
    layout = layout if model is None else dataclasses.replace(layout, model=model)
    tp = tp or layout.tp
    pp = pp or layout.pp
    micro = micro_batch_size or layout.micro_batch_size
    dp = layout.world_size // (tp * pp * layout.sp * layout.cp)
    padded = pad_vocab_size(layout.vocab_size, layout.model.make_vocab_size_divisible_by, tp)
    use_pipeline = layout.use_pipeline if use_pipeline is None else use_pipeline
    partition = layout.pipeline_partition if use_pipeline else None
    chunks = layout.chunk_layers if pp == layout.pp else None  # uneven counts are for layout.pp stages
    if partition and partition.startswith(EXPLICIT) and pp != layout.pp:
        partition = ParallelConfig.pipeline_partition_method
    counted = partition if chunks is None else EXPLICIT + ",".join(
        str(sum(chunks[r::pp])) for r in range(pp))  # each rank's chunks (virtual stage c * pp + r)
    etp = _relaid_etp(layout, tp)
    total, stages = layout.family.count_parameters(layout.model, padded, tp, pp, counted, ep=layout.ep, etp=etp)
    return dataclasses.replace(
        layout, tp=tp, pp=pp, dp=dp, etp=etp, micro_batch_size=micro, padded_vocab_size=padded, stages=stages,
        chunk_layers=chunks,
        total_params=total, grad_accum_steps=max(1, layout.global_batch_size // (micro * dp)),
        zero_stage=layout.zero_stage if zero_stage is None else zero_stage, use_pipeline=use_pipeline,
        pipeline_partition=partition, recompute=layout.recompute if recompute == "keep" else recompute)


def _relaid_etp(layout: Layout, tp: int) -> int:
    """The expert tensor parallel size of ``layout`` relaid at ``tp``: Megatron-LM's experts split over all of TP
    (its default, ETP = TP) follow TP; another ETP (1: whole experts) stays."""
    return tp if layout.etp == layout.tp > 1 else layout.etp


def _candidates(layout: Layout):
    """(flag text, layout) for single changes that keep the layout valid."""
    m, world = layout.model, layout.world_size
    moe = layout.active_params is not None
    for text, candidate in _single_changes(layout, m, world):
        # MoE (config/moe_params.py check_moe): no ZeRO 3, EP must still divide DP (Megatron-LM's with sequence
        # parallelism: ETP x EP the TP x DP x CP ranks, its expert grid), ZeRO's expert groups need the flag
        grid = moe and is_mlm_moe(m) and layout.sequence_parallel
        if moe and (candidate.zero_stage == 3 or (
                candidate.tp * candidate.dp * candidate.cp % (layout.ep * candidate.etp) if grid
                else candidate.dp % layout.ep)):
            continue
        if moe and candidate.zero_stage != layout.zero_stage and not is_mlm_moe(m):  # Megatron-LM's needs none
            text += " --create-moe-param-group"
        yield text, candidate


def _single_changes(layout: Layout, m, world: int):
    if layout.recompute != "full":
        yield "--checkpoint-activations", relayout(layout, recompute="full")
    for stage in range(layout.zero_stage + 1, 4):
        if layout.dp * layout.sp * layout.cp == 1:
            break
        if stage >= 2 and layout.pp > 1:
            break
        extra = " --no-pipeline-parallel" if stage >= 2 and layout.use_pipeline else ""
        yield f"--zero-stage {stage}{extra}", relayout(layout, zero_stage=stage, use_pipeline=(
            False if stage >= 2 else None))
    tp, sp = layout.tp * 2, layout.sp  # Ulysses' heads split over TP x SP (config/validation.py)
    while world % (tp * layout.pp * sp * layout.cp) == 0 and m.num_attention_heads % (tp * sp) == 0 and \
            m.num_key_value_heads % (tp * sp) == 0 and m.ffn_hidden_size % tp == 0:
        # (spelled out for Megatron-LM's layer, whose default ETP is TP: config/moe_selection.py)
        etp = f" --expert-tensor-parallel-size {_relaid_etp(layout, tp)}" if (
            layout.active_params is not None and is_mlm_moe(m)) else ""
        yield f"--tensor-model-parallel-size {tp}{etp}", relayout(layout, tp=tp)
        tp *= 2
    pp = layout.pp * 2
    # (Ulysses runs on the plain engine only: no pipeline to suggest)
    # (nor under --no-pipeline-parallel, which refuses PP > 1)
    choose = layout.family.pipeline_choice or _even_pipeline_choice
    while sp == 1 and layout.use_pipeline and world % (layout.tp * pp) == 0 and layout.zero_stage < 2:
        choice = choose(m, pp)
        if choice is not None:
            model, flags = choice
            yield f"--pipeline-model-parallel-size {pp}{flags}", relayout(layout, pp=pp, model=model)
        pp *= 2
    micro = layout.micro_batch_size // 2
    while micro >= 1 and layout.global_batch_size % (micro * layout.dp) == 0:
        yield f"--micro-batch-size {micro}", relayout(layout, micro_batch_size=micro)
        micro //= 2


def _even_pipeline_choice(m, pp: int):
    """A stack's --num-layers over ``pp`` stages (``ModelFamily.pipeline_choice`` where a family has none)."""
    return (m, "") if m.num_layers % pp == 0 else None


def suggestions(layout: Layout, budget: float, *, limit: int = 4) -> list[str]:
    """Changes (one, else two combined) whose estimate fits ``budget``, smallest total first."""
    singles = list(_candidates(layout))
    fits = [(estimate_memory(lay).total, flag) for flag, lay in singles]
    fits = [(total, flag) for total, flag in fits if total <= budget]
    if not fits:
        for (f1, l1), (f2, _) in itertools.combinations(singles, 2):
            if f1.split()[0] == f2.split()[0]:
                continue
            for flag, lay in _candidates(l1):
                if flag == f2:
                    total = estimate_memory(lay).total
                    if total <= budget:
                        fits.append((total, f"{f1} {f2}"))
    fits.sort()
    return [f"{flag} (~{total / GB:.1f} GB)" for total, flag in fits[:limit]]


def check_memory(layout: Layout, estimate: MemoryEstimate, budget: float | None) -> None:
    """Raise ConfigError when the estimate exceeds ``budget`` bytes (None: no check)."""
    if budget is None or estimate.total <= budget:
        return
    name, value = estimate.biggest()
    fixes = suggestions(layout, budget)
    advice = ("would fit: " + "; ".join(fixes)) if fixes else \
        "no single TP/PP/recompute/ZeRO/micro-batch change fits: use more GPUs or a smaller model"
    raise ConfigError(f"estimated {estimate.total / GB:.1f} GB per GPU (stage {estimate.stage}) exceeds the "
                      f"GPU's {budget / GB:.0f} GB; biggest term: {name} {value / GB:.1f} GB; {advice}")
