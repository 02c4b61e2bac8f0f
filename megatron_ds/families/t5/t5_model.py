"""T5 (encoder-decoder) from the same tensor parallel layers as the GPT, as DeepSpeed pipeline specs.

Megatron-DeepSpeed's T5 (megatron/model/t5_model.py ``T5Model``, language_model.py
``TransformerLanguageModel`` with ``add_encoder`` and ``add_decoder``, transformer.py
``ParallelTransformerLayer`` of ``LayerType.decoder`` and ``ParallelAttention`` of
``AttnType.cross_attn``), transcribed:

- one embedding (word embeddings split over the vocabulary, learned absolute positions, dropout)
  serves the encoder's and the decoder's inputs; the output layer is the same word embedding
  plus a vocab-parallel bias (``T5LMHead``);
- encoder layers: pre-LN self-attention over the padding mask, MLP; then a final norm;
- decoder layers: pre-LN causal self-attention (with the decoder's padding), then
  ``post_attention_layernorm`` -> cross-attention (``inter_attention``: a query projection of the
  decoder's state, a fused key/value projection of the encoder's output, per head [k; v]) over the
  encoder's padding, then ``post_inter_attention_layernorm`` -> MLP; then a final norm;
- opt-in, as HF's T5 (transformers models/t5/modeling_t5.py): relative position biases (one
  table per stack, bidirectional buckets in the encoder, causal in the decoder, none in the
  cross-attention), relu and gated-GeLU MLPs (``ParallelMLP``: --relu, --geglu);
- the loss is the vocab-parallel cross entropy averaged over the decoder's ``loss_mask``
  (pretrain_t5.py ``loss_func``).

Masks. Upstream's dataset builds ``[s_q, s_k]`` masks as outer products of "token is not padding"
(megatron/data/t5_dataset.py ``make_attention_mask``, times ``make_history_mask`` for the decoder);
so the ``[b, s]`` key flags carry all of it and are what travels between pipeline stages. Queries at
padding positions attend to the real keys here where upstream's -10000 fill makes them attend
uniformly: those positions feed nothing that reaches the loss (their keys are masked for every
other query, their labels have ``loss_mask`` 0), so the loss and every gradient are the same.

Pipeline (``--pipeline-model-parallel-split-rank R``): stages ``< R`` hold the encoder, stages
``>= R`` the decoder, layers split evenly within each part as Megatron's ``_get_num_layers`` does.
What travels between stages:

    encoder stages:  (encoder hidden, decoder tokens, encoder flags, decoder flags[, encoder bias])
    decoder stages:  (decoder hidden, encoder output, encoder flags, decoder flags[, decoder bias])

The bias (``--position-embedding-type relative``, HF T5's relative position buckets; not in
Megatron-DeepSpeed) is ``[1, heads/tp, s, s]``, computed from its stack's table in the tied embedding
by the stack's embedding layer and added to that stack's self-attention scores; it travels like
the encoder output, so its gradient from every stage reaches the table.

The encoder output rides in every decoder stage's activation tuple. DeepSpeed's pipeline engine
(runtime/pipe/engine.py, ``_exec_send_grads`` / ``_exec_backward_pass``) sends back the gradient of
every floating tensor of a tuple and runs backward from every floating output, so a decoder stage's
encoder-output gradient is its own cross-attentions' plus the one from the stages after it, and the
last encoder stage receives the sum over all decoder layers (what Megatron's schedules.py
``backward_step`` accumulates by hand). That needs DeepSpeed's activation partitioning off (it
partitions only the first tensor and sends no other gradient): ``config/deepspeed_json`` does that
for T5. The flags are int64, never bool (DeepSpeed pops a trailing bool tensor as "the mask").
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, TiedLayerSpec
from torch import nn

from megatron_ds import ds_compat
from megatron_ds.config.schema import ModelConfig
from megatron_ds.families.t5.t5_params import t5_stage_bounds
from megatron_ds.model.language_model import language_model_loss_fn, mask_padded_vocab_
from megatron_ds.model.norms import build_norm
from megatron_ds.model.pipeline_model import PipelineModel, SequentialModel
from megatron_ds.model.transformer import ParallelTransformerLayer, hidden_dropout, padding_attention_mask
from megatron_ds.parallel.fp8 import Fp8Recipe
from megatron_ds.parallel.layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                         init_method_normal, scaled_init_method_normal,
                                         set_tensor_parallel_attributes)
from megatron_ds.parallel.random import get_rng_tracker
from megatron_ds.parallel.utils import divide, tp_rank, tp_world_size

TIED_KEY = "embed"


def relative_position_bucket(relative_position: torch.Tensor, *, bidirectional: bool, num_buckets: int,
                             max_distance: int) -> torch.Tensor:
    """HF transformers' ``T5Attention._relative_position_bucket`` (models/t5/modeling_t5.py),
    transcribed: half the buckets per direction when bidirectional (keys after the query in the
    upper half), else only keys at or before the query count; distances below half the buckets get
    one bucket each, larger ones logarithmically many up to ``max_distance``, the rest the last."""
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).long() * num_buckets
        distance = relative_position.abs()
    else:
        distance = -torch.clamp(relative_position, max=0)
    max_exact = num_buckets // 2
    is_small = distance < max_exact
    large = max_exact + (torch.log(distance.float() / max_exact) / math.log(max_distance / max_exact)
                         * (num_buckets - max_exact)).long()
    large = torch.clamp(large, max=num_buckets - 1)
    return buckets + torch.where(is_small, distance, large)


def relative_position_bias(table: torch.Tensor, sq: int, sk: int, *, bidirectional: bool, num_buckets: int,
                           max_distance: int) -> torch.Tensor:
    """``[1, heads, sq, sk]`` score biases from a ``[buckets, heads]`` table (HF's ``compute_bias``)."""
    position = torch.arange(sk, device=table.device)[None, :] - torch.arange(sq, device=table.device)[:, None]
    bucket = relative_position_bucket(position, bidirectional=bidirectional, num_buckets=num_buckets,
                                      max_distance=max_distance)
    # contiguous: it is sent to the stack's next pipeline stage (torch.distributed sends no strided views)
    return F.embedding(bucket, table).permute(2, 0, 1).unsqueeze(0).contiguous()


def biased_mask(bias: list, mask: torch.Tensor) -> torch.Tensor:
    """The boolean ``mask`` alone, or with a relative position bias (``[bias]`` of the activation
    tuple) as SDPA's additive float mask: the bias where allowed, the dtype's minimum elsewhere (HF
    adds its mask the same way)."""
    if not bias:
        return mask
    b = bias[0]
    return torch.where(mask, b, torch.full((), torch.finfo(b.dtype).min, dtype=b.dtype, device=b.device))


def causal_padding_mask(flags: torch.Tensor) -> torch.Tensor:
    """The decoder's self-attention mask: keys not in the future and not padding, ``[b, 1, s, s]``."""
    s = flags.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=flags.device).tril()
    return causal[None, None] & padding_attention_mask(flags)


