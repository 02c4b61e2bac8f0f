"""Mixture of experts in the plan: which layers hold experts, what they weigh, what MoE refuses.

DeepSpeed-MoE as Megatron-DeepSpeed builds it (deepspeedai/Megatron-DeepSpeed megatron/model/transformer.py
ParallelTransformerLayer, gpt_model.py GPTModelPipe): the layers whose 1-based number is a multiple of
--expert-interval replace their MLP by ``deepspeed.moe.layer.MoE(hidden, expert=the MLP, num_experts, ep_size,
k=--topk, use_residual=--mlp-type residual, ...)``, which holds

  * the gate, ``deepspeed_moe.gate.wg``: a bias-free hidden x experts linear, whole on every rank;
  * ``num_experts / ep_size`` deep copies of the expert MLP (``deepspeed_moe.experts.deepspeed_experts.N``):
    whole on every tensor parallel rank, or split over them like the dense MLP with
    --enable-expert-tensor-parallelism;
  * with --mlp-type residual (PR-MoE), the MLP itself beside the experts plus ``coefficient``, a
    hidden x 2 linear with a bias that mixes the two.

A rank's copy of an expert (its tensor parallel shard, if split) is held by TP x DP / (EP x expert TP)
ranks: DeepSpeed's expert data parallel group, over which ZeRO partitions expert parameters and gradients
are averaged (deepspeed/utils/groups.py, runtime/zero/stage_1_and_2.py _configure_moe_settings).

``check_moe`` refuses, in one line each, what cannot run: sizes that do not divide, and the features
DeepSpeed-MoE cannot be combined with here (each message says why).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from megatron_ds.config import moe_selection
from megatron_ds.config.schema import ModelConfig
from megatron_ds.errors import ConfigError


def experts_per_layer(num_experts, num_layers: int, expert_interval: int) -> tuple[int, ...]:
    """Experts of each transformer layer in order (1: a dense MLP). Megatron-DeepSpeed's
    get_num_experts_per_layer (megatron/model/transformer.py): --num-experts is one value for every MoE layer
    or one per MoE layer, the MoE layers being those with ``layer_number % expert_interval == 0``
    (1-based) -- num_layers // expert_interval of them."""
    values = tuple(num_experts)
    moe_layers = num_layers // expert_interval
    if len(values) != 1 and len(values) != moe_layers:
        raise ConfigError(f"--num-experts gives {len(values)} values, but --num-layers {num_layers} with "
                          f"--expert-interval {expert_interval} has {moe_layers} MoE layers: give one value for "
                          f"all of them or one per MoE layer")
    if len(values) == 1:
        values = values * moe_layers
    return _layers(values, num_layers, expert_interval)


