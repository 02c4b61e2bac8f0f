"""Hugging Face mixture-of-experts classes on Megatron-LM's MoE layer (``model/mlm_moe.py``), both ways.

``MixtralForCausalLM``, ``Qwen2MoeForCausalLM``, ``Qwen3MoeForCausalLM``, ``OlmoeForCausalLM`` (transformers
``models/mixtral``, ``models/qwen2_moe``, ``models/qwen3_moe``, ``models/olmoe``) and the MoE layers of ``DeepseekV3ForCausalLM`` (``_deepseek_config``:
sigmoid scores, expert bias, group-limited top-k, scaling, shared experts) and ``DeepseekV2ForCausalLM``
(``_deepseek_v2_config``: softmax scores, group-limited greedy top-k) import onto Megatron-LM's layer; a
checkpoint trained with it exports to the class that can express it (``gpt_hf.choose_architecture``). Mixtral
checkpoints trained on the older DeepSpeed-MoE layer still export through ``mixtral_hf``.

Routing, transformers -> Megatron-LM (moe_utils.topk_routing_with_score_function):

- Mixtral (``MixtralTopKRouter``): softmax over all experts in fp32, top k, divided by their sum. That is the
  softmax over the k largest logits: Megatron-LM's softmax router without --moe-router-pre-softmax.
- Qwen2-MoE / Qwen3-MoE (``Qwen2MoeTopKRouter``): softmax over all experts, top k, divided by their sum only
  with ``norm_topk_prob``. ``norm_topk_prob`` true is Mixtral's routing; false (Qwen2-MoE's default) keeps the
  softmax probabilities of all experts: --moe-router-pre-softmax.
- ``decoder_sparse_step`` / ``mlp_only_layers``: layer i (from 0) has experts when ``(i + 1) % step == 0`` and
  i is not in ``mlp_only_layers`` (``Qwen2MoeDecoderLayer``); the others are dense MLPs of
  ``intermediate_size``: --moe-layer-freq with one 0/1 per layer (an integer N where the pattern is
  Megatron-LM's ``i % N == 0``).
- Qwen2-MoE's shared expert (``shared_expert_intermediate_size``) with its sigmoid gate
  ``shared_expert_gate`` [1, hidden]: --moe-shared-expert-intermediate-size with --moe-shared-expert-gate
  (``SharedExperts.gate_weight``, the same vector).
- ``router_aux_loss_coef``: --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff (Switch's loss,
  which is what transformers' ``load_balancing_loss_func`` computes); it only matters in training.

- OLMoE (``OlmoeForCausalLM``, ``OlmoeTopKRouter``): Qwen2-MoE's routing (softmax over all experts, top k,
  renormalized only with ``norm_topk_prob``, false in OLMoE-1B-7B: --moe-router-pre-softmax), experts of
  ``intermediate_size`` on every layer, no shared expert. Its ``q_norm`` / ``k_norm`` are RMSNorms over the whole
  query / key projection (``OlmoeAttention``: ``RMSNorm(hidden_size)`` and ``RMSNorm(num_kv_heads x head_dim)``
  on ``q_proj`` / ``k_proj``'s outputs): --qk-layernorm --qk-layernorm-scope projection (ours; Megatron-LM's
  --qk-layernorm normalizes each head). ``clip_qkv`` (clamping q, k and v) has no equivalent and is refused.
  A ``router_z_loss_coef`` in the config (OLMoE was trained with a router z-loss; transformers' class reads
  none) is --moe-z-loss-coeff. Every class here is exported with it where --moe-z-loss-coeff is set (an extra
  config field, which transformers keeps and ignores) and imported with it, so a model leaves and returns with
  its training's z-loss.

Tensors (ours inside transformer layer i -> the hub's layout, which transformers 5 fuses on loading,
``conversion_mapping.py``; its own fused ``mlp.experts.gate_up_proj`` [E, 2F, H] (gate rows first) and
``down_proj`` [E, H, F] are read too, and are exactly our ``linear_fc1`` / ``linear_fc2``):

- ``mlp.router.weight`` [E, H] -> ``mlp.gate.weight`` (Mixtral: ``block_sparse_moe.gate.weight``);
- ``mlp.experts.linear_fc1.weight`` [E, 2F, H] = per expert [gate; up] -> ``mlp.experts.e.gate_proj`` /
  ``up_proj`` (Mixtral: ``block_sparse_moe.experts.e.w1`` / ``w3``); ``linear_fc2`` [E, H, F] -> ``down_proj``
  (``w2``);
- ``mlp.shared_experts.linear_fc1/fc2.weight`` -> ``mlp.shared_expert.gate_proj/up_proj/down_proj``,
  ``mlp.shared_experts.gate_weight`` -> ``mlp.shared_expert_gate.weight`` (DeepSeek: ``mlp.shared_experts.*``);
- DeepSeek's ``mlp.router.expert_bias`` -> ``mlp.gate.e_score_correction_bias``.
"""
from __future__ import annotations