class T5Embedding(nn.Module):
    """Word embeddings (split over the vocabulary), optional learned absolute positions (replicated),
    and the LM head's vocab-parallel bias; the one module DeepSpeed ties across the first stage,
    the decoder's first stage and the last stage (``TIED_KEY``)."""

    def __init__(self, hidden_size: int, padded_vocab_size: int, *, max_position_embeddings: int | None,
                 init_method_std: float, dropout: float, lm_head_bias: bool, tp_group=None,
                 params_dtype: torch.dtype = torch.float32, device=None, vocab_size: int | None = None,
                 fp32_residual: bool = False, relative: tuple[int, int, int] | None = None,
                 async_grad_comm: bool = False):
        super().__init__()
        self.tp_group, self.vocab_size, self.dropout, self.fp32_residual = tp_group, vocab_size, dropout, fp32_residual
        init = init_method_normal(init_method_std)
        self.word_embeddings = VocabParallelEmbedding(padded_vocab_size, hidden_size, tp_group=tp_group,
                                                      init_method=init, params_dtype=params_dtype, device=device)
        self.position_embeddings = None
        if max_position_embeddings is not None:
            table = torch.empty(max_position_embeddings, hidden_size, dtype=torch.float32)
            init(table)  # on the CPU generator in fp32, as LanguageModelEmbedding: device- and dtype-independent numbers
            self.position_embeddings = nn.Embedding.from_pretrained(table.to(device=device, dtype=params_dtype),
                                                                    freeze=False)
        self.lm_head = None
        if lm_head_bias:  # T5LMHead: zeros, split over the vocabulary like the logits
            self.lm_head = nn.Module()
            self.lm_head.bias = nn.Parameter(torch.zeros(padded_vocab_size // tp_world_size(tp_group),
                                                         dtype=params_dtype, device=device))
            set_tensor_parallel_attributes(self.lm_head.bias, partition_dim=0, stride=1)
        self._projection = ColumnParallelLinear(hidden_size, padded_vocab_size, tp_group=tp_group, bias=False,
                                                gather_output=False, skip_weight_param_allocation=True,
                                                async_grad_comm=async_grad_comm)
        # --position-embedding-type relative: (buckets, max distance, heads), drawn after the rest (the
        # other tables are those of the same seed without it). One [buckets, heads]
        # table per stack (HF keeps it in block 0 and hands its bias to every layer); here it is in
        # the tied module, so every stage of a stack sees the same table and DeepSpeed sums its
        # gradients across the copies. Heads split over TP ranks as the attention heads (contiguous).
        self.relative = relative
        if relative is not None:
            buckets, _, heads = relative
            tp, rank = tp_world_size(tp_group), tp_rank(tp_group)
            for stack in ("encoder", "decoder"):
                table = torch.empty(buckets, heads, dtype=torch.float32)
                init(table)  # the full table on the CPU generator: the same numbers at any TP size
                local = table[:, rank * heads // tp:(rank + 1) * heads // tp].contiguous()
                param = nn.Parameter(local.to(device=device, dtype=params_dtype))
                set_tensor_parallel_attributes(param, partition_dim=1, stride=1)
                holder = nn.Module()  # "<stack>_relative_attention_bias.weight", as HF's nn.Embedding
                holder.weight = param
                setattr(self, f"{stack}_relative_attention_bias", holder)

    def forward(self, inputs):
        """The first layer: ``(enc tokens, dec tokens, enc flags, dec flags)`` -> the encoder's input.
        A forward of its own (not a ``forward_fn``): DeepSpeed saves and loads a tied module only in
        the file of a layer that is the module itself (``PipelineModule.save_state_dict``)."""
        enc_tokens, dec_tokens, enc_flags, dec_flags = inputs
        s = enc_tokens.shape[1]
        return (self.embed(enc_tokens), dec_tokens, enc_flags, dec_flags, *self.position_bias("encoder", s))

    def position_bias(self, stack: str, s: int) -> tuple:
        """``(bias,)`` for a stack's self-attention at length ``s`` (bidirectional buckets in the
        encoder, causal in the decoder, as HF's ``is_decoder``), or ``()`` without relative positions.
        It rides in the activation tuple to every layer of the stack (on any stage), so its gradient
        flows back to this table like the encoder output's to the encoder."""
        if self.relative is None:
            return ()
        buckets, distance, _ = self.relative
        return (relative_position_bias(getattr(self, f"{stack}_relative_attention_bias").weight, s, s,
                                       bidirectional=stack == "encoder", num_buckets=buckets,
                                       max_distance=distance),)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """``[b, s]`` ids -> ``[s, b, h]``; positions 0..s-1 (t5_model.py ``t5_position_ids``)."""
        x = self.word_embeddings(tokens)
        if self.position_embeddings is not None:
            x = x + self.position_embeddings(torch.arange(tokens.shape[1], device=tokens.device))[None]
        x = x.transpose(0, 1).contiguous()
        if self.fp32_residual:
            x = x.float()
        return hidden_dropout(x, self.dropout, self.training, False)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[s, b, h]`` -> ``[b, s, V/tp]``: the tied word embedding plus the bias (``parallel_lm_logits``)."""
        out, _ = self._projection(hidden, weight=self.word_embeddings.weight)
        if self.lm_head is not None:
            out = out + self.lm_head.bias
        return mask_padded_vocab_(out, self.vocab_size, self.tp_group).transpose(0, 1)


def embed_decoder(embedding: T5Embedding, inputs):
    """The decoder's first layer: the encoder output joins the decoder's embedded input."""
    encoder_output, dec_tokens, enc_flags, dec_flags = inputs
    return (embedding.embed(dec_tokens), encoder_output, enc_flags, dec_flags,
            *embedding.position_bias("decoder", dec_tokens.shape[1]))


def lm_logits(embedding: T5Embedding, hidden):
    return embedding.logits(hidden)


class T5EncoderLayer(ParallelTransformerLayer):
    """A bidirectional layer (``self_attn_mask_type="padding"``) over the encoder's padding mask,
    passing the rest of the encoder stages' tuple through."""

    def __init__(self, cfg: ModelConfig, layer_number: int, **kwargs):
        super().__init__(cfg, layer_number, self_attn_mask_type="padding", **kwargs)

    def forward(self, inputs, kv_cache=None):
        hidden, other, enc_flags, dec_flags, *bias = inputs
        mask = biased_mask(bias, padding_attention_mask(enc_flags))
        normed = self.input_layernorm(hidden)
        hidden = self._residual(*self.self_attention(normed, mask), normed if self.residual_after_norm else hidden)
        normed = self.post_attention_layernorm(hidden)
        hidden = self._residual(*self.mlp(normed), normed if self.residual_after_norm else hidden)
        return (hidden, other, enc_flags, dec_flags, *bias)


class ParallelCrossAttention(nn.Module):
    """Decoder-to-encoder attention, heads split over the tensor parallel ranks (Megatron's
    ParallelAttention with ``AttnType.cross_attn``: ``query`` [heads * d], ``key_value`` laid out
    per head as [k; v], ``dense``). Multi-head only, as upstream (it asserts no GQA there)."""

    def __init__(self, cfg: ModelConfig, *, tp_group=None, params_dtype=torch.float32, device=None,
                 fp8: Fp8Recipe | None = None):
        super().__init__()
        tp = tp_world_size(tp_group)
        self.kv_channels, self.num_heads = cfg.kv_channels, divide(cfg.num_attention_heads, tp)
        self.attention_dropout = cfg.attention_dropout
        projection = cfg.num_attention_heads * cfg.kv_channels
        common = dict(tp_group=tp_group, bias=cfg.add_bias_linear, params_dtype=params_dtype, device=device, fp8=fp8)
        init = init_method_normal(cfg.init_method_std)
        column = dict(gather_output=False, init_method=init, async_grad_comm=cfg.async_tensor_model_parallel_allreduce)
        self.query = ColumnParallelLinear(cfg.hidden_size, projection, **column, **common)
        self.key_value = ColumnParallelLinear(cfg.hidden_size, 2 * projection, **column, **common)
        self.dense = RowParallelLinear(projection, cfg.hidden_size, input_is_parallel=True,
                                       init_method=scaled_init_method_normal(cfg.init_method_std, cfg.num_layers),
                                       **common)

    def forward(self, x: torch.Tensor, encoder_output: torch.Tensor, mask: torch.Tensor):
        sq, b = x.shape[:2]
        sk = encoder_output.shape[0]
        q, _ = self.query(x)
        kv, _ = self.key_value(encoder_output)
        q = q.view(sq, b, self.num_heads, self.kv_channels).permute(1, 2, 0, 3)
        kv = kv.view(sk, b, self.num_heads, 2, self.kv_channels)
        k, v = (t.permute(1, 2, 0, 3) for t in (kv[..., 0, :], kv[..., 1, :]))
        p = self.attention_dropout if self.training else 0.0
        if p > 0.0:
            with get_rng_tracker().fork():  # each TP rank holds different heads: different masks
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.dense(out.permute(2, 0, 1, 3).reshape(sq, b, self.num_heads * self.kv_channels))


class T5DecoderLayer(ParallelTransformerLayer):
    """Causal self-attention, cross-attention over the encoder output, MLP (Megatron's
    ``LayerType.decoder`` layer: ``default_decoder_cross_attention`` between the two)."""

    def __init__(self, cfg: ModelConfig, layer_number: int, *, tp_group=None, params_dtype=torch.float32,
                 device=None, recompute_attention: bool = False, fp8: Fp8Recipe | None = None):
        super().__init__(cfg, layer_number, tp_group=tp_group, params_dtype=params_dtype, device=device,
                         recompute_attention=recompute_attention, fp8=fp8)
        self.inter_attention = ParallelCrossAttention(cfg, tp_group=tp_group, params_dtype=params_dtype,
                                                      device=device, fp8=fp8)
        self.post_inter_attention_layernorm = build_norm(
            cfg.normalization, cfg.hidden_size, cfg.layernorm_epsilon, params_dtype=params_dtype, device=device,
            one_plus=cfg.apply_layernorm_1p, fp32_input=cfg.fp32_residual_connection)

    def forward(self, inputs, kv_cache=None):
        hidden, encoder_output, enc_flags, dec_flags, *bias = inputs
        after_norm = self.residual_after_norm
        normed = self.input_layernorm(hidden)
        # (no position bias in the cross-attention, as HF's EncDecAttention)
        hidden = self._residual(*self.self_attention(normed, biased_mask(bias, causal_padding_mask(dec_flags))),
                                normed if after_norm else hidden)
        normed = self.post_attention_layernorm(hidden)
        hidden = self._residual(*self.inter_attention(normed, encoder_output, padding_attention_mask(enc_flags)),
                                normed if after_norm else hidden)
        normed = self.post_inter_attention_layernorm(hidden)
        hidden = self._residual(*self.mlp(normed), normed if after_norm else hidden)
        return (hidden, encoder_output, enc_flags, dec_flags, *bias)


class T5EncoderFinalNorm(nn.Module):
    """The encoder's final norm; hands the decoder embedding ``(encoder output, dec tokens, flags)``
    (the encoder's position bias ends here: a tensor sent on that nobody uses would have no gradient
    to send back, which DeepSpeed's pipeline engine asserts against)."""

    def __init__(self, cfg: ModelConfig, *, params_dtype=torch.float32, device=None):
        super().__init__()
        self.final_layernorm = build_norm(cfg.normalization, cfg.hidden_size, cfg.layernorm_epsilon,
                                          params_dtype=params_dtype, device=device, one_plus=cfg.apply_layernorm_1p,
                                          fp32_input=cfg.fp32_residual_connection)

    def forward(self, inputs):
        hidden, *rest = inputs
        return (self.final_layernorm(hidden), *rest[:3])


class T5DecoderFinalNorm(T5EncoderFinalNorm):
    """The decoder's final norm; only the decoder's hidden state goes on, to the LM head."""

    def forward(self, inputs):
        return self.final_layernorm(inputs[0])


T5_LAYERS = (T5EncoderLayer, T5DecoderLayer)


def check_t5_shape(m: ModelConfig, *, decoder_num_layers: int, num_stages: int, split_rank: int | None) -> None:
    """What the T5 builders cannot build, in one line naming the values (ValueError)."""
    if m.position_embedding_type not in ("learned_absolute", "relative", "none"):
        raise ValueError(f"T5 takes learned absolute positions (Megatron's), relative (HF T5's) or none, not "
                         f"{m.position_embedding_type}")
    if m.num_key_value_heads != m.num_attention_heads:
        raise ValueError("T5's cross-attention is multi-head only (Megatron-DeepSpeed asserts no GQA there)")
    if m.untie_embeddings_and_output_weights:
        raise ValueError("T5's output layer is the tied word embedding (Megatron-DeepSpeed asserts so for decoders)")
    if num_stages > 1:
        if split_rank is None or not 0 < split_rank < num_stages:
            raise ValueError(f"T5 at pipeline size {num_stages} needs --pipeline-model-parallel-split-rank in "
                             f"[1, {num_stages - 1}] (encoder stages before it, decoder stages from it)")
        for name, layers, ranks in (("encoder", m.num_layers, split_rank),
                                    ("decoder", decoder_num_layers, num_stages - split_rank)):
            if layers % ranks:  # megatron/model/transformer.py _get_num_layers asserts the same
                raise ValueError(f"{name} layers ({layers}) must be divisible by the {ranks} pipeline stages "
                                 f"given to the {name}")


def t5_layer_specs(m: ModelConfig, *, decoder_num_layers: int, padded_vocab_size: int, tp_group=None,
                   params_dtype: torch.dtype = torch.float32, device=None, vocab_size: int | None = None,
                   recompute_granularity: str | None = None, fp8: Fp8Recipe | None = None) -> list:
    """The T5 as DeepSpeed layer specs: tied embedding (encoder input), encoder layers, encoder
    final norm, tied embedding (decoder input), decoder layers, decoder final norm, tied LM head.
    ``fp8``: the run's FP8 recipe (``Layout.fp8``), which the layers' GEMMs run with."""
    common = dict(params_dtype=params_dtype, device=device)
    positions = m.max_position_embeddings if m.position_embedding_type == "learned_absolute" else None
    embedding = dict(max_position_embeddings=positions, init_method_std=m.init_method_std, dropout=m.hidden_dropout,
                     lm_head_bias=m.add_bias_linear, tp_group=tp_group, vocab_size=vocab_size,
                     fp32_residual=m.fp32_residual_connection, async_grad_comm=m.async_tensor_model_parallel_allreduce,
                     **common)
    relative = m.position_embedding_type == "relative"
    if relative:
        embedding["relative"] = (m.relative_attention_num_buckets, m.relative_attention_max_distance,
                                 m.num_attention_heads)
    attrs = ["word_embeddings.weight"] + (["position_embeddings.weight"] if positions else []) + (
        ["lm_head.bias"] if m.add_bias_linear else []) + (
        ["encoder_relative_attention_bias.weight", "decoder_relative_attention_bias.weight"] if relative else [])

    def tied(forward_fn):
        return TiedLayerSpec(TIED_KEY, T5Embedding, m.hidden_size, padded_vocab_size, forward_fn=forward_fn,
                             tied_weight_attr=attrs, **embedding)

    layer = dict(tp_group=tp_group, recompute_attention=recompute_granularity == "selective", fp8=fp8, **common)
    specs = [tied(None)]
    specs += [LayerSpec(T5EncoderLayer, m, i + 1, **layer) for i in range(m.num_layers)]
    specs += [LayerSpec(T5EncoderFinalNorm, m, **common), tied(embed_decoder)]
    specs += [LayerSpec(T5DecoderLayer, m, i + 1, **layer) for i in range(decoder_num_layers)]
    specs += [LayerSpec(T5DecoderFinalNorm, m, **common), tied(lm_logits)]
    return specs


class T5PipelineModel(PipelineModel):
    """The T5 as a ``PipelineModule``, partitioned at the split rank (``families/t5/t5_params.py``
    ``t5_stage_bounds``)."""

    def __init__(self, specs: list, *, parts: list[int], **kwargs):
        object.__setattr__(self, "t5_parts", parts)  # read by _partition_layers, inside super().__init__
        super().__init__(specs, **kwargs)

    @ds_compat.overrides_deepspeed_hook
    def _partition_layers(self, method: str = "uniform") -> None:
        ds_compat.set_pipeline_partition(self, self.t5_parts)

    @ds_compat.overrides_deepspeed_hook
    def _is_checkpointable(self, funcs) -> bool:
        return any(isinstance(f, T5_LAYERS) for f in funcs)

    @ds_compat.overrides_deepspeed_hook
    def get_tied_weights_and_groups(self):
        """The tied weights DeepSpeed all-reduces across stages, each with a gradient: a stage that
        holds the tied embedding without using all of it (the first stage never reads the LM-head
        bias, the last never reads the positions) would have None there, and DeepSpeed's
        ``_exec_reduce_tied_grads`` skips a None gradient, so the stages' collectives would no
        longer match. A zero gradient is what that stage contributes anyway."""
        pairs = super().get_tied_weights_and_groups()
        for weight, _ in pairs:
            ds_compat.zero_grad_where_missing(weight)
        return pairs


def build_pipeline_t5(m: ModelConfig, topology, *, decoder_num_layers: int, split_rank: int | None,
                      padded_vocab_size: int, tp_group, seed: int, activation_checkpoint_interval: int = 0,
                      loss_report=None, **spec_kwargs) -> T5PipelineModel:
    """The T5 as a DeepSpeed ``PipelineModule`` over ``topology`` (see the module docstring); its
    loss (the GPT's masked token mean) reports to ``loss_report``."""
    stages = topology.get_dim("pipe")
    check_t5_shape(m, decoder_num_layers=decoder_num_layers, num_stages=stages, split_rank=split_rank)
    specs = t5_layer_specs(m, decoder_num_layers=decoder_num_layers, padded_vocab_size=padded_vocab_size,
                           tp_group=tp_group, **spec_kwargs)
    return T5PipelineModel(specs, parts=t5_stage_bounds(m.num_layers, decoder_num_layers, stages, split_rank),
                           topology=topology, seed=seed, loss_fn=language_model_loss_fn(tp_group, None, loss_report),
                           activation_checkpoint_interval=activation_checkpoint_interval)


def build_sequential_t5(m: ModelConfig, *, decoder_num_layers: int, padded_vocab_size: int, tp_group=None,
                        seed: int, activation_checkpoint_interval: int = 0, loss_report=None,
                        **spec_kwargs) -> SequentialModel:
    """The T5 as one plain module with the pipeline model's weights and state-dict names; forward
    takes ``(enc tokens, dec tokens, enc flags, dec flags)`` and returns ``[b, s_dec, V/tp]`` logits."""
    check_t5_shape(m, decoder_num_layers=decoder_num_layers, num_stages=1, split_rank=None)
    specs = t5_layer_specs(m, decoder_num_layers=decoder_num_layers, padded_vocab_size=padded_vocab_size,
                           tp_group=tp_group, **spec_kwargs)
    return SequentialModel(specs, seed=seed, loss_fn=language_model_loss_fn(tp_group, None, loss_report),
                           activation_checkpoint_interval=activation_checkpoint_interval)


def build_stage_t5(m: ModelConfig, *, num_stages: int, stage: int, decoder_num_layers: int, padded_vocab_size: int,
                   tp_group=None, seed: int, activation_checkpoint_interval: int = 0, **spec_kwargs) -> SequentialModel:
    """The modules stage ``stage`` of ``build_pipeline_t5``'s model holds (its tied copy included),
    as one module without topology or accelerator: --dry-run builds it on the meta device."""
    check_t5_shape(m, decoder_num_layers=decoder_num_layers, num_stages=num_stages,
             split_rank=m.pipeline_model_parallel_split_rank)
    specs = t5_layer_specs(m, decoder_num_layers=decoder_num_layers, padded_vocab_size=padded_vocab_size,
                           tp_group=tp_group, **spec_kwargs)
    parts = t5_stage_bounds(m.num_layers, decoder_num_layers, num_stages, m.pipeline_model_parallel_split_rank)
    return SequentialModel(specs, seed=seed, layer_indices=range(parts[stage], parts[stage + 1]),
                           loss_fn=language_model_loss_fn(tp_group),
                           activation_checkpoint_interval=activation_checkpoint_interval)


__all__ = ["T5Embedding", "T5EncoderLayer", "T5DecoderLayer", "ParallelCrossAttention", "T5PipelineModel",
           "build_pipeline_t5", "build_sequential_t5", "build_stage_t5", "t5_layer_specs", "check_t5_shape"]