# the memory estimate asks for every stage, and the planner for thousands of layouts of one model
@functools.lru_cache(maxsize=256)
def _layers(values: tuple, num_layers: int, expert_interval: int) -> tuple[int, ...]:
    return tuple(values[(n - 1) // expert_interval] if n % expert_interval == 0 else 1
                 for n in range(1, num_layers + 1))


def model_experts(m: ModelConfig) -> tuple[int, ...]:
    """Experts of each layer of a resolved model: DeepSpeed-MoE's placement, or Megatron-LM's
    (config/moe_selection.py)."""
    if moe_selection.is_mlm_moe(m):
        return moe_selection.layer_experts(m)
    return experts_per_layer(m.num_experts, m.num_layers, m.expert_interval)


def is_moe(m: ModelConfig) -> bool:
    """Whether the model has an MoE layer (Megatron-DeepSpeed's GPTModelPipe.is_moe_model)."""
    return any(n > 1 for n in model_experts(m))


def expert_tp(m: ModelConfig, tp: int) -> int:
    """Tensor parallel ranks each expert is split over: TP with --enable-expert-tensor-parallelism, else 1."""
    return tp if m.enable_expert_tensor_parallelism else 1


def expert_data_parallel_size(m: ModelConfig, *, tp: int, dp: int, ep: int, etp: int = 1) -> int:
    """Ranks of a pipeline stage holding the same expert shard (DeepSpeed's expert data parallel group): each
    of the stage's TP x DP ranks (``dp``: DeepSpeed's data parallel ranks, DP x CP) holds 1/EP of the experts,
    each expert split over expert-TP ranks (Megatron-LM's layer: ``etp``, --expert-tensor-parallel-size). Megatron-LM's
    experts at EP 1 are no expert parameters to DeepSpeed (model/mlm_moe.py marks them at EP > 1 only): they are
    reduced and partitioned over the data parallel ranks as the dense ones."""
    if moe_selection.is_mlm_moe(m):
        return dp if ep == etp == 1 else tp * dp // (ep * etp)
    return tp * dp // (ep * expert_tp(m, tp))


def mlp_params(m: ModelConfig, tp: int, ffn: int | None = None) -> tuple[int, int]:
    """(parameters split over ``tp``, parameters whole on each rank) of one MLP of ``ffn`` (default
    --ffn-hidden-size): the first linear (with SwiGLU gate and up) and the second; its column-parallel bias
    splits, the row-parallel one does not."""
    h, f = m.hidden_size, ffn or m.ffn_hidden_size
    ffn_in = 2 * f if m.swiglu or m.geglu else f
    split = h * ffn_in + f * h + (ffn_in if m.add_bias_linear else 0)
    return split // tp, h if m.add_bias_linear else 0


@dataclass(frozen=True)
class MoELayerParams:
    """One MoE layer's MLP side on one rank and in the whole model (the attention and norms are the dense
    layer's)."""
    per_rank: int  # gate, this rank's experts, residual MLP and coefficient (Megatron-LM's: shared experts)
    experts_per_rank: int  # of which expert parameters (DeepSpeed's allreduce=False ones)
    total: int  # every expert whole, once
    active: int  # what one token goes through: gate, k experts, residual MLP and coefficient


def moe_layer_params(m: ModelConfig, experts: int, *, tp: int, ep: int, etp: int = 1) -> MoELayerParams:
    """The gate (router), ``experts`` expert MLPs and what sits beside them, of DeepSpeed-MoE's layer or, for a
    resolved Megatron-LM MoE model (config/moe_selection.py), of Megatron-LM's, whose experts are split over
    ``etp`` ranks (--expert-tensor-parallel-size: fc1's rows and fc2's columns, fc2's bias whole on each)."""
    h, mlm = m.hidden_size, moe_selection.is_mlm_moe(m)
    tp_e = etp if mlm else expert_tp(m, tp)
    split, whole = mlp_params(m, tp_e, m.moe_ffn_hidden_size if mlm else None)
    expert_rank, expert_full = split + whole, split * tp_e + whole
    if mlm:  # the shared experts (one MLP every token goes through) and their gate, whole on every rank
        s = m.moe_shared_expert_intermediate_size
        shared = sum(mlp_params(m, 1, s)) + (h if m.moe_shared_expert_gate else 0) if s else 0
        beside, k = (shared, shared), m.moe_router_topk
    else:  # PR-MoE's residual MLP (split as the experts are) and its hidden x 2 coefficient linear
        beside = (expert_rank + 2 * h + 2, expert_full + 2 * h + 2) if m.mlp_type == "residual" else (0, 0)
        k = min(m.topk, experts)
    gate, local = h * experts, experts // ep
    return MoELayerParams(per_rank=gate + local * expert_rank + beside[0], experts_per_rank=local * expert_rank,
                          total=gate + experts * expert_full + beside[1], active=gate + k * expert_full + beside[1])


def check_moe(m: ModelConfig, *, tp: int, pp: int, dp: int, sp: int, ep: int, zero_stage: int, precision: str,
              bf16_optimizer: bool, own_schedule: bool, sequence_parallel: bool,
              create_moe_param_group: bool, expert_tensor_parallel_size: int | None = None,
              etp_given: bool = True) -> list[str]:
    """Refuse (ConfigError, one line) what an MoE run cannot do; returns notes (flags without effect).
    ``m`` is the resolved model shape; ``bf16_optimizer``: DeepSpeed wraps the optimizer in BF16_Optimizer."""
    if moe_selection.is_mlm_moe(m):  # Megatron-LM's layer: its own constraints, none of DeepSpeed-MoE's
        moe_selection.check(m, tp=tp, pp=pp, dp=dp, sp=sp, ep=ep, expert_tp=expert_tensor_parallel_size,
                            sequence_parallel=sequence_parallel, zero_stage=zero_stage, precision=precision,
                            etp_given=etp_given)
        return []
    for n in m.num_experts:
        if n < 1:
            raise ConfigError(f"--num-experts {' '.join(map(str, m.num_experts))}: every value must be >= 1")
    layers = model_experts(m)
    moe = sorted({n for n in layers if n > 1})
    if not moe:
        if max(m.num_experts) > 1:  # Megatron-DeepSpeed would silently train a dense model
            raise ConfigError(f"--num-experts {' '.join(map(str, m.num_experts))} places no MoE layer: "
                              f"--expert-interval {m.expert_interval} exceeds --num-layers {m.num_layers}")
        return [f"--moe-expert-parallel-size {ep} has no effect on a dense model (--num-experts 1)"] if ep > 1 else []
    if m.topk > moe[0]:
        raise ConfigError(f"--topk {m.topk}: each token goes to k of a layer's experts, so k must be between 1 and "
                          f"the fewest experts of an MoE layer ({moe[0]})")
    for n in moe:
        if n % ep:
            # deepspeed/moe/layer.py since DeepSpeed 0.7 (commit 5fe9d61); before, ep_size = min(ep_size, experts)
            older = (" (DeepSpeed before 0.7 lowered EP to a layer's expert count, which Megatron-DeepSpeed's PR-MoE "
                     "scripts relied on)" if n < ep else "")
            raise ConfigError(f"--num-experts {n} is not divisible by --moe-expert-parallel-size {ep}: each expert "
                              f"parallel rank holds num_experts / EP of a layer's experts, as DeepSpeed's MoE "
                              f"asserts{older}")
    if dp % ep:
        raise ConfigError(f"--moe-expert-parallel-size {ep} does not divide the data parallel size {dp} (world = TP "
                          f"{tp} x PP {pp} x DP {dp}): the experts are split over groups of EP data parallel ranks, "
                          f"which must tile the data parallel ranks")
    if zero_stage == 3:
        # deepspeed/runtime/engine.py: "Native DeepSpeed MoE is not supported with ZeRO Stage 3"
        raise ConfigError("mixture of experts cannot run under ZeRO stage 3: DeepSpeed's engine refuses its MoE layer "
                          "there (ZeRO-3 partitions every parameter over all data parallel ranks, experts are split "
                          "over expert parallel ones); use ZeRO stage 1 or 2")
    if (zero_stage in (1, 2) or bf16_optimizer) and not create_moe_param_group:
        # runtime/zero/stage_1_and_2.py and bf16_optimizer.py _configure_moe_settings assert an optimizer group
        # marked 'moe'; Megatron-DeepSpeed builds them only under this flag (megatron/optimizer/__init__.py)
        wrapper = f"ZeRO stage {zero_stage}" if zero_stage else "DeepSpeed's BF16_Optimizer (bf16 without ZeRO)"
        raise ConfigError(f"mixture of experts under {wrapper} needs --create-moe-param-group: DeepSpeed's optimizer "
                          f"partitions and reduces expert parameters over their own groups and stops without them")
    if precision != "fp32" and ep > 1 and not create_moe_param_group:
        # runtime/fp16/fused_optimizer.py step: only groups marked 'moe' join get_norm_with_moe_layers
        raise ConfigError(f"mixture of experts with --moe-expert-parallel-size {ep} under DeepSpeed's {precision} "
                          f"optimizer needs --create-moe-param-group: without expert groups it takes the gradient "
                          f"norm of each rank's own experts, so data parallel replicas would clip differently")
    if sp > 1:
        raise ConfigError(f"mixture of experts cannot be combined with DeepSpeed-Ulysses (--ds-sequence-parallel-size "
                          f"{sp}): DeepSpeed averages expert gradients over its data parallel group, not over the "
                          f"sequence and data parallel ranks that average the dense ones (runtime/engine.py "
                          f"_reduce_expert_gradients)")
    if sequence_parallel:
        raise ConfigError("mixture of experts cannot be combined with --sequence-parallel: DeepSpeed's MoE layer expects "
                          "every tensor parallel rank to hold the same tokens and splits them itself (sharded_moe.py "
                          "drop_tokens), while sequence parallelism gives each rank different ones")
    if own_schedule:
        # the executor trains DeepSpeed-MoE (it carries the auxiliary loss between stages; checked 2026-12-07: PP 2 x
        # DP 2 x EP 2 interleaved equals one process), but DeepSpeed's MoE checkpoint files (runtime/engine.py
        # _save_moe_checkpoint: layer ids counted per module, one expert file name per model parallel rank) collide
        # across model chunks: a resume was neither bitwise nor loadable
        raise ConfigError("DeepSpeed-MoE cannot run on the interleaved or ZB-H1 pipeline schedules: DeepSpeed's MoE "
                          "checkpoint files do not tell model chunks apart; use the pipeline engine's 1F1B, or "
                          "Megatron-LM's MoE layer (--moe-router-topk ...: docs/moe.md), which runs on both")
    return []


def check_moe_zero_json(ds: dict, zero_stage: int) -> None:
    """DeepSpeed's ZeRO 1/2 optimizer asserts, for an MoE model, "reduce_scatter" (stages 1 and 2) and
    "contiguous_gradients" (stage 2) on (runtime/zero/stage_1_and_2.py _configure_moe_settings); both default on,
    so only a JSON turning one off is refused, before the queue rather than at start-up."""
    if zero_stage not in (1, 2):
        return
    zero = ds.get("zero_optimization") or {}
    off = [key for key in ("reduce_scatter", "contiguous_gradients")
           if zero.get(key, True) is False and (key == "reduce_scatter" or zero_stage == 2)]
    if off:
        raise ConfigError(f"mixture of experts under ZeRO stage {zero_stage} needs \"{off[0]}\": true in the DeepSpeed "
                          f"JSON's \"zero_optimization\" (DeepSpeed's ZeRO optimizer asserts it for MoE); remove the "
                          f"false value")


def expert_capacity(tokens: int, experts: int, topk: int, capacity_factor: float, min_capacity: int) -> int:
    """Slots per expert with token dropping, as DeepSpeed's gates size them (deepspeed/moe/sharded_moe.py
    ``_capacity``: ceil(tokens / experts x factor), the factor times k for top-2 and top-k, at least
    min_capacity), computed in float32 as DeepSpeed's tensor arithmetic does."""
    factor = np.float32(capacity_factor * (1 if topk == 1 else topk))
    return max(int(np.ceil(np.float32(tokens / experts) * factor)), min_capacity)


def check_moe_tensor_parallel(m: ModelConfig, *, tp: int, tokens: int) -> None:
    """At TP > 1 DeepSpeed's MOELayer.forward splits each expert's capacity slots over the tensor parallel
    ranks (sharded_moe.py: ``drop_tokens(dispatched_input, dim=1)``, which asserts the split is even), so
    the capacity must be a multiple of TP. ``tokens``: a micro-batch's tokens (every TP rank routes all)."""
    if tp == 1 or not is_moe(m) or moe_selection.is_mlm_moe(m):
        return
    if m.disable_moe_token_dropping:
        # top1gating / top2gating pad the no-drop capacity to TP only when experts are not split over TP
        if m.enable_expert_tensor_parallelism:
            raise ConfigError(f"--disable-moe-token-dropping with --enable-expert-tensor-parallelism at TP {tp} stops "
                              f"DeepSpeed's MoE layer: it pads the no-drop capacity to a multiple of TP only when "
                              f"experts are not split over TP, then splits it over TP all the same (sharded_moe.py); "
                              f"drop one of the two flags")
        return
    for experts in sorted({n for n in model_experts(m) if n > 1}):
        for flag, factor in (("--moe-train-capacity-factor", m.moe_train_capacity_factor),
                             ("--moe-eval-capacity-factor", m.moe_eval_capacity_factor)):
            capacity = expert_capacity(tokens, experts, m.topk, factor, m.moe_min_capacity)
            if capacity % tp:
                raise ConfigError(f"an MoE layer's capacity of {capacity} tokens per expert ({tokens} tokens of a "
                                  f"micro-batch, {experts} experts, top-{m.topk}, {flag} {factor}, "
                                  f"--moe-min-capacity {m.moe_min_capacity}) is not divisible by TP {tp}: DeepSpeed "
                                  f"splits each expert's slots over the tensor parallel ranks (sharded_moe.py "
                                  f"MOELayer.forward); change the capacity factor, the micro-batch size or "
                                  f"--seq-length, or use --disable-moe-token-dropping")


def check_moe_stages(stages, *, bf16_optimizer: bool) -> None:
    """Under DeepSpeed's BF16_Optimizer the expert gradient norm is a reduction over the pipeline stages that
    only stages holding an MoE layer join (runtime/utils.py get_norm_with_moe_layers): a stage without one
    would leave the others waiting. ``stages``: the layout's ``StageParams``."""
    empty = [s.stage for s in stages if s.expert_params_per_tp_rank == 0]
    if bf16_optimizer and len(stages) > 1 and empty:
        raise ConfigError(f"pipeline stage(s) {', '.join(map(str, empty))} would hold no MoE layer: DeepSpeed's bf16 "
                          f"optimizer waits for every stage in the expert gradient norm and would hang; place MoE "
                          f"layers on every stage (--expert-interval, --num-layers, --pipeline-model-parallel-size) "
                          f"or use ZeRO stage 1")
