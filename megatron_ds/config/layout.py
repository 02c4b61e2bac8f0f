"""The layout of a run: what runs where and how big it is, one pure function of the flags.

``build_layout(flags, world_size, ...)`` checks the combination (``validation``) and computes the
``Layout``: parallel sizes, micro-batches per step, iterations and LR spans, the padded vocabulary,
the resolved model shape, parameter counts per stage and the merged DeepSpeed JSON. It touches no
process group, file or device, so ``pretrain_gpt.py --dry-run`` and the tests can run it anywhere;
every rejection is a ``ConfigError`` whose one-line message names the values involved and the fix.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from megatron_ds import accelerator
from megatron_ds.config import dialect, moe_selection
from megatron_ds.config.attention import check_attention, check_mla, describe_attention
from megatron_ds.config.curriculum import SeqlenCurriculum, legacy_curriculum
from megatron_ds.config.deepspeed_json import (build_ds_config, check_cpu_optimizer, describe_gradients, keeps_fp32_grads,
                                               uses_bf16_optimizer)
from megatron_ds.config.family import ModelFamily
from megatron_ds.config.fp8_flags import fp8_recipe
from megatron_ds.config.moe_params import (check_moe, check_moe_stages, check_moe_tensor_parallel, check_moe_zero_json,
                                    is_moe, mlp_params, model_experts, moe_layer_params)
from megatron_ds.config.run_length import RunSchedule, StepSchedule, parse_step_schedule, resolve_iterations
from megatron_ds.config.schema import Config, ModelConfig, ParallelConfig
from megatron_ds.config.validation import (check_activation, check_data, check_divisible, check_engine,
                                           check_fp32_residual, check_learning_rate, check_parallel_sizes,
                                           check_context_parallel, check_per_token_loss, check_precision,
                                           check_profile, check_weight_decay, require)
from megatron_ds.errors import ConfigError
from megatron_ds.parallel.fp8 import Fp8Recipe
from megatron_ds.parallel.partition import EXPLICIT, megatron_stage_layers, megatron_virtual_stage_layers
from megatron_ds.parallel.schedules import check_schedule, describe_assignment, describe_zbh1, virtual_pipeline_size
from megatron_ds.parallel.utils import pad_vocab_size


def resolve_model_config(m: ModelConfig, *, deepspeed: bool = True) -> ModelConfig:
    """A copy of the model config with every optional shape filled in, as Megatron resolves them.
    ``deepspeed``: whether the command line named DeepSpeed (config/moe_selection.py: what --num-experts alone
    builds). A model config made in code or read back from a checkpoint keeps the default: its fields' defaults
    are DeepSpeed-MoE's (--topk 1, --expert-interval 2), and a resolved Megatron-LM MoE model has its top-k set.
    A command line's model is resolved by ``build_layout``, which sees its parallel and optimizer MoE flags too."""
    # Megatron-LM's MoE defaults where its model flags chose its layer
    return moe_selection.resolve(_resolve_shape(m), ParallelConfig(), deepspeed=deepspeed)[0]


def _resolve_shape(m: ModelConfig) -> ModelConfig:
    require(m.num_layers, "--num-layers")
    h = require(m.hidden_size, "--hidden-size")
    heads = require(m.num_attention_heads, "--num-attention-heads")
    seq = require(m.seq_length, "--seq-length")
    pos_type = m.position_embedding_type
    if m.use_rotary_position_embeddings:
        pos_type = "rope"
    elif m.no_position_embedding and pos_type == "learned_absolute":
        pos_type = "none"
    ffn = m.ffn_hidden_size
    if ffn is None:
        # SwiGLU has three matrices instead of two; 2/3 keeps the parameter count of a 4h GeLU MLP.
        ffn = int(4 * h * 2 / 3 / 64) * 64 if m.swiglu else 4 * h
    kv_heads = m.num_key_value_heads
    if m.group_query_attention and m.num_query_groups is not None:
        # megatron/training/arguments.py (Megatron-LM core_v0.19.0): num_query_groups is read only with
        # --group-query-attention (else the attention is multi-head)
        if kv_heads is not None and kv_heads != m.num_query_groups:
            raise ConfigError(f"--num-query-groups {m.num_query_groups} contradicts --num-key-value-heads {kv_heads}; "
                              f"pass one of them")
        kv_heads = m.num_query_groups
    if m.kv_channels is None and h % heads:
        raise ConfigError(f"--hidden-size {h} is not divisible by --num-attention-heads {heads}; "
                          f"change one of them or pass --kv-channels")
    return dataclasses.replace(
        m,
        num_key_value_heads=kv_heads or heads,
        ffn_hidden_size=ffn,
        kv_channels=m.kv_channels or h // heads,
        max_position_embeddings=m.max_position_embeddings or seq,
        position_embedding_type=pos_type,
        use_rotary_position_embeddings=pos_type == "rope",
        normalization=m.normalization.lower(),
    )


def activation_name(m: ModelConfig) -> str:
    """The MLP's activation as the start-up summary names it."""
    return ("swiglu" if m.swiglu else "openai-gelu" if m.openai_gelu else "squared-relu" if m.squared_relu
            else "relu" if m.relu else "geglu" if m.geglu else "gelu")


