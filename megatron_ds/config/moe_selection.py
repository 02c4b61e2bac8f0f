"""Which mixture-of-experts layer a command line builds, and Megatron-LM's MoE flags resolved.

--num-experts is a flag of both dialects. Megatron-DeepSpeed's scripts pair it with DeepSpeed-MoE's flags
(--topk, --expert-interval, --moe-expert-parallel-size, --moe-*-capacity-factor, --moe-loss-coeff, ...) and
get DeepSpeed-MoE (``model/moe_layer.py``); upstream Megatron-LM's pair it with its own (--moe-router-topk,
--expert-model-parallel-size, --moe-token-dispatcher-type, ...) and get Megatron-LM's layer
(``model/mlm_moe.py``). A line naming flags of both families is refused. --num-experts alone means what it
means in the dialect of the line (config/dialect.py): on a Megatron-DeepSpeed line (--deepspeed /
--deepspeed_config, which its scripts always pass) DeepSpeed-MoE, with --topk 1 on every --expert-interval'th
layer; on an upstream Megatron-LM line (no DeepSpeed) Megatron-LM's MoE as upstream builds it from
--num-experts alone (megatron/core/transformer/transformer_config.py, core_v0.19.0: moe_router_topk = 2,
moe_layer_freq = 1, i.e. every layer, moe_expert_capacity_factor = None, i.e. dropless). --dry-run says which
layer and why. Which of a family's flags a line names is read from the values differing from their defaults:
a flag given with its default value changes nothing either way.

Resolved, a Megatron-LM MoE model has ``moe_router_topk`` set (2 unless given), the balancing types and their
coefficients as tuples, and its MoE layers where --moe-layer-freq puts them (every layer by default, as
Megatron-LM; DeepSpeed-MoE's --expert-interval defaults to every second layer).
"""
from __future__ import annotations

import ast
import dataclasses

from megatron_ds.config import dialect
from megatron_ds.config.schema import Config, ModelConfig, ParallelConfig
from megatron_ds.errors import ConfigError

DEEPSPEED_MOE, MEGATRON_LM_MOE = "DeepSpeed-MoE", "Megatron-LM's MoE"

# ModelConfig fields of Megatron-DeepSpeed's MoE flags (their defaults: schema.py)
_DS_MODEL = ("expert_interval", "topk", "mlp_type", "moe_train_capacity_factor", "moe_eval_capacity_factor",
             "moe_min_capacity", "moe_loss_coeff", "disable_moe_token_dropping",
             "disable_moe_top2_2nd_expert_sampling", "enable_expert_tensor_parallelism")
_MLM_MODEL = ("moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
              "moe_shared_expert_gate", "moe_layer_freq", "moe_router_load_balancing_type", "moe_aux_loss_coeff",
              "moe_z_loss_coeff", "moe_router_score_function", "moe_router_pre_softmax",
              "moe_router_topk_scaling_factor", "moe_router_num_groups", "moe_router_group_topk",
              "moe_router_enable_expert_bias", "moe_router_bias_update_rate",
              "moe_router_dtype", "moe_expert_capacity_factor", "moe_token_drop_policy",
              "moe_pad_expert_input_to_capacity", "moe_grouped_gemm", "moe_token_dispatcher_type",
              "moe_per_layer_logging")
_BALANCING = ("aux_loss", "seq_aux_loss", "sinkhorn", "none")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _given(obj, names) -> list[str]:
    defaults = {f.name: f.default for f in dataclasses.fields(obj)}
    return [_flag(n) for n in names if getattr(obj, n) != defaults[n]]


def is_mlm_moe(m: ModelConfig) -> bool:
    """Whether a resolved model's MoE layers are Megatron-LM's (``resolve`` sets its top-k)."""
    return m.moe_router_topk is not None