import dataclasses
import shlex

import torch

from megatron_ds.config import moe_selection
from megatron_ds.config.schema import ModelConfig
from megatron_ds.errors import ConfigError

MIXTRAL, QWEN2_MOE, QWEN3_MOE, OLMOE = "mixtral", "qwen2_moe", "qwen3_moe", "olmoe"
DEEPSEEK_V3, DEEPSEEK_V2 = "deepseek_v3", "deepseek_v2"
CLASSES = {QWEN2_MOE: "Qwen2MoeForCausalLM", QWEN3_MOE: "Qwen3MoeForCausalLM", OLMOE: "OlmoeForCausalLM"}
_NAMES = {MIXTRAL: "MixtralForCausalLM", DEEPSEEK_V3: "DeepseekV3ForCausalLM", DEEPSEEK_V2: "DeepseekV2ForCausalLM",
          **CLASSES}

ROUTER, EXPERT_BIAS = "mlp.router.weight", "mlp.router.expert_bias"
FC1, FC2 = "mlp.experts.linear_fc1.weight", "mlp.experts.linear_fc2.weight"
SHARED_FC1, SHARED_FC2 = "mlp.shared_experts.linear_fc1.weight", "mlp.shared_experts.linear_fc2.weight"
SHARED_GATE = "mlp.shared_experts.gate_weight"
# the HF config fields each class's import reads (any other MoE field of these classes is refused by name when
# it differs from the value that means "nothing")
_INERT = {"output_router_logits": (False, None), "router_jitter_noise": (0, 0.0, None)}


@dataclasses.dataclass(frozen=True)
class HFNames:
    """One layer's HF MoE tensor names (``None``: the class has no such tensor)."""
    router: str
    experts: str  # + "{e}.{gate|up|down}.weight"
    proj: tuple  # (gate, up, down) names of an expert's matrices
    shared: str | None = None  # + "{gate|up|down}.weight"
    shared_gate: str | None = None
    bias: str | None = None


def hf_names(arch: str, i: int) -> HFNames:
    if arch == MIXTRAL:
        p = f"model.layers.{i}.block_sparse_moe."
        return HFNames(p + "gate.weight", p + "experts.", ("w1", "w3", "w2"))
    p = f"model.layers.{i}.mlp."
    shared = {QWEN2_MOE: (p + "shared_expert.", p + "shared_expert_gate.weight"),
              DEEPSEEK_V3: (p + "shared_experts.", None), DEEPSEEK_V2: (p + "shared_experts.", None)
              }.get(arch, (None, None))
    bias = p + "gate.e_score_correction_bias" if arch == DEEPSEEK_V3 else None
    return HFNames(p + "gate.weight", p + "experts.", ("gate_proj", "up_proj", "down_proj"), *shared, bias)