@dataclass(frozen=True)
class StageParams:
    stage: int
    layers: tuple[int, int]  # [first, last) transformer layer indices
    params_per_tp_rank: int
    expert_params_per_tp_rank: int = 0  # of which MoE experts' (this rank's 1/EP of them; config/moe_params.py)


@dataclass(frozen=True)
class Layout:
    world_size: int
    tp: int
    pp: int
    sp: int  # DeepSpeed-Ulysses sequence parallel ranks (each holds 1/sp of every sequence)
    virtual_pp: int  # model chunks per pipeline rank (> 1: interleaved 1F1B schedule)
    dp: int
    micro_batch_size: int
    global_batch_size: int
    grad_accum_steps: int  # micro-batches per optimizer step on each data parallel rank
    train_iters: int
    lr_decay_iters: int
    lr_warmup_iters: int
    schedule: RunSchedule  # ramp-up, token target, LR spans in samples/tokens
    vocab_size: int
    padded_vocab_size: int
    precision: str  # "fp32" | "fp16" | "bf16"
    zero_stage: int
    use_pipeline: bool
    # DeepSpeed's partition of the layers over the pipeline engine's stages; None: no
    # PipelineModule places them (the interleaved schedule's chunks, the plain engine)
    pipeline_partition: str | None
    sequence_parallel: bool  # Megatron's: activations split over TP ranks outside TP regions
    recompute: str | None  # None | "full" | "selective"
    recompute_num_layers: int  # transformer layers per recomputed chunk (full recompute)
    model: ModelConfig
    total_params: int
    stages: tuple[StageParams, ...]
    ds_config: dict = field(hash=False)  # the merged DeepSpeed JSON deepspeed.initialize receives
    family: ModelFamily = field(compare=False)  # the model family it trains (config/family.py)
    curriculum: SeqlenCurriculum | None = None  # sequence-length warm-up (the legacy JSON block)
    zbh1: str | None = None  # the ZB-H1 schedule: "exact" (--enable-zbh1-exact-semantics) | "default"
    ep: int = 1  # --moe-expert-parallel-size: ranks over which each MoE layer's experts are split
    etp: int = 1  # --expert-tensor-parallel-size (Megatron-LM's MoE): TP ranks over which each expert is split
    active_params: int | None = None  # MoE: the parameters one token goes through (None: a dense model)
    decoder_seq_length: int | None = None  # T5: --decoder-seq-length (model.seq_length is the encoder's); else None
    # our executor's stage messages: each TP rank sends 1/TP of the hidden state, the receiver all-gathers
    # (--no-scatter-gather-tensors-in-pipeline: False; DeepSpeed's engine: "pipe_partitioned" in ds_config)
    scatter_gather_p2p: bool = False
    # --gradient-accumulation-fusion: weight-gradient GEMMs add into DeepSpeed's fp32 gradients where it keeps them
    grad_accum_fusion: bool = False
    # the FP8 recipe every linear layer of the model runs its GEMMs with (config/fp8_flags.py), None: FP8 off
    fp8: Fp8Recipe | None = None
    # transformer layers of each virtual stage (chunk c of rank r: c * pp + r) of the interleaved and ZB-H1
    # schedules where Megatron-LM's uneven-stage flags set them; None: Megatron's equal chunks
    chunk_layers: tuple[int, ...] | None = None
    # --context-parallel-size: ranks that each hold 2 of every sequence's 2 x cp chunks (parallel/context_parallel.py);
    # DeepSpeed's data parallel axis is DP x CP (parallel/groups.py), and its attention's --cp-comm-type
    cp: int = 1
    cp_comm_type: str = "p2p"
    cp_block_kernel: str = "math"  # --cp-block-kernel (ours): parallel/attention_blocks.py

    @property
    def _cp_kernel(self) -> str:
        return ", flash blocks" if self.cp_block_kernel == "flash" else ""

    @property
    def expert_tp_groups(self) -> bool:
        """Whether DeepSpeed-MoE's expert groups run along data parallel ranks of one tensor parallel rank (experts
        split over TP: --enable-expert-tensor-parallelism). Megatron-LM's MoE takes its groups from its expert grid
        (``expert_grid``)."""
        return self.model.enable_expert_tensor_parallelism

    @property
    def expert_grid(self) -> bool:
        """Megatron-LM's MoE whose experts are DeepSpeed's expert parameters, over the groups of Megatron-LM's expert
        grid (parallel/groups.py ``expert_grid``): where its expert data parallel group is not the data parallel
        group, at EP > 1 or 1 < ETP < TP (at ETP 1 and TP, EP 1, the experts are reduced as the dense weights)."""
        return (self.active_params is not None and moe_selection.is_mlm_moe(self.model)
                and (self.ep > 1 or 1 < self.etp < self.tp))

    @property
    def own_schedule(self) -> bool:
        """Our executor runs the pipeline schedule on DeepSpeed's plain engine (interleaved 1F1B, ZB-H1)."""
        return self.virtual_pp > 1 or self.zbh1 is not None

    def _engine_name(self) -> str:
        if self.virtual_pp > 1:
            return "interleaved pipeline schedule on the plain engine"
        if self.zbh1 is not None:
            return f"ZB-H1 pipeline schedule ({self.zbh1} semantics) on the plain engine"
        return "pipeline engine" if self.use_pipeline else "plain engine"

    def _family_prefix(self) -> str:
        """"BERT, " for another family's model (the GPT's line stays as it was)."""
        return "" if self.family.legacy_unnamed else f"{self.family.label}, "

    def summary(self) -> str:
        m = self.model
        lines = [
            f"world size {self.world_size} = TP {self.tp} x PP {self.pp}"
            f"{f' x SP {self.sp} (DeepSpeed-Ulysses)' if self.sp > 1 else ''}"
            f"{f' x CP {self.cp} (context parallel, {self.cp_comm_type}{self._cp_kernel})' if self.cp > 1 else ''}"
            f" x DP {self.dp}"
            f" ({self._engine_name()}, ZeRO {self.zero_stage},"
            f" {self.precision})",
            f"batch: micro {self.micro_batch_size} x DP {self.dp} x {self.grad_accum_steps} micro-batches"
            f" per step = global {self.global_batch_size}; {self.train_iters} iterations",
            f"model: {self._family_prefix()}{m.num_layers} layers, hidden {m.hidden_size},"
            f" heads {m.num_attention_heads}"
            f" (kv {m.num_key_value_heads}), ffn {m.ffn_hidden_size}, seq {m.seq_length},"
            f" positions {m.position_embedding_type}, {m.normalization},"
            f" {activation_name(m)}, vocab {self.vocab_size} padded to {self.padded_vocab_size}",
            f"parameters: {self.total_params / 1e6:,.1f}M total",
        ]
        attention = describe_attention(m)
        if attention:
            lines[2] += f"; attention: {attention}"
        if self.active_params is not None:
            experts = model_experts(m)
            moe = [n for n in experts if n > 1]
            counts = "/".join(map(str, sorted(set(moe))))
            if moe_selection.is_mlm_moe(m):
                shared = m.moe_shared_expert_intermediate_size
                lines[2] += (f"; mixture of experts (Megatron-LM's): {len(moe)} of {m.num_layers} layers, {counts} "
                             f"experts of ffn {m.moe_ffn_hidden_size}, top-{m.moe_router_topk}"
                             f"{f', shared ffn {shared}' if shared else ''}, EP {self.ep} "
                             f"({moe[0] // self.ep} per rank{f', split over ETP {self.etp}' if self.etp > 1 else ''})")
            else:
                lines[2] += (f"; mixture of experts: {len(moe)} of {m.num_layers} layers (every {m.expert_interval}), "
                             f"{counts} experts, top-{m.topk}{', residual' if m.mlp_type == 'residual' else ''}, "
                             f"EP {self.ep} ({'/'.join(str(n // self.ep) for n in sorted(set(moe)))} per rank"
                             f"{', split over TP' if m.enable_expert_tensor_parallelism and self.tp > 1 else ''})")
            lines[3] += f", {self.active_params / 1e6:,.1f}M active per token"
        r = self.schedule
        if isinstance(r.rampup, StepSchedule):
            lines.insert(2, r.rampup.describe(r.seq_length))
        elif r.rampup is not None:
            lines.insert(2, f"batch ramp-up: global {r.rampup.start} + {r.rampup.increment} every "
                            f"{r.rampup.samples_per_increment:,.0f} samples up to {r.rampup.final} after "
                            f"{r.rampup.samples:,} samples")
        if r.train_tokens is not None:
            lines.insert(2, f"train until {r.train_tokens:,} tokens ({self.train_iters} iterations at most)")
        if self.curriculum is not None:
            lines.insert(2, self.curriculum.describe())
        for s in self.stages:
            first, stop = s.layers
            layers = "" if self.virtual_pp > 1 else f" layers {first}-{stop - 1}," if stop > first else " no layers,"
            experts = (f" ({s.expert_params_per_tp_rank / 1e6:,.1f}M of them experts: 1/EP of each MoE layer's)"
                       if self.active_params is not None else "")
            lines.append(f"  stage {s.stage}:{layers}"
                         f" {s.params_per_tp_rank / 1e6:,.1f}M parameters per tensor parallel rank{experts}")
        if self.pp > 1:
            schedule = describe_assignment(m.num_layers, self.pp, self.virtual_pp, self.grad_accum_steps,
                                           self.chunk_layers)
            # without interleaving, DeepSpeed's --pipeline-partition-method places the layers (above)
            lines += schedule if self.virtual_pp > 1 else [schedule[0], schedule[-1]]
            if self.zbh1 is not None:
                lines += describe_zbh1(self.pp, self.grad_accum_steps, exact=self.zbh1 == "exact")
            if self.tp > 1:
                lines.append(self._describe_stage_messages())
        if self.precision != "fp32":
            lines.append(describe_gradients(self.ds_config, self.precision, self.zero_stage, self.use_pipeline))
        if self.grad_accum_fusion:
            lines.append(self._describe_grad_accum_fusion())
        return "\n".join(lines)

    def _describe_grad_accum_fusion(self) -> str:
        if keeps_fp32_grads(self.ds_config, self.precision, self.zero_stage, self.use_pipeline):
            return ("gradient accumulation fusion: the tensor-parallel layers' weight-gradient GEMMs add fp32 "
                    "results into DeepSpeed's fp32 gradients (no bf16 .grad)")
        return ("gradient accumulation fusion: not applied, DeepSpeed keeps no fp32 gradient to add into here "
                "(it does with --bf16, ZeRO 1 and \"grad_accum_dtype\": \"fp32\": ds_configs/zero1_bf16.json, or "
                "Megatron-LM's --use-distributed-optimizer without a JSON)")

    def _describe_stage_messages(self) -> str:
        split = (self.scatter_gather_p2p if self.own_schedule
                 else self.ds_config.get("pipeline", {}).get("pipe_partitioned", False))
        if split:
            return ("stage messages: each TP rank sends 1/TP of the hidden state and its gradient, "
                    "the receiving stage all-gathers them (--no-scatter-gather-tensors-in-pipeline: whole)")
        why = ("its own sequence shard, --sequence-parallel" if self.sequence_parallel
               else "--no-scatter-gather-tensors-in-pipeline, or a model whose stages send several tensors")
        return f"stage messages: every TP rank sends its whole hidden state ({why})"