def select(m: ModelConfig, par: ParallelConfig, *, deepspeed: bool, create_moe_param_group: bool = False
           ) -> tuple[str, str]:
    """(the MoE implementation, why) of a command line with --num-experts > 1; refuses a mix of the families.
    ``deepspeed``: the line names DeepSpeed (a Megatron-DeepSpeed line, config/dialect.py), which decides what
    --num-experts alone builds."""
    ds = _given(m, _DS_MODEL) + _given(par, ("moe_expert_parallel_size",)) + (
        ["--create-moe-param-group"] if create_moe_param_group else [])
    mlm = _given(m, _MLM_MODEL) + _given(par, ("expert_model_parallel_size", "expert_tensor_parallel_size"))
    if ds and mlm:
        raise ConfigError(f"{' '.join(mlm)} (Megatron-LM's MoE) and {' '.join(ds)} (Megatron-DeepSpeed's "
                          f"DeepSpeed-MoE) name two different MoE layers; use one family's flags (docs/moe.md)")
    if mlm:
        return MEGATRON_LM_MOE, f"Megatron-LM's MoE flags ({' '.join(mlm)})"
    if ds:
        return DEEPSPEED_MOE, f"Megatron-DeepSpeed's MoE flags ({' '.join(ds)})"
    if deepspeed:
        return DEEPSPEED_MOE, ("--num-experts without either family's MoE flags, on a Megatron-DeepSpeed command line "
                               "(it names DeepSpeed): its layer, top-1 on every --expert-interval'th layer; any "
                               "Megatron-LM MoE flag (e.g. --moe-router-topk 2) selects Megatron-LM's")
    return MEGATRON_LM_MOE, ("--num-experts without either family's MoE flags, on an upstream Megatron-LM command line "
                             "(it names no DeepSpeed): its layer as upstream's defaults build it, top-2 on every layer, "
                             "dropless; --deepspeed or a Megatron-DeepSpeed MoE flag (e.g. --expert-interval 1) "
                             "selects DeepSpeed-MoE")


def line_context(flags: Config) -> dict:
    """What besides the model and parallel flags decides a command line's MoE layer (``select``'s and
    ``resolve``'s keywords): whether it names DeepSpeed, and Megatron-DeepSpeed's --create-moe-param-group."""
    return dict(deepspeed=dialect.dialect(flags)[0] == dialect.MEGATRON_DEEPSPEED,
                create_moe_param_group=flags.optimizer.create_moe_param_group)


def layer_freq(spec: str | None, num_layers: int) -> tuple[bool, ...]:
    """--moe-layer-freq: N (layer i, from 0, is an MoE layer when i % N == 0) or a list expression of 0/1 per
    layer (Megatron-LM's moe_freq_type / TransformerConfig.moe_layer_freq), read without eval: only integer
    lists, + and *."""
    if spec is None:
        return (True,) * num_layers
    try:
        value = _list_expr(ast.parse(spec, mode="eval").body)
    except (SyntaxError, ValueError) as e:
        raise ConfigError(f"--moe-layer-freq {spec!r} is neither an integer nor a list expression such as "
                          f"\"([1]*3+[0]*1)*3\" ({e})") from None
    if isinstance(value, int):
        if value < 1:
            raise ConfigError(f"--moe-layer-freq {spec}: must be >= 1")
        return tuple(i % value == 0 for i in range(num_layers))
    if len(value) != num_layers or any(v not in (0, 1) for v in value):
        raise ConfigError(f"--moe-layer-freq {spec!r} gives {len(value)} values for --num-layers {num_layers}: give "
                          f"one 0 or 1 per layer")
    return tuple(bool(v) for v in value)


