"""Parameter names and layouts of universal checkpoints: ours and Megatron-DeepSpeed's GPT.

Names (deepspeedai/Megatron-DeepSpeed megatron/model/gpt_model.py, language_model.py,
transformer.py), mapped to one canonical key per parameter:

- ``GPTModelPipe`` (a DeepSpeed PipelineModule; names are ``<layer index>.<name>``): layer 0 is the
  ``_to_float16`` function (no parameters), 1 the embedding (``tied_modules.embed.*`` when tied,
  else ``1.word_embeddings.weight``, ``1.position_embeddings.weight``), then one layer per
  transformer block (``self_attention.query_key_value``, ``self_attention.dense``,
  ``mlp.dense_h_to_4h``, ``mlp.dense_4h_to_h``, ``input_layernorm``, ``post_attention_layernorm``),
  the final norm (``<L+2>.weight`` / ``.bias``) and the untied head (``<L+3>.lm_head.weight``);
- ``GPTModel`` (``--no-pipeline-parallel``): ``language_model.embedding.word_embeddings.weight``,
  ``language_model.encoder.layers.<i>.*``, ``language_model.encoder.final_layernorm.*``,
  ``language_model.output_layer.weight``;
- ours (``families/gpt/gpt_model.py``): ``tied_modules.embed.*`` or ``0.word_embeddings.weight``,
  ``<i>.*`` from 1, ``<L+1>.final_layernorm.*``, ``<L+2>.output_layer.weight``.

Block indices are taken relative to the first block found, so the offsets need not be known.

Layouts. Megatron-DeepSpeed's fused QKV rows were grouped per key/value head, ``[q heads of the
group; k; v]`` (transformer.py before commit 676a482c, 2024-12-04: ``mixed_x_layer.view(...,
-1, num_key_value_groups + 2, head_dim)`` then ``split_tensor``), which is our layout; since that
commit (the FPDT change, which also added the ``--ds-sequence-parallel-fpdt`` argument, so its
checkpoints' ``args`` have ``ds_sequence_parallel_fpdt``) each rank's rows are ``[Q; K; V]`` of its
heads (``each_hidden_size = shape[-1] // 3``), correct for equal query and key/value heads only.
ds_to_universal concatenates the ranks' slices, so such a tensor is reordered using the saved TP
size. SwiGLU's ``dense_h_to_4h`` holds ``[gate_r; up_r]`` per rank; with the pattern
``PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0`` (gpt_model.py ``_get_swiglu_col_parallel_param_patterns``)
the converter merges it to ``[gate; up]`` (ours), without it the ranks' blocks are reordered here.
"""
from __future__ import annotations

import re

import torch

from megatron_ds.errors import ConfigError

BLOCK_SUFFIXES = tuple(f"{m}.{p}" for m in (
    "input_layernorm", "self_attention.query_key_value", "self_attention.dense", "post_attention_layernorm",
    "mlp.dense_h_to_4h", "mlp.dense_4h_to_h",
    "self_attention.q_layernorm", "self_attention.k_layernorm",  # (--qk-layernorm: ours)
    # --multi-latent-attention (model/mla.py; q_layernorm is its query latent's norm there)
    "self_attention.linear_q_proj", "self_attention.linear_q_down_proj", "self_attention.linear_q_up_proj",
    "self_attention.linear_kv_down_proj", "self_attention.kv_layernorm", "self_attention.linear_kv_up_proj")
    for p in ("weight", "bias"))
_BLOCK = re.compile(r"^(?:language_model\.encoder\.layers\.)?(\d+)\.(.+)$")
_FINAL = re.compile(r"^(?:\d+\.(?:final_layernorm\.)?|language_model\.encoder\.final_layernorm\.)(weight|bias)$")
_WHY = (("expert", "mixture-of-experts layers are not supported"), ("moe", "mixture-of-experts layers are not supported"),
        ("tokentype", "token-type embeddings are not supported"), ("pooler", "a pooler is not part of a GPT"),
        ("rotary", "a learned rotary table is not supported"))


def canonical(name: str, *, ours: bool = False):
    """A parameter's canonical key: ("word_embeddings",), ("position_embeddings",),
    ("output_layer",), ("final_layernorm", "weight"|"bias") or ("block", raw index, suffix);
    None when the name is none of these."""
    if name.endswith("word_embeddings.weight"):
        return ("word_embeddings",)
    if name.endswith("position_embeddings.weight"):
        return ("position_embeddings",)
    if name.endswith(("output_layer.weight", "lm_head.weight")):
        return ("output_layer",)
    m = _FINAL.match(name)
    if m and (not ours or "final_layernorm" in name):
        return ("final_layernorm", m.group(1))
    m = _BLOCK.match(name)
    if m and m.group(2) in BLOCK_SUFFIXES:
        return ("block", int(m.group(1)) - (1 if ours else 0), m.group(2))
    return None