def layer_parameters(m: ModelConfig, tp: int) -> tuple[int, int]:
    """(parameters split over TP, parameters replicated on each TP rank) of one dense transformer layer,
    for other model families' counts (``families/bert/bert_params.py``)."""
    return _layer_params(m, tp)


def _attention_params(m: ModelConfig, tp: int) -> tuple[int, int]:
    """(parameters split over TP, parameters replicated on each TP rank) of a transformer layer without its
    MLP: attention and the two norms."""
    h, d, bias = m.hidden_size, m.kv_channels, m.add_bias_linear
    if m.multi_latent_attention:
        return _mla_params(m, tp)
    q, kv = m.num_attention_heads * d, m.num_key_value_heads * d  # heads x kv_channels may differ from h (Qwen3)
    split = h * (q + 2 * kv) + q * h + ((q + 2 * kv) if bias or m.add_qkv_bias else 0)
    per_channel = 2 if m.normalization == "layernorm" else 1
    qk_norms = 2 * per_channel * d if m.qk_layernorm else 0  # one weight of head size each, on every rank
    if m.qk_layernorm and m.qk_layernorm_scope == "projection":  # RMSNorm weights of q's and k's size, split
        split, qk_norms = split + q + kv, 0
    return split // tp, 2 * per_channel * h + qk_norms + (h if bias else 0)  # the row-parallel bias is not split