def moe_to_hf(arch: str, i: int, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Layer ``i``'s MoE tensors (our names without the layer prefix, EP 1) as ``arch``'s; every ``mlp.*``
    tensor must find a place (one left over would be dropped from the export)."""
    n = hf_names(arch, i)
    out = {n.router: t[ROUTER]}
    for e, (fc1, fc2) in enumerate(zip(t[FC1], t[FC2])):
        gate, up = fc1.chunk(2, dim=0)
        for name, x in zip(n.proj, (gate, up, fc2)):
            out[f"{n.experts}{e}.{name}.weight"] = x
    if SHARED_FC1 in t and n.shared is not None:
        gate, up = t[SHARED_FC1].chunk(2, dim=0)
        for name, x in zip(n.proj, (gate, up, t[SHARED_FC2])):
            out[f"{n.shared}{name}.weight"] = x
        if SHARED_GATE in t and n.shared_gate is not None:
            out[n.shared_gate] = t[SHARED_GATE]
    if n.bias is not None:  # DeepSeek's router always adds its bias: zeros for a model trained without one
        out[n.bias] = t[EXPERT_BIAS] if EXPERT_BIAS in t else torch.zeros(t[ROUTER].shape[0], dtype=torch.float32)
    placed = {ROUTER, FC1, FC2} | ({SHARED_FC1, SHARED_FC2} if n.shared else set()) | (
        {SHARED_GATE} if n.shared_gate else set()) | ({EXPERT_BIAS} if n.bias else set())
    left = sorted(k for k in t if k.startswith("mlp.") and k not in placed)
    if left:
        raise ConfigError(f"layer {i + 1}: {left[0]} has no place in {_NAMES[arch]}")
    return out


def moe_from_hf(arch: str, i: int, experts: int, get) -> dict[str, torch.Tensor]:
    """Inverse of ``moe_to_hf``: ``get(hf_name)`` returns a tensor or None; reads the hub's per-expert layout or
    transformers 5's fused one."""
    n = hf_names(arch, i)
    fused = f"model.layers.{i}.mlp.experts."
    out = {ROUTER: get(n.router) if get(n.router) is not None else get(f"model.layers.{i}.mlp.gate.weight")}
    if get(fused + "gate_up_proj") is not None:
        out[FC1], out[FC2] = get(fused + "gate_up_proj"), get(fused + "down_proj")
    else:
        mats = [[get(f"{n.experts}{e}.{name}.weight") for name in n.proj] for e in range(experts)]
        missing = [f"{n.experts}{e}.{name}.weight" for e, ms in enumerate(mats) for name, x in zip(n.proj, ms)
                   if x is None]
        if missing:
            raise ConfigError(f"the model has no tensor {missing[0]} (layer {i + 1}'s experts)")
        out[FC1] = torch.stack([torch.cat([gate, up]) for gate, up, _ in mats])
        out[FC2] = torch.stack([down for _, _, down in mats])
    if n.shared is not None:
        gate, up, down = (get(f"{n.shared}{name}.weight") for name in n.proj)
        out[SHARED_FC1], out[SHARED_FC2] = torch.cat([gate, up]), down
        if n.shared_gate is not None:
            out[SHARED_GATE] = get(n.shared_gate)
    if n.bias is not None:
        out[EXPERT_BIAS] = get(n.bias)
    missing = [k for k, v in out.items() if v is None]
    if missing:
        raise ConfigError(f"the model has no tensor for layer {i + 1}'s {missing[0]} ({_NAMES[arch]}'s MoE block)")
    return out


def _refuse_fields(d: dict, kind: str, fields: dict) -> None:
    """``fields``: name -> the values this import computes exactly; anything else is refused by name."""
    bad = [f"{k} {d[k]!r}" for k, ok in {**_INERT, **fields}.items() if k in d and d[k] not in ok]
    if bad:
        raise ConfigError(f"{', '.join(bad)}: {CLASSES.get(kind, _NAMES.get(kind, kind))} with "
                          f"{'this value' if len(bad) == 1 else 'these values'} has no equivalent here")


def check_importable(d: dict, kind: str) -> None:
    """ConfigError (one line) for what the import cannot compute exactly."""
    if kind == OLMOE:
        head_dim = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
        if head_dim * d["num_attention_heads"] != d["hidden_size"]:  # q_norm is RMSNorm(hidden_size)
            raise ConfigError(f"head_dim {head_dim} x num_attention_heads {d['num_attention_heads']} != hidden_size "
                              f"{d['hidden_size']}: OlmoeAttention's q_norm (of hidden_size) cannot apply")
        _refuse_fields(d, kind, {"clip_qkv": (None,), "attention_bias": (False, None)})
    elif kind in CLASSES:
        _refuse_fields(d, kind, {"use_sliding_window": (False, None), "attention_bias": (False, None)})


def layer_pattern(d: dict, kind: str) -> tuple[bool, ...]:
    """Which layers (from 0) have experts (``Qwen2MoeDecoderLayer``; Mixtral: every layer)."""
    n = d["num_hidden_layers"]
    if kind in (MIXTRAL, OLMOE):
        return (True,) * n
    if kind in (DEEPSEEK_V3, DEEPSEEK_V2):  # DeepseekV3/V2DecoderLayer: dense below first_k_dense_replace
        first = d.get("first_k_dense_replace", 3 if kind == DEEPSEEK_V3 else 0)
        return tuple(bool(d.get("n_routed_experts")) and i >= first for i in range(n))
    step, dense = d.get("decoder_sparse_step", 1), set(d.get("mlp_only_layers") or ())
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(n))