def index(names: list[str]) -> dict[tuple, str]:
    """canonical key (blocks numbered from 0) -> folder name, for a universal checkpoint's
    parameter folders; a parameter with no counterpart in our GPT is refused naming it."""
    out, blocks = {}, {}
    for name in names:
        key = canonical(name)
        if key is None:
            why = next((w for word, w in _WHY if word in name.lower()), "it has no counterpart in this toolkit's GPT")
            raise ConfigError(f"universal checkpoint parameter {name} cannot be loaded: {why}")
        if key[0] == "block":
            blocks[key] = name
        else:
            out[key] = name
    first = min((k[1] for k in blocks), default=0)
    out.update({("block", k[1] - first, k[2]): v for k, v in blocks.items()})
    return out


def signature_from_args(args, path: str) -> dict:
    """The model-shape fields of our layout signature, from Megatron-DeepSpeed's saved ``args``
    (megatron/arguments.py names; values as its validate_args() leaves them)."""
    a = lambda k, d=None: getattr(args, k, d)  # noqa: E731
    experts = a("num_experts", [1]) or [1]
    if max(experts if isinstance(experts, (list, tuple)) else [experts]) > 1:
        raise ConfigError(f"{path}: a mixture-of-experts model (--num-experts {experts}) is not supported")
    for flag in ("apply_layernorm_1p", "squared_relu", "onnx_safe", "openai_gelu"):
        if a(flag):
            raise ConfigError(f"{path}: the checkpoint's model uses --{flag.replace('_', '-')}, which this toolkit "
                              f"does not have")
    rope = bool(a("use_rotary_position_embeddings")) or a("position_embedding_type") == "rope"
    learned = bool(a("add_position_embedding", True)) and a("position_embedding_type", "learned_absolute") != "rope"
    if rope and learned:
        raise ConfigError(f"{path}: learned position embeddings together with rotary ones are not supported")
    heads = a("num_attention_heads")
    sig = dict(num_layers=a("num_layers"), hidden_size=a("hidden_size"), num_attention_heads=heads,
               num_key_value_heads=a("num_key_value_heads") or heads, ffn_hidden_size=a("ffn_hidden_size"),
               kv_channels=a("kv_channels"), normalization=a("normalization", "layernorm"),
               position_embedding_type="rope" if rope else "learned_absolute" if learned else "none",
               swiglu=bool(a("swiglu")), add_bias_linear=bool(a("add_bias_linear", True)),
               untie_embeddings_and_output_weights=bool(a("untie_embeddings_and_output_weights")))
    if learned:
        sig["max_position_embeddings"] = a("max_position_embeddings")
    return sig


def to_our_layout(key: tuple, tensor: torch.Tensor, entry, model, uc) -> torch.Tensor:
    """A full tensor of a universal checkpoint in our layout (see the module docstring)."""
    if key[0] != "block" or uc.saved_tp == 1:
        return tensor
    suffix, tp = key[2], uc.saved_tp
    if suffix.startswith("self_attention.query_key_value") and not uc.ours and hasattr(uc.args,
                                                                                   "ds_sequence_parallel_fpdt"):
        heads, groups = model.num_attention_heads, model.num_key_value_heads
        if heads != groups:
            raise ConfigError(f"{uc.path}: written by Megatron-DeepSpeed after commit 676a482c, whose fused QKV "
                              f"splits in thirds, which is wrong for grouped-query attention ({heads} query vs "
                              f"{groups} key/value heads): cannot be mapped")
        rest = tensor.shape[1:]
        # [rank, q/k/v, head, d] -> [rank, head, q/k/v, d]
        return tensor.view(tp, 3, heads // tp, -1, *rest).transpose(1, 2).reshape(tensor.shape)
    sub_params = entry.get("param_n_sub_params", 1) if isinstance(entry, dict) else 1
    if suffix.startswith("mlp.dense_h_to_4h") and model.swiglu and sub_params != 2:
        return tensor.view(tp, 2, -1, *tensor.shape[1:]).transpose(0, 1).reshape(tensor.shape)
    return tensor