def _mla_params(m: ModelConfig, tp: int) -> tuple[int, int]:
    """``_attention_params`` of multi-latent attention (``model/mla.py``): the up projections and the output
    projection split over heads, the down projections and the latents' norms replicated."""
    h, heads, q_rank, kv_rank = m.hidden_size, m.num_attention_heads, m.q_lora_rank, m.kv_lora_rank
    q_head = m.qk_head_dim + m.qk_pos_emb_head_dim
    split = (h if q_rank is None else q_rank) * heads * q_head + kv_rank * heads * (m.qk_head_dim + m.v_head_dim)
    split += heads * m.v_head_dim * h
    per_channel = 2 if m.normalization.lower() == "layernorm" else 1
    down = (0 if q_rank is None else h * q_rank) + h * (kv_rank + m.qk_pos_emb_head_dim)
    norms = per_channel * (2 * h + kv_rank + (q_rank or 0))
    return split // tp, down + norms + (h if m.add_bias_linear else 0)


def _layer_params(m: ModelConfig, tp: int) -> tuple[int, int]:
    """(parameters split over TP, parameters replicated on each TP rank) of one dense transformer layer."""
    (a_split, a_repl), (m_split, m_repl) = _attention_params(m, tp), mlp_params(m, tp)
    return a_split + m_split, a_repl + m_repl


def layer_counts(m: ModelConfig, tp: int, ep: int, etp: int = 1) -> list[tuple[int, int, int, int]]:
    """Per transformer layer of a stack (MoE layers where --num-experts puts them): (parameters on one rank, of
    which experts', in the whole model, active per token), for the families' counts (``families/gpt/gpt_params.py``).
    ``etp``: Megatron-LM's --expert-tensor-parallel-size."""
    a_split, a_repl = _attention_params(m, tp)
    split, repl = _layer_params(m, tp)
    dense = (split + repl, 0, split * tp + repl, split * tp + repl)
    out = []
    for experts in model_experts(m):
        if experts == 1:
            out.append(dense)
            continue
        moe = moe_layer_params(m, experts, tp=tp, ep=ep, etp=etp)
        attention = a_split * tp + a_repl
        out.append((a_split + a_repl + moe.per_rank, moe.experts_per_rank, attention + moe.total,
                    attention + moe.active))
    return out