def freq_spec(pattern: tuple[bool, ...]) -> str | None:
    """--moe-layer-freq for a layer pattern: None (every layer), an integer N, or a 0/1 list."""
    if all(pattern):
        return None
    for every in range(2, len(pattern) + 1):
        if pattern == moe_selection.layer_freq(str(every), len(pattern)):
            return str(every)
    return "[" + ",".join(str(int(p)) for p in pattern) + "]"


def model_config(kind: str, base: ModelConfig, d: dict) -> ModelConfig:
    """Our (unresolved) ModelConfig of an HF MoE config ``d`` given its attention and norms (``base``):
    Megatron-LM's MoE layer with the routing the class computes (module docstring)."""
    m = (_deepseek_config(base, d) if kind == DEEPSEEK_V3 else _deepseek_v2_config(base, d) if kind == DEEPSEEK_V2
         else _routed_config(kind, base, d))
    if d.get("router_z_loss_coef"):  # (module docstring)
        m = dataclasses.replace(m, moe_z_loss_coeff=float(d["router_z_loss_coef"]))
    return m


def _routed_config(kind: str, base: ModelConfig, d: dict) -> ModelConfig:
    """``model_config`` of Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE."""
    experts = d.get("num_experts") or d["num_local_experts"]  # (transformers 5.x saves Qwen3-MoE's as the latter)
    norm_topk = True if kind == MIXTRAL else bool(d.get("norm_topk_prob", False))
    if d.get("num_experts_per_tok", 2) == 1 and norm_topk:
        # Megatron-LM's TransformerConfig.__post_init__: a softmax over one chosen logit has no gradient
        raise ConfigError("num_experts_per_tok 1 with renormalized weights (always 1): Megatron-LM refuses top-1 "
                          "softmax routing without --moe-router-pre-softmax (the router would get no gradient)")
    moe = dict(num_experts=(experts,), moe_router_topk=d.get("num_experts_per_tok", 2),
               moe_router_pre_softmax=not norm_topk, moe_layer_freq=freq_spec(layer_pattern(d, kind)),
               moe_router_load_balancing_type=("aux_loss",),
               moe_aux_loss_coeff=(float(d.get("router_aux_loss_coef", 0.001)),))
    if kind in (MIXTRAL, OLMOE):  # their experts are of intermediate_size
        moe["moe_ffn_hidden_size"] = base.ffn_hidden_size
    else:
        moe["moe_ffn_hidden_size"] = d["moe_intermediate_size"]
    if kind == OLMOE:
        moe.update(qk_layernorm=True, qk_layernorm_scope="projection")
    if kind == QWEN2_MOE:
        moe.update(moe_shared_expert_intermediate_size=d["shared_expert_intermediate_size"],
                   moe_shared_expert_gate=True)
    return dataclasses.replace(base, **moe)