def _list_expr(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.List):
        return [_list_expr(e) for e in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _list_expr(node.left), _list_expr(node.right)
        return left + right if isinstance(node.op, ast.Add) else left * right
    raise ValueError(f"unexpected {ast.dump(node)[:40]}")


def layer_experts(m: ModelConfig) -> tuple[int, ...]:
    """A resolved Megatron-LM MoE model's experts per layer (1: a dense MLP)."""
    return tuple(m.num_experts[0] if moe else 1 for moe in layer_freq(m.moe_layer_freq, m.num_layers))


def reported_losses(m: ModelConfig) -> tuple[str, ...]:
    """Megatron-LM's names of the losses a resolved Megatron-LM MoE model's routers compute (track_moe_metrics)."""
    types = balancing(m)
    return tuple(name for name, on in (("load_balancing_loss", types.get("aux_loss")),
                                       ("seq_load_balancing_loss", types.get("seq_aux_loss")),
                                       ("z_loss", m.moe_z_loss_coeff)) if on)


def per_layer_names(m: ModelConfig) -> tuple[str, ...]:
    """--moe-per-layer-logging: "<loss> layer <n>" for each MoE layer n (1-based, as Megatron-LM counts)."""
    if not m.moe_per_layer_logging:
        return ()
    layers = [n + 1 for n, e in enumerate(layer_experts(m)) if e > 1]
    return tuple(f"{name} layer {n}" for n in layers for name in reported_losses(m))


def balancing(m: ModelConfig) -> dict[str, float]:
    """{balancing type: coefficient}, as Megatron-LM's TopKRouter.get_aux_loss_coeff pairs them."""
    return dict(zip(m.moe_router_load_balancing_type, m.moe_aux_loss_coeff))


def resolve(m: ModelConfig, par: ParallelConfig, *, deepspeed: bool, create_moe_param_group: bool = False
            ) -> tuple[ModelConfig, int, str | None]:
    """(the model with Megatron-LM's MoE defaults filled in when that layer is chosen, the expert parallel
    size, the line --dry-run prints about the MoE layer or None for a dense model). ``deepspeed``: as ``select``."""
    if max(m.num_experts) <= 1:
        if _given(m, _MLM_MODEL) or _given(par, ("expert_model_parallel_size",)):
            raise ConfigError(f"{' '.join(_given(m, _MLM_MODEL) + _given(par, ('expert_model_parallel_size',)))} "
                              f"without --num-experts: Megatron-LM's MoE flags need --num-experts N (N > 1)")
        return m, par.moe_expert_parallel_size, None
    impl, why = select(m, par, deepspeed=deepspeed, create_moe_param_group=create_moe_param_group)
    if impl == DEEPSPEED_MOE:
        return m, par.moe_expert_parallel_size, f"mixture of experts: {impl} (model/moe_layer.py), because {why}"
    if len(m.num_experts) != 1:
        raise ConfigError(f"--num-experts {' '.join(map(str, m.num_experts))}: Megatron-LM's MoE takes one expert "
                          f"count for every MoE layer")
    types = tuple(m.moe_router_load_balancing_type or ("aux_loss",))
    coeffs = tuple(float(c) for c in (m.moe_aux_loss_coeff or (0.0,)))
    if len(coeffs) == 1:
        coeffs *= len(types)
    bad = [t for t in types if t not in _BALANCING]
    if bad:
        raise ConfigError(f"--moe-router-load-balancing-type {bad[0]} is not supported here (global_aux_loss "
                          f"and quantile_balancing are not); use {', '.join(_BALANCING)}")
    if "sinkhorn" in types and (len(types) > 1 or any(coeffs)):
        # Megatron-LM routes by Sinkhorn only when it is the one type (TopKRouter.routing), and asserts a zero
        # --moe-aux-loss-coeff with it (sinkhorn_load_balancing)
        raise ConfigError(f"--moe-router-load-balancing-type {' '.join(types)} --moe-aux-loss-coeff "
                          f"{' '.join(f'{c:g}' for c in coeffs)}: sinkhorn balances by routing, alone and with "
                          f"--moe-aux-loss-coeff 0 (as Megatron-LM); use sinkhorn alone, or aux_loss / seq_aux_loss")
    if "sinkhorn" in types and m.moe_router_enable_expert_bias:
        raise ConfigError("--moe-router-enable-expert-bias with --moe-router-load-balancing-type sinkhorn: the bias "
                          "moves a top-k of scores, which Sinkhorn routing does not take; use one of them")
    if len(coeffs) != len(types):
        raise ConfigError(f"--moe-aux-loss-coeff gives {len(coeffs)} values for {len(types)} balancing types: give "
                          f"one, or one per --moe-router-load-balancing-type")
    resolved = dataclasses.replace(
        m, moe_router_topk=m.moe_router_topk or 2, moe_ffn_hidden_size=m.moe_ffn_hidden_size or m.ffn_hidden_size,
        moe_router_load_balancing_type=types, moe_aux_loss_coeff=coeffs,
        moe_router_score_function=m.moe_router_score_function or "softmax",
        moe_router_bias_update_rate=1e-3 if m.moe_router_bias_update_rate is None else m.moe_router_bias_update_rate,
        moe_token_drop_policy=m.moe_token_drop_policy or "probs",
        moe_token_dispatcher_type=m.moe_token_dispatcher_type or "allgather")
    ep = par.expert_model_parallel_size or 1
    etp = expert_tensor_parallel_size(par)
    default = " (Megatron-LM's default ETP = TP: no --expert-tensor-parallel-size)" \
        if par.expert_tensor_parallel_size is None else ""
    return resolved, ep, (f"mixture of experts: {impl} (model/mlm_moe.py; {resolved.moe_token_dispatcher_type} "
                          f"dispatch, EP {ep}, ETP {etp}{default}), because {why}")


def expert_tensor_parallel_size(par: ParallelConfig) -> int:
    """The ranks each of Megatron-LM's experts is split over: --expert-tensor-parallel-size, or TP when it is absent,
    as Megatron-LM sets it (megatron/training/arguments.py validate_args, core_v0.19.0: ``if
    args.expert_tensor_parallel_size is None: args.expert_tensor_parallel_size = args.tensor_model_parallel_size``)."""
    given = par.expert_tensor_parallel_size
    return par.tensor_model_parallel_size if given is None else given


def check(m: ModelConfig, *, tp: int, pp: int, dp: int, sp: int, ep: int, expert_tp: int | None,
          sequence_parallel: bool, zero_stage: int = 0, precision: str = "fp32", etp_given: bool = True) -> None:
    """Refuse, one line each, what Megatron-LM's MoE cannot do here. ``expert_tp``: the resolved ETP
    (``expert_tensor_parallel_size``); ``etp_given``: whether the line passed --expert-tensor-parallel-size (else
    ``expert_tp`` is Megatron-LM's default, TP)."""
    experts = m.num_experts[0]
    k = m.moe_router_topk
    if not 1 <= k <= experts:
        raise ConfigError(f"--moe-router-topk {k}: each token goes to k of the {experts} experts, 1 <= k <= {experts}")
    etp = expert_tp or 1
    if tp % etp:
        # Megatron-LM's expert grid (megatron/core/parallel_state.py initialize_model_parallel, the expert
        # RankGenerator "tp-ep-dp-pp") may also spread an expert's shards over data parallel ranks; here they sit on
        # tensor parallel ranks of one group (parallel/groups.py expert_grid)
        raise ConfigError(f"--expert-tensor-parallel-size {etp} must divide --tensor-model-parallel-size {tp} here "
                          f"(each expert's shards on ranks of one tensor parallel group); use a divisor of {tp}")
    if etp > 1 and not sequence_parallel and not etp_given:
        # Megatron-LM's MoELayer.forward raises in training at TP > 1 without sequence parallelism, so its scripts
        # that train MoE at TP > 1 pass --sequence-parallel; a line without it would get ETP = TP here otherwise
        raise ConfigError(f"--tensor-model-parallel-size {tp} without --expert-tensor-parallel-size splits the experts "
                          f"over TP (Megatron-LM's default ETP = TP), which needs --sequence-parallel: add "
                          f"--sequence-parallel (Megatron-LM's MoE requires it at TP > 1) or pass "
                          f"--expert-tensor-parallel-size 1 for whole experts")
    if etp > 1 and not sequence_parallel:
        raise ConfigError(f"--expert-tensor-parallel-size {etp} needs --sequence-parallel here (Megatron-LM's MoE layer "
                          f"refuses TP without it in training): the split experts take the sequence parts' tokens")
    if m.moe_ffn_hidden_size % etp:
        raise ConfigError(f"--expert-tensor-parallel-size {etp} must divide the experts' ffn size "
                          f"{m.moe_ffn_hidden_size} (--moe-ffn-hidden-size): each rank holds ffn / ETP of every expert")
    if sp > 1:
        raise ConfigError("Megatron-LM's MoE runs without DeepSpeed-Ulysses sequence parallelism here; use "
                          "Megatron sequence parallelism (--sequence-parallel) or context parallelism")
    if tp > 1 and ep > 1 and not sequence_parallel:
        # Megatron-LM's MoELayer.forward refuses TP > 1 without sequence parallelism in training; here the tensor
        # parallel ranks would hold the same tokens, which the expert parallel dispatch (over TP and DP ranks,
        # model/mlm_moe.py) needs distinct
        raise ConfigError(f"--expert-model-parallel-size {ep} at --tensor-model-parallel-size {tp} needs "
                          f"--sequence-parallel (as Megatron-LM): the experts take tokens from distinct sequence parts")
    # Megatron-LM's expert grid: ETP x EP x expert data parallel ranks tile the stage's ranks holding distinct tokens,
    # TP x DP (``dp``: DP x CP) with sequence parallelism, DP without (whose TP ranks hold the same tokens, ETP = EP = 1)
    distinct = sequence_parallel and tp > 1
    ranks = tp * dp if distinct else dp
    if ep < 1 or experts % ep or ranks % (ep * etp):
        kind = "tensor x data parallel" if distinct else "data parallel"
        raise ConfigError(f"--expert-model-parallel-size {ep} must divide --num-experts {experts}, and ETP {etp} x EP "
                          f"{ep} the {ranks} {kind} ranks of a pipeline stage (Megatron-LM's expert grid of ETP x EP x "
                          f"expert data parallel ranks)")
    if 1 < etp < tp and zero_stage == 0 and precision != "fp32":
        # DeepSpeed's ZeRO-0 bf16/fp16 optimizers sum the experts' norm over TP x PP, then EP
        # (runtime/utils.py get_global_norm_of_tensors): more than one copy of each shard when ETP < TP
        raise ConfigError(f"--expert-tensor-parallel-size {etp} below --tensor-model-parallel-size {tp} under "
                          f"DeepSpeed's {precision} optimizer without ZeRO: its gradient norm would count expert "
                          f"shards {tp // etp} times; use --use-distributed-optimizer (ZeRO 1) or fp32")
    if (m.moe_router_topk == 1 and m.moe_router_score_function == "softmax" and not m.moe_router_pre_softmax
            and "sinkhorn" not in m.moe_router_load_balancing_type):
        # Megatron-LM's TransformerConfig.__post_init__ refuses the same: a softmax over one selected logit is 1,
        # whose gradient is zero, so the router would never learn
        raise ConfigError("--moe-router-topk 1 with softmax scores needs --moe-router-pre-softmax (a softmax over the "
                          "one selected logit is 1 and gives the router no gradient), as Megatron-LM requires")
    if m.moe_router_enable_expert_bias and m.moe_router_score_function == "softmax":
        # Megatron-LM's TransformerConfig.__post_init__ asserts the same
        raise ConfigError("--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid (or "
                          "sqrtsoftplus): the bias is added to the scores the top-k is taken from")
    groups, group_k = m.moe_router_num_groups, m.moe_router_group_topk
    if group_k and not (groups and experts % groups == 0 and group_k <= groups and k >= group_k):
        # Megatron-LM's TransformerConfig.__post_init__ asserts the first three; group_limited_topk takes the top
        # k / group_topk of each group
        raise ConfigError(f"--moe-router-group-topk {group_k} needs --moe-router-num-groups G dividing --num-experts "
                          f"{experts} with {group_k} <= G, and --moe-router-topk {k} >= {group_k}")
    if m.moe_pad_expert_input_to_capacity and m.moe_expert_capacity_factor is None:
        raise ConfigError("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")
    if ep > 1 and zero_stage == 3:
        raise ConfigError(f"--expert-model-parallel-size {ep} cannot run under ZeRO stage 3: DeepSpeed's engine "
                          f"refuses expert parameters there; use ZeRO stage 1 or 2")