def _virtual_pp(par, num_layers: int, pp: int, micro_batches: int) -> int:
    """Model chunks per pipeline rank, refusing what the interleaved schedule cannot run."""
    split = _megatron_split(par)
    if split["first"] is not None or split["last"] is not None:
        # Megatron-LM's validate_args: the chunks of uneven first/last stages are counted, not sized
        if par.num_layers_per_virtual_pipeline_stage is not None:
            raise ConfigError("--num-layers-per-virtual-pipeline-stage cannot size the chunks of uneven first/last "
                              "stages (as in Megatron-LM); give --num-virtual-stages-per-pipeline-rank instead")
        v = par.virtual_pipeline_model_parallel_size or 1
        if v < 1 or (v > 1 and pp < 2):
            raise ConfigError(f"--virtual-pipeline-model-parallel-size {v} needs a positive size and, above 1, "
                              f"--pipeline-model-parallel-size >= 2")
    else:  # Megatron-LM counts an accounted-for embedding and loss as layers of the split
        if split["embedding"] or split["loss"]:
            megatron_stage_layers(num_layers, pp, **split)  # refuses a split that does not divide, by the flags
        v = virtual_pipeline_size(num_layers + split["embedding"] + split["loss"], pp,
                                  par.num_layers_per_virtual_pipeline_stage, par.virtual_pipeline_model_parallel_size)
    check_schedule(pp, micro_batches, v)
    if v > 1 and par.no_pipeline_parallel:
        raise ConfigError("--no-pipeline-parallel cannot run the interleaved pipeline schedule; drop one of them")
    return v


def compiles_layers(asked: bool | None, device_type: str, zbh1: str | None, *, gpu_present: bool = True) -> bool:
    """--compile-layers / --no-compile-layers, else regional compilation where it was measured to help
    (bench/RESULTS.md: CUDA), not on the CPU (inductor builds C++ at start-up), not where "cuda" has
    no GPU behind it (``gpu_present`` False: fake CUDA, or a test taking the CUDA branches on a CPU,
    where inductor would compile C++ instead) nor under ZB-H1 (its deferred weight passes decide in
    backward, which a compiled graph fixes once)."""
    if asked is not None:
        return asked
    return device_type == "cuda" and gpu_present and zbh1 is None


def _zbh1(par, *, pp: int, virtual_pp: int) -> str | None:
    """The ZB-H1 schedule asked for ("exact" | "default"), refusing what it cannot run with."""
    if par.enable_zbh1_exact_semantics and not par.enable_zbh1_pipeline:
        # Megatron-DeepSpeed asserts the same ("Exact semantics require ZBH1 pipeline enabled")
        raise ConfigError("--enable-zbh1-exact-semantics needs --enable-zbh1-pipeline")
    if not par.enable_zbh1_pipeline:
        return None
    if pp < 2 or par.no_pipeline_parallel:
        raise ConfigError(f"--enable-zbh1-pipeline schedules pipeline stages; it needs "
                          f"--pipeline-model-parallel-size >= 2 without --no-pipeline-parallel (PP = {pp})")
    if virtual_pp > 1:
        raise ConfigError("--enable-zbh1-pipeline and the interleaved schedule (virtual pipeline stages) are two "
                          "different schedules; drop one of them")
    if par.sequence_parallel:
        # Megatron-DeepSpeed asserts it off ("Sequence Parallel not tested"); here the sequence-parallel
        # linear's weight gradient needs a second all-gather of its input, which the weight pass lacks
        raise ConfigError("--enable-zbh1-pipeline cannot be combined with --sequence-parallel (weight passes "
                          "of sequence-parallel linear layers are not deferred); drop one of them")
    return "exact" if par.enable_zbh1_exact_semantics else "default"


UNEVEN_FLAGS = ("--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
                "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split")


def uneven_flags(par) -> list[str]:
    """Megatron-LM's uneven-stage flags the command line gives (a layer count of 0 is given, and refused)."""
    return [flag for flag, value in zip(UNEVEN_FLAGS, (
        par.decoder_first_pipeline_num_layers, par.decoder_last_pipeline_num_layers,
        par.account_for_embedding_in_pipeline_split, par.account_for_loss_in_pipeline_split))
        if value is not None and value is not False]


def _megatron_split(par) -> dict:
    return dict(first=par.decoder_first_pipeline_num_layers, last=par.decoder_last_pipeline_num_layers,
                embedding=par.account_for_embedding_in_pipeline_split, loss=par.account_for_loss_in_pipeline_split)


@dataclass(frozen=True)
class Placement:
    """Where the transformer layers go: ``engine`` DeepSpeed's pipeline engine's partition method (None: no
    PipelineModule places them), ``chunks`` the layers of each virtual stage of our executor's schedules
    (None: Megatron's equal ones), ``counted`` the partition the parameter count places them by."""
    engine: str | None = None
    chunks: tuple[int, ...] | None = None
    counted: str | None = None