def _deepseek_groups(d: dict, k: int) -> tuple[int, int] | None:
    """DeepSeek's group-limited routing as (--moe-router-num-groups, --moe-router-group-topk), None where it
    chooses every group. transformers scores a group by the sum of its top 2 experts (``DeepseekV3TopkRouter``),
    Megatron-LM by its top k / group_topk (``group_limited_topk``): the same where k / group_topk is 2, as in
    DeepSeek-V3 (k 8 of 4 groups)."""
    groups, group_k = d.get("n_group") or 1, d.get("topk_group") or 1
    if groups == 1 or group_k >= groups:
        return None
    if k // group_k != 2:
        raise ConfigError(f"n_group {groups}, topk_group {group_k} with num_experts_per_tok {k}: transformers scores "
                          f"a group by its top 2 experts, Megatron-LM's --moe-router-group-topk by its top "
                          f"num_experts_per_tok / topk_group ({k // group_k}); no equivalent here")
    return groups, group_k


def _deepseek_config(base: ModelConfig, d: dict) -> ModelConfig:
    """DeepSeek-V3's MoE (``DeepseekV3TopkRouter``, ``DeepseekV3MoE``): sigmoid scores in fp32, the top k chosen
    on scores + ``e_score_correction_bias`` within the chosen groups, weighted by their scores renormalized
    (``norm_topk_prob``) times ``routed_scaling_factor``; ``n_shared_experts`` shared experts of
    ``moe_intermediate_size`` each, ungated. Megatron-LM: --moe-router-score-function sigmoid
    --moe-router-enable-expert-bias (auxiliary-loss-free balancing, the bias the router adds) --moe-router-dtype
    fp32 --moe-router-topk-scaling-factor, which always renormalizes a top k > 1 and never a top 1."""
    k, ffn = d.get("num_experts_per_tok") or 8, d["moe_intermediate_size"]
    if bool(d.get("norm_topk_prob", True)) != (k > 1):
        raise ConfigError(f"norm_topk_prob {d.get('norm_topk_prob', True)} with num_experts_per_tok {k}: Megatron-LM's "
                          f"sigmoid router renormalizes exactly the top k > 1; no equivalent here")
    if not d.get("n_shared_experts"):
        raise ConfigError("n_shared_experts 0: DeepseekV3MoE always adds its shared experts (of moe_intermediate_size "
                          "x n_shared_experts); give it 1 or more")
    groups = _deepseek_groups(d, k)
    scale = float(d.get("routed_scaling_factor", 2.5))
    return dataclasses.replace(
        base, num_experts=(d["n_routed_experts"],), moe_router_topk=k, moe_ffn_hidden_size=ffn,
        moe_layer_freq=freq_spec(layer_pattern(d, DEEPSEEK_V3)),
        moe_shared_expert_intermediate_size=ffn * d["n_shared_experts"], moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, moe_router_dtype="fp32",
        moe_router_topk_scaling_factor=None if scale == 1.0 else scale,
        moe_router_num_groups=groups[0] if groups else None, moe_router_group_topk=groups[1] if groups else None,
        moe_router_load_balancing_type=("none",), moe_aux_loss_coeff=(0.0,))