def _placement(flags: Config, family: ModelFamily, num_layers: int, pp: int, v: int, *, use_pipeline: bool,
               own_schedule: bool) -> Placement:
    """--pipeline-partition-method, or Megatron-LM's uneven-stage flags: "layers:..." on DeepSpeed's engine,
    per-chunk counts on the interleaved and ZB-H1 schedules (parallel/partition.py)."""
    par = flags.parallel
    uneven = uneven_flags(par)
    if own_schedule and num_layers % pp and not uneven:
        # our executor's chunks are Megatron's equal virtual stages (parallel/partition.py chunk_layer_range)
        raise ConfigError(f"--num-layers {num_layers} is not divisible by --pipeline-model-parallel-size {pp}, which "
                          f"the interleaved and ZB-H1 schedules need; choose PP dividing the layer count or give "
                          f"the first/last stages' layers (--decoder-first/last-pipeline-num-layers)")
    if not uneven:
        method = par.pipeline_partition_method if use_pipeline and not own_schedule else None
        return Placement(engine=method, counted=method)
    if family.pipeline_choice is not None:
        raise ConfigError(f"{uneven[0]}: the {family.label} model splits its layers over the stages itself; drop it")
    if par.pipeline_partition_method != ParallelConfig.pipeline_partition_method:
        raise ConfigError(f"{uneven[0]} and --pipeline-partition-method {par.pipeline_partition_method} both place "
                          f"the layers; give one of them")
    if own_schedule:
        chunks = megatron_virtual_stage_layers(num_layers, pp, v, **_megatron_split(par))
        ranks = [sum(chunks[c * pp + r] for c in range(v)) for r in range(pp)]
        return Placement(chunks=tuple(chunks), counted=EXPLICIT + ",".join(map(str, ranks)))
    counts = megatron_stage_layers(num_layers, pp, **_megatron_split(par))
    method = EXPLICIT + ",".join(map(str, counts)) if use_pipeline else None
    return Placement(engine=method, counted=method)


def check_stages_hold_layers(stages: tuple[StageParams, ...], pp: int, num_layers: int, partition: str | None) -> None:
    """A stage without any layer cannot run in DeepSpeed's pipeline (too many stages for the model)."""
    empty = [s.stage for s in stages if s.params_per_tp_rank == 0]
    if empty:
        raise ConfigError(f"pipeline stage{'s' if len(empty) > 1 else ''} {', '.join(map(str, empty))} of PP {pp} "
                          f"would hold no layer ({num_layers} layers, partition {partition}); use fewer stages")


def _engine(flags: Config, template: dict | None, notes: list[str], *, tp: int, pp: int,
            seq_length: int) -> tuple[int, bool]:
    """(ZeRO stage, whether DeepSpeed's pipeline engine runs the model)."""
    template_stage = ((template or {}).get("zero_optimization") or {}).get("stage")
    zero_stage = dialect.zero_stage(flags, template_stage, notes)
    par = flags.parallel
    if zero_stage >= 2 and pp == 1 and not par.no_pipeline_parallel and dialect.dialect(flags)[0] == dialect.MEGATRON_LM:
        # Megatron-LM has no DeepSpeed pipeline engine: at PP 1 its model runs unpipelined, as
        # --no-pipeline-parallel runs it here (DeepSpeed's pipeline engine refuses ZeRO 2 and 3)
        par = dataclasses.replace(par, no_pipeline_parallel=True)
        notes.append(f"PP 1 with ZeRO stage {zero_stage}: DeepSpeed's plain engine, as --no-pipeline-parallel")
    check_engine(par, pp=pp, tp=tp, zero_stage=zero_stage, seq_length=seq_length)
    return zero_stage, not par.no_pipeline_parallel


def _curriculum(flags: Config, template: dict | None, seq_length: int, *, tp: int,
                virtual_pp: int) -> SeqlenCurriculum | None:
    """The sequence-length warm-up, refused where a truncated batch cannot run."""
    cl = legacy_curriculum(template, flags.training.curriculum_learning_legacy, seq_length)
    if cl is None:
        return None
    if virtual_pp > 1:
        raise ConfigError("the sequence-length warm-up (\"curriculum_learning\") cannot run on the interleaved "
                          "pipeline schedule; drop --num-layers-per-virtual-pipeline-stage or the block")
    lengths = cl.difficulties or (cl.difficulty_step, cl.max_difficulty)
    if flags.parallel.sequence_parallel and any(n % tp for n in lengths):
        raise ConfigError(f"--sequence-parallel splits every sequence over TP {tp}, but the \"curriculum_learning\" "
                          f"lengths ({', '.join(map(str, lengths))}) are not all multiples of {tp}")
    return cl


def _recompute(t) -> str | None:
    """--recompute-granularity, or "full" from Megatron-DeepSpeed's older switches."""
    full = t.checkpoint_activations or t.deepspeed_activation_checkpointing
    return t.recompute_granularity or ("full" if full else None)


def gpt_only_refusals(flags: Config) -> dict[str, bool]:
    """{refusal: whether the flag is set} for what only the GPT's code runs, which the other families'
    ``check`` refuse alike (each adds its own)."""
    par, m = flags.parallel, flags.model
    return {
        "--num-layers-per-virtual-pipeline-stage / --virtual-pipeline-model-parallel-size (the interleaved "
        "schedule runs GPT chunks)": bool(par.num_layers_per_virtual_pipeline_stage
                                          or (par.virtual_pipeline_model_parallel_size or 1) > 1),
        "--enable-zbh1-pipeline (its executor runs GPT chunks)": bool(par.enable_zbh1_pipeline),
        "--ds-sequence-parallel-size > 1 (DeepSpeed-Ulysses shards the GPT's sequence)":
            par.ds_sequence_parallel_size > 1,
        "--context-parallel-size > 1 (context parallelism shards the GPT's sequence)": par.context_parallel_size > 1,
        "--curriculum-learning-legacy (the warm-up cuts GPT samples)": bool(flags.training.curriculum_learning_legacy),
        "--num-experts > 1 (MoE layers are the GPT's)": any(n > 1 for n in (m.num_experts or (1,))),
        "--use-z-loss (the GPT's loss function adds it)": bool(m.use_z_loss),
        "--calculate-per-token-loss (the GPT's language-model loss applies it)":
            bool(flags.training.calculate_per_token_loss),
        "--multi-latent-attention (DeepSeek's attention is the GPT's)": bool(m.multi_latent_attention),
        "--add-qkv-bias / --qk-layernorm / --use-rope-scaling / --rotary-seq-len-interpolation-factor / "
        "--window-size (the attention of the GPT family's open models)":
            bool(m.add_qkv_bias or m.qk_layernorm or m.use_rope_scaling or m.window_size is not None
                 or m.rotary_seq_len_interpolation_factor is not None),
    }