def _deepseek_v2_config(base: ModelConfig, d: dict) -> ModelConfig:
    """DeepSeek-V2's MoE (``DeepseekV2TopkRouter``): softmax over all experts in fp32, the top k of those
    probabilities (``norm_topk_prob`` is not read: never renormalized) times ``routed_scaling_factor``:
    --moe-router-pre-softmax; ``topk_method`` "group_limited_greedy" keeps the ``topk_group`` groups with the
    largest single probability, Megatron-LM's group_limited_topk where topk / group_topk is 1 (its group score is
    the sum of the top topk / group_topk)."""
    k, ffn = d.get("num_experts_per_tok") or 1, d["moe_intermediate_size"]
    method, groups = d.get("topk_method", "greedy"), None
    if method == "group_limited_greedy" and d.get("topk_group") and d["topk_group"] < d["n_group"]:
        if k // d["topk_group"] != 1:
            raise ConfigError(f"topk_method group_limited_greedy with num_experts_per_tok {k}, topk_group "
                              f"{d['topk_group']}: transformers scores a group by its largest probability, "
                              f"Megatron-LM's --moe-router-group-topk by the sum of its top {k // d['topk_group']}; no "
                              f"equivalent here")
        groups = (d["n_group"], d["topk_group"])
    elif method not in ("greedy", "group_limited_greedy"):
        raise ConfigError(f"topk_method {method!r}: DeepSeek-V2 imports with greedy or group_limited_greedy")
    if not d.get("n_shared_experts"):
        raise ConfigError("n_shared_experts 0: DeepseekV2Moe always adds its shared experts; give it 1 or more")
    scale = float(d.get("routed_scaling_factor", 1.0))
    return dataclasses.replace(
        base, num_experts=(d["n_routed_experts"],), moe_router_topk=k, moe_ffn_hidden_size=ffn,
        moe_layer_freq=freq_spec(layer_pattern(d, DEEPSEEK_V2)), moe_router_pre_softmax=True,
        moe_shared_expert_intermediate_size=ffn * d["n_shared_experts"], moe_router_dtype="fp32",
        moe_router_topk_scaling_factor=None if scale == 1.0 else scale,
        moe_router_num_groups=groups[0] if groups else None, moe_router_group_topk=groups[1] if groups else None,
        moe_router_load_balancing_type=("aux_loss",), moe_aux_loss_coeff=(float(d.get("aux_loss_alpha", 0.001)),))
    # (aux_loss_alpha: the hub's DeepSeek-V2 config.json; transformers' class computes no such loss)


def _deepseek_problems(m: ModelConfig, arch: str = DEEPSEEK_V3) -> list[str]:
    name, out = _NAMES[arch], []
    pattern = moe_selection.layer_freq(m.moe_layer_freq, m.num_layers)
    first = pattern.index(True)
    if not all(pattern[first:]):
        out.append(f"--moe-layer-freq {m.moe_layer_freq} ({name} has dense layers first, then experts on every "
                   f"layer: first_k_dense_replace)")
    score, per_group = ("sigmoid", 2) if arch == DEEPSEEK_V3 else ("softmax", 1)
    if m.moe_router_score_function != score:
        out.append(f"--moe-router-score-function {m.moe_router_score_function} ({name}'s router is a {score})")
    if arch == DEEPSEEK_V2 and not m.moe_router_pre_softmax:  # (at top-1 too: V2 weighs it p, ours 1)
        out.append(f"no --moe-router-pre-softmax ({name} takes the top-k softmax probabilities as they are)")
    if arch == DEEPSEEK_V2 and m.moe_router_enable_expert_bias:
        out.append(f"--moe-router-enable-expert-bias ({name}'s router has no expert bias)")
    if m.moe_router_group_topk and m.moe_router_topk // m.moe_router_group_topk != per_group:
        out.append(f"--moe-router-group-topk {m.moe_router_group_topk} with --moe-router-topk {m.moe_router_topk} "
                   f"({name} scores a group by its top {per_group} expert{'s' if per_group > 1 else ''})")
    shared = m.moe_shared_expert_intermediate_size
    if not shared or shared % m.moe_ffn_hidden_size:
        out.append(f"--moe-shared-expert-intermediate-size {shared} ({name} has n_shared_experts >= 1 shared "
                   f"experts of --moe-ffn-hidden-size {m.moe_ffn_hidden_size})")
    if m.moe_shared_expert_gate:
        out.append(f"--moe-shared-expert-gate ({name}'s shared experts have no gate)")
    return out