def build_layout(flags: Config, world_size: int, *, vocab_size: int, template: dict | None, family: ModelFamily,
                 device_type: str = "cuda") -> tuple[Layout, list[str]]:
    """Check ``flags`` for ``world_size`` processes and compute everything that follows from them;
    returns the layout and the notes of DeepSpeed JSON values the command line overrode. ``family``:
    the model family (its checks and parameter count)."""
    par, t, o = flags.parallel, flags.training, flags.optimizer
    family.check(flags, par.pipeline_model_parallel_size)
    # the MoE layer: from the model, parallel (--expert-model-parallel-size, --moe-expert-parallel-size) and
    # optimizer (--create-moe-param-group) flags and the line's dialect together, before anything reads the model
    m, ep, _ = moe_selection.resolve(_resolve_shape(flags.model), par, **moe_selection.line_context(flags))
    check_attention(m)
    tp, pp, sp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size, par.ds_sequence_parallel_size
    cp = par.context_parallel_size
    check_parallel_sizes(m, world_size, tp, pp, sp, cp)
    dp = world_size // (tp * pp * sp * cp)
    micro = require(t.micro_batch_size, "--micro-batch-size")
    global_batch = t.global_batch_size or micro * dp
    if t.step_batch_size_schedule:  # its last batch size is the run's (Megatron-LM refuses both flags too)
        if t.global_batch_size is not None:
            raise ConfigError("--step-batch-size-schedule and --global-batch-size are both set (Megatron-LM's "
                              "validate_args refuses the pair too); drop --global-batch-size")
        global_batch = parse_step_schedule(t.step_batch_size_schedule, m.seq_length, micro * dp).final
    check_divisible(global_batch, micro * dp,
                    f"--global-batch-size {global_batch} is not divisible by --micro-batch-size "
                    f"{micro} x DP {dp} = {micro * dp}; use a multiple of {micro * dp}")
    gas = global_batch // (micro * dp)
    virtual_pp = _virtual_pp(par, m.num_layers, pp, gas)
    precision = check_precision(t, device_type)
    engine_notes: list[str] = []
    zero_stage, use_pipeline = _engine(flags, template, engine_notes, tp=tp, pp=pp, seq_length=m.seq_length)
    template = dialect.gradient_data_types(flags, template, precision=precision, zero_stage=zero_stage,
                                           notes=engine_notes)
    zbh1 = _zbh1(par, pp=pp, virtual_pp=virtual_pp)
    if zbh1 is not None and m.compile_layers:
        # its weight passes decide in backward whether to defer, which a compiled graph fixes once
        raise ConfigError("--compile-layers cannot be combined with --enable-zbh1-pipeline (a compiled layer's "
                          "backward cannot defer its weight gradients); drop one of them")
    m = dataclasses.replace(m, compile_layers=compiles_layers(
        m.compile_layers, device_type, zbh1, gpu_present=accelerator.cuda_compiles()))
    iters = resolve_iterations(t, o, seq_length=m.seq_length, global_batch=global_batch, micro_dp=micro * dp,
                               interleaved=virtual_pp > 1, zbh1=zbh1 is not None)
    check_learning_rate(o)
    check_per_token_loss(t, flags.model, sp)
    check_weight_decay(o)
    check_activation(flags.model)
    check_fp32_residual(flags.model, precision)
    fp8 = fp8_recipe(flags.model)  # refuses an FP8 recipe we cannot run, before anything starts
    check_mla(m, ulysses=sp, fp8=fp8 is not None)
    cp_comm_type = check_context_parallel(
        flags, cp=cp, seq_length=m.seq_length,
        moe=("megatron" if moe_selection.is_mlm_moe(m) else "deepspeed") if is_moe(m) else None,
        curriculum=_curriculum(flags, template, m.seq_length, tp=tp, virtual_pp=virtual_pp) is not None)
    if cp > 1 and flags.model.compile_layers is not True:
        # the ring runs eagerly inside a compiled layer (a graph break, model/transformer.py); regional
        # compilation's default was measured without that break, so under CP it compiles only when asked
        m = dataclasses.replace(m, compile_layers=False)
    check_data(flags.data)
    check_profile(flags.logging)
    moe = is_moe(m)
    notes: list[str] = check_moe(  # experts split over DeepSpeed's data parallel axis: DP x CP ranks
        m, tp=tp, pp=pp, dp=dp * cp, sp=sp, ep=ep, zero_stage=zero_stage, precision=precision,
        expert_tensor_parallel_size=moe_selection.expert_tensor_parallel_size(par),
        etp_given=par.expert_tensor_parallel_size is not None,
        own_schedule=virtual_pp > 1 or zbh1 is not None,
        bf16_optimizer=uses_bf16_optimizer(template or {}, precision, zero_stage, use_pipeline),
        sequence_parallel=par.sequence_parallel, create_moe_param_group=o.create_moe_param_group)
    padded = pad_vocab_size(vocab_size, m.make_vocab_size_divisible_by, tp)
    placed = _placement(flags, family, m.num_layers, pp, virtual_pp, use_pipeline=use_pipeline,
                        own_schedule=virtual_pp > 1 or zbh1 is not None)
    partition = placed.engine
    if moe and family.active_parameters is None:
        raise ConfigError(f"--num-experts {','.join(map(str, m.num_experts))}: mixture-of-experts layers are built "
                          f"for GPT models only (pretrain_gpt.py); train the {family.label} model dense")
    etp = moe_selection.expert_tensor_parallel_size(par) if moe and moe_selection.is_mlm_moe(m) else 1
    total, stages = family.count_parameters(m, padded, tp, pp, placed.counted, ep=ep, etp=etp)
    check_stages_hold_layers(stages, pp, m.num_layers, placed.counted)
    curriculum = _curriculum(flags, template, m.seq_length, tp=tp, virtual_pp=virtual_pp)
    if template is not None:  # DeepSpeed >= 0.19 refuses the legacy block; the loop applies it
        template = {k: v for k, v in template.items() if k != "curriculum_learning"}
    ds = build_ds_config(template, micro=micro, global_batch=global_batch, gas=gas, precision=precision,
                         zero_stage=zero_stage, clip_grad=o.clip_grad, sequence_parallel=par.sequence_parallel,
                         notes=notes, moe=moe,
                         partition_activations=family.partition_activations and par.scatter_gather_tensors_in_pipeline)
    # DeepSpeed's data parallel ranks are DP x CP (parallel/groups.py): its batch counts each sample once per CP rank
    ds["train_batch_size"] = global_batch * cp
    dialect.apply_data_parallel_flags(flags, ds, use_pipeline=use_pipeline, notes=engine_notes)
    notes += engine_notes
    notes += check_cpu_optimizer(ds, cpu_optimizer=o.cpu_optimizer, torch_adam=o.cpu_torch_adam, optimizer=o.optimizer)
    if m.multi_latent_attention and flags.model.kv_channels is not None:  # Megatron-LM ignores it too
        notes.append(f"--kv-channels {flags.model.kv_channels} is not read by --multi-latent-attention (its heads have "
                     f"--qk-head-dim + --qk-pos-emb-head-dim and --v-head-dim channels)")
    if o.decoupled_min_lr is not None and o.decoupled_lr is None:  # Megatron-LM ignores it too
        notes.append(f"--decoupled-min-lr {o.decoupled_min_lr} has no effect without --decoupled-lr")
    mlm = moe_selection.is_mlm_moe(m)
    # DeepSpeed's optimizers' constraints on expert parameters (Megatron-LM's: where they are, Layout.expert_grid)
    if moe and (not mlm or ep > 1 or 1 < etp < tp):
        check_moe_zero_json(ds, zero_stage)
        check_moe_tensor_parallel(m, tp=tp, tokens=micro * m.seq_length)
        check_moe_stages(stages, bf16_optimizer=uses_bf16_optimizer(template or {}, precision, zero_stage,
                                                                    use_pipeline))
    layout = Layout(world_size=world_size, tp=tp, pp=pp, sp=sp, virtual_pp=virtual_pp, dp=dp, micro_batch_size=micro,
                    global_batch_size=global_batch, grad_accum_steps=gas, train_iters=iters.train,
                    lr_decay_iters=iters.lr_decay, lr_warmup_iters=iters.lr_warmup, schedule=iters.schedule,
                    vocab_size=vocab_size, padded_vocab_size=padded, precision=precision, zero_stage=zero_stage,
                    use_pipeline=use_pipeline, pipeline_partition=partition, chunk_layers=placed.chunks,
                    sequence_parallel=par.sequence_parallel, recompute=_recompute(t),
                    recompute_num_layers=t.recompute_num_layers, model=m, total_params=total, stages=stages,
                    ds_config=ds, curriculum=curriculum, zbh1=zbh1, family=family, ep=ep,
                    etp=etp,
                    active_params=family.active_parameters(m, padded) if moe else None,
                    decoder_seq_length=family.decoder_seq_length(flags) if family.decoder_seq_length else None,
                    scatter_gather_p2p=(par.scatter_gather_tensors_in_pipeline and tp > 1
                                        and not par.sequence_parallel and not moe),
                    grad_accum_fusion=bool(t.gradient_accumulation_fusion), fp8=fp8, cp=cp, cp_comm_type=cp_comm_type,
                    cp_block_kernel=par.cp_block_kernel)
    return layout, notes