def problems(arch: str, m: ModelConfig) -> list[str]:
    """What ``arch`` cannot express of a resolved Megatron-LM MoE model's MoE side, by flag (its attention and
    norms are checked as its dense sibling's: ``gpt_hf``)."""
    name, out = _NAMES[arch], []
    if m.moe_expert_capacity_factor is not None:
        out.append(f"--moe-expert-capacity-factor {m.moe_expert_capacity_factor:g} ({name} never drops tokens)")
    if m.add_bias_linear:
        out.append(f"biases (no --disable-bias-linear; {name}'s experts have none)")
    if arch in (DEEPSEEK_V3, DEEPSEEK_V2):
        return out + _deepseek_problems(m, arch)
    pattern = moe_selection.layer_freq(m.moe_layer_freq, m.num_layers)
    if arch in (MIXTRAL, OLMOE) and not all(pattern):
        out.append(f"--moe-layer-freq {m.moe_layer_freq} ({name} has experts on every layer; "
                   f"Qwen2MoeForCausalLM/Qwen3MoeForCausalLM have dense layers)")
    if m.moe_router_score_function != "softmax":
        out.append(f"--moe-router-score-function {m.moe_router_score_function} ({name}'s router is a softmax)")
    if arch == MIXTRAL and m.moe_router_pre_softmax:  # (at top-1 too: Mixtral weighs it 1, ours p)
        out.append(f"--moe-router-pre-softmax ({name} renormalizes the top-k probabilities; Qwen2Moe/Qwen3Moe "
                   f"ForCausalLM with norm_topk_prob false do not)")
    if m.moe_router_topk_scaling_factor not in (None, 1.0):
        out.append(f"--moe-router-topk-scaling-factor {m.moe_router_topk_scaling_factor:g} ({name} does not "
                   f"scale the routing weights)")
    if m.moe_router_enable_expert_bias:
        out.append(f"--moe-router-enable-expert-bias ({name}'s router has no expert bias)")
    shared = m.moe_shared_expert_intermediate_size
    if arch == QWEN2_MOE and not (shared and m.moe_shared_expert_gate):
        out.append(f"{'no --moe-shared-expert-gate' if shared else 'no --moe-shared-expert-intermediate-size'} "
                   f"({name} has a shared expert with a sigmoid gate)")
    elif arch != QWEN2_MOE and shared:
        out.append(f"--moe-shared-expert-intermediate-size {shared} ({name} has no shared expert; "
                   f"Qwen2MoeForCausalLM has)")
    if arch == MIXTRAL and m.moe_ffn_hidden_size != m.ffn_hidden_size and not all(pattern):
        out.append(f"--moe-ffn-hidden-size {m.moe_ffn_hidden_size} with dense layers of --ffn-hidden-size "
                   f"{m.ffn_hidden_size} ({name} has one intermediate_size)")
    if arch != MIXTRAL and m.window_size is not None:
        out.append(f"--window-size {m.window_size} (imported and exported without {name}'s sliding window)")
    return out


def config_kwargs(arch: str, m: ModelConfig) -> dict:
    """The MoE fields of ``arch``'s transformers config for ``m`` (``problems`` empty), with the router z-loss
    coefficient where one is set (module docstring)."""
    out = _routing_kwargs(arch, m)
    if m.moe_z_loss_coeff:
        out["router_z_loss_coef"] = m.moe_z_loss_coeff
    return out


def _routing_kwargs(arch: str, m: ModelConfig) -> dict:
    aux = moe_selection.balancing(m).get("aux_loss", 0.0)
    common = dict(num_experts_per_tok=m.moe_router_topk, router_aux_loss_coef=aux, output_router_logits=False)
    if arch == MIXTRAL:
        return dict(common, num_local_experts=m.num_experts[0], intermediate_size=m.moe_ffn_hidden_size,
                    router_jitter_noise=0.0)
    pattern = moe_selection.layer_freq(m.moe_layer_freq, m.num_layers)
    if arch == DEEPSEEK_V3:
        groups = (m.moe_router_num_groups, m.moe_router_group_topk) if m.moe_router_group_topk else (1, 1)
        return dict(n_routed_experts=m.num_experts[0], num_experts_per_tok=m.moe_router_topk,
                    moe_intermediate_size=m.moe_ffn_hidden_size, first_k_dense_replace=pattern.index(True),
                    n_shared_experts=m.moe_shared_expert_intermediate_size // m.moe_ffn_hidden_size,
                    routed_scaling_factor=m.moe_router_topk_scaling_factor or 1.0, n_group=groups[0],
                    topk_group=groups[1], norm_topk_prob=m.moe_router_topk > 1, output_router_logits=False)
    if arch == DEEPSEEK_V2:
        grouped = bool(m.moe_router_group_topk)
        return dict(n_routed_experts=m.num_experts[0], num_experts_per_tok=m.moe_router_topk,
                    moe_intermediate_size=m.moe_ffn_hidden_size, first_k_dense_replace=pattern.index(True),
                    n_shared_experts=m.moe_shared_expert_intermediate_size // m.moe_ffn_hidden_size,
                    routed_scaling_factor=m.moe_router_topk_scaling_factor or 1.0,
                    topk_method="group_limited_greedy" if grouped else "greedy",
                    n_group=m.moe_router_num_groups if grouped else None,
                    topk_group=m.moe_router_group_topk if grouped else None, norm_topk_prob=False,
                    output_router_logits=False)
    out = dict(common, num_experts=m.num_experts[0], moe_intermediate_size=m.moe_ffn_hidden_size,
               norm_topk_prob=not m.moe_router_pre_softmax, decoder_sparse_step=1,
               mlp_only_layers=[i for i, moe in enumerate(pattern) if not moe], use_sliding_window=False)
    if arch == QWEN2_MOE:
        out.update(shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size, qkv_bias=m.add_qkv_bias)
    if arch == OLMOE:  # experts of intermediate_size on every layer; no sliding window fields
        for k in ("moe_intermediate_size", "decoder_sparse_step", "mlp_only_layers", "use_sliding_window"):
            del out[k]
        out.update(intermediate_size=m.moe_ffn_hidden_size, clip_qkv=None)
    return out


def model_flags(m: ModelConfig) -> list[str]:
    """pretrain_gpt.py flags (Megatron-LM's) of a resolved Megatron-LM MoE model's MoE side."""
    f = [f"--num-experts {m.num_experts[0]}", f"--moe-router-topk {m.moe_router_topk}",
         f"--moe-ffn-hidden-size {m.moe_ffn_hidden_size}"]
    if m.moe_layer_freq is not None:
        f.append(f"--moe-layer-freq {shlex.quote(m.moe_layer_freq)}")
    if m.moe_shared_expert_intermediate_size:
        f.append(f"--moe-shared-expert-intermediate-size {m.moe_shared_expert_intermediate_size}")
    if m.moe_shared_expert_gate:
        f.append("--moe-shared-expert-gate")
    if m.moe_router_score_function != "softmax":
        f.append(f"--moe-router-score-function {m.moe_router_score_function}")
    if m.moe_router_pre_softmax:
        f.append("--moe-router-pre-softmax")
    if m.moe_router_topk_scaling_factor is not None:
        f.append(f"--moe-router-topk-scaling-factor {m.moe_router_topk_scaling_factor:g}")
    if m.moe_router_group_topk:
        f += [f"--moe-router-num-groups {m.moe_router_num_groups}",
              f"--moe-router-group-topk {m.moe_router_group_topk}"]
    if m.moe_router_enable_expert_bias:
        f.append("--moe-router-enable-expert-bias")
    if m.moe_router_dtype is not None:
        f.append(f"--moe-router-dtype {m.moe_router_dtype}")
    f.append("--moe-router-load-balancing-type " + " ".join(m.moe_router_load_balancing_type))
    f.append("--moe-aux-loss-coeff " + " ".join(f"{c:g}" for c in m.moe_aux_loss_coeff))
    if m.moe_z_loss_coeff is not None:
        f.append(f"--moe-z-loss-coeff {m.moe_z_loss_coeff:g}")
    return f
