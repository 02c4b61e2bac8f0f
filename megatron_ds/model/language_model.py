"""The language model's pieces around the transformer layers: embedding, final norm, output layer,
loss (Megatron's ``language_model.py``: every model family builds from them; the GPT chains them
as below, BERT's embedding adds token types, T5 masks its logits the same way).

Each piece is a module whose forward takes one object (a tensor or a tuple), so they chain as
DeepSpeed pipeline layers (``model/pipeline_model.py``; the GPT's specs: ``families/gpt/gpt_model.py``):

    (tokens, position_ids)  --LanguageModelEmbedding-->  hidden [s, b, h]  (or (hidden, document_ids))
    --ParallelTransformerLayer x N-->  --FinalNorm-->  hidden  --output layer-->  logits [b, s, V/tp]

Logits stay split over the vocabulary (each tensor parallel rank holds V/tp columns); the loss is
the vocab-parallel cross entropy, so the full [b, s, V] tensor never exists.

Vocabulary padding (``--make-vocab-size-divisible-by`` x TP rows) changes nothing: given the real
``vocab_size``, the output layers set the padding columns' logits to -inf, so no softmax, loss or
sampling ever sees them, and the model computes the same function at any TP size.

With liger-kernel installed, on CUDA at TP 1 while training, the output layers hand
``HiddenForLoss(hidden, weight, vocab_size)`` to the loss instead of logits and the loss fuses
the projection (``model/liger.py``; ``fused_loss=False`` or ``--no-liger-kernel`` turns it off).
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from megatron_ds.model.liger import HiddenForLoss, fused_linear_loss, use_fused_linear_loss
from megatron_ds.model.moe_layer import DROP_FRACTION
from megatron_ds.model.norms import build_norm
from megatron_ds.model.param_groups import EMBEDDING_OR_OUTPUT
from megatron_ds.model.transformer import hidden_dropout, split_activation
from megatron_ds.parallel.chunked_cross_entropy import chunked_vocab_parallel_cross_entropy
from megatron_ds.parallel.cross_entropy import masked_token_loss, vocab_parallel_cross_entropy
from megatron_ds.parallel.layers import ColumnParallelLinear, VocabParallelEmbedding, init_method_normal
from megatron_ds.parallel.mappings import scatter_to_sequence_parallel_region
from megatron_ds.parallel.utils import tp_rank, tp_world_size


def document_ids(tokens: torch.Tensor, eod_token: int) -> torch.Tensor:
    """``[batch, seq]`` index of the document each token belongs to, for ``--reset-attention-mask``.

    An end-of-document token belongs to the document it ends (Megatron's mask lets it see its own
    document), so a token's id is the number of EOD tokens strictly before it.
    """
    is_eod = (tokens == eod_token).long()
    return torch.cumsum(is_eod, dim=1) - is_eod


def sequence_shard(t: torch.Tensor, sp_group) -> torch.Tensor:
    """This sequence parallel rank's consecutive ``seq / SP`` positions of ``[batch, seq]`` ``t``
    (all of it without a group), as Megatron-DeepSpeed's ``get_batch`` slices tokens and labels."""
    size = tp_world_size(sp_group)  # any group; None is a group of one
    if size == 1:
        return t
    n = t.shape[1] // size
    return t[:, tp_rank(sp_group) * n:(tp_rank(sp_group) + 1) * n]


def mask_padded_vocab_(logits: torch.Tensor, vocab_size: int | None, tp_group) -> torch.Tensor:
    """Set this rank's padding columns (global ids >= vocab_size) of ``[..., V/tp]`` logits to -inf,
    in place (no second logits-sized tensor; autograd gives those columns zero gradient)."""
    if vocab_size is not None:
        local = logits.size(-1)
        real_local = max(0, min(local, vocab_size - tp_rank(tp_group) * local))
        if real_local < local:
            logits[..., real_local:] = float("-inf")
    return logits


class LanguageModelEmbedding(nn.Module):
    """Word embeddings (split over the vocabulary) + learned positions (replicated), dropout,
    transposed to ``[s, b, h]`` and, under sequence parallelism, split along the sequence.

    With ``eod_token`` set (``--reset-attention-mask``) the output is ``(hidden, document_ids)``.
    ``max_position_embeddings=None`` builds no position table (rope / no positions); the copy of
    the word embeddings that serves as the tied output layer on the last pipeline stage is built
    that way too, since it needs only the word embedding weight. ``vocab_size``: the real
    vocabulary, whose padding columns ``logits`` masks (None: no masking). ``fp32_residual``
    (--fp32-residual-connection): the output starts the residual stream in fp32.

    DeepSpeed-Ulysses (``sp_group``): every rank of the group gets the whole samples and embeds its
    own ``seq / SP`` positions (the position ids of those, so learned positions are the global
    ones); the document ids stay whole, since attention sees the whole sequence. Context parallelism
    (``cp``, a ``parallel.context_parallel.ContextParallel``): the same with this rank's two chunks.
    """

    def __init__(self, hidden_size: int, padded_vocab_size: int, *, max_position_embeddings: int | None,
                 init_method_std: float, dropout: float, tp_group=None, sequence_parallel: bool = False,
                 params_dtype: torch.dtype = torch.float32, device=None, eod_token: int | None = None,
                 vocab_size: int | None = None, fused_loss: bool = False, fp32_residual: bool = False,
                 sp_group=None, async_grad_comm: bool = False, cp=None):
        """``async_grad_comm``: the output layer's (``ColumnParallelLinear``)."""
        super().__init__()
        self.vocab_size, self.fused_loss, self.fp32_residual = vocab_size, fused_loss, fp32_residual
        self.sp_group, self.cp = sp_group, cp
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel
        self.dropout = dropout
        self.eod_token = eod_token
        init = init_method_normal(init_method_std)
        self.word_embeddings = VocabParallelEmbedding(padded_vocab_size, hidden_size, tp_group=tp_group,
                                                      init_method=init, params_dtype=params_dtype, device=device)
        # --decoupled-lr's parameter (model/param_groups.py); the tied output layer's copy is this class too
        setattr(self.word_embeddings.weight, EMBEDDING_OR_OUTPUT, True)
        self.position_embeddings = None
        if max_position_embeddings is not None:
            # Initialized like the tensor parallel layers (fp32 on the CPU generator, then moved), so
            # the numbers do not depend on the device or dtype the model is built for.
            table = torch.empty(max_position_embeddings, hidden_size, dtype=torch.float32)
            init(table)
            self.position_embeddings = nn.Embedding.from_pretrained(table.to(device=device, dtype=params_dtype),
                                                                    freeze=False)
        # Parameter-less projection by the (tied) word embedding weight: the output layer.
        self._output_projection = ColumnParallelLinear(
            hidden_size, padded_vocab_size, tp_group=tp_group, bias=False, gather_output=False,
            sequence_parallel=sequence_parallel, skip_weight_param_allocation=True, async_grad_comm=async_grad_comm)

    def forward(self, inputs):
        tokens, position_ids = inputs
        documents = None if self.eod_token is None else document_ids(tokens, self.eod_token)
        if self.cp is not None:  # RoPE reads its positions from the chunks too (model/transformer.py)
            local_tokens, position_ids = self.cp.shard(tokens), self.cp.shard(position_ids)
        else:
            local_tokens = sequence_shard(tokens, self.sp_group)
            position_ids = sequence_shard(position_ids, self.sp_group)
        x = self.word_embeddings(local_tokens)
        if self.position_embeddings is not None:
            x = x + self.position_embeddings(position_ids)
        x = x.transpose(0, 1).contiguous()  # [b, s, h] -> [s, b, h]
        if self.fp32_residual:  # as Megatron's Embedding.forward (language_model.py): after the transpose
            x = x.float()
        if self.sequence_parallel:
            x = scatter_to_sequence_parallel_region(x, self.tp_group)
        x = hidden_dropout(x, self.dropout, self.training, self.sequence_parallel)
        return x if documents is None else (x, documents)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Output layer tied to the word embeddings: ``[s, b, h]`` -> ``[b, s, V/tp]``."""
        weight = self.word_embeddings.weight
        if use_fused_linear_loss(self.fused_loss, self.training, hidden, weight, self.tp_group):
            return HiddenForLoss(hidden, weight, self.vocab_size)
        out, _ = self._output_projection(hidden, weight=weight)
        return mask_padded_vocab_(out, self.vocab_size, self.tp_group).transpose(0, 1)


def with_moe_loss(output, moe_loss):
    """The output layers' output: the logits, or ``(logits, moe_loss)`` in an MoE model (the sum of its
    layers' auxiliary losses, ``model/transformer.py``), which the loss function adds."""
    return output if moe_loss is None else (output, moe_loss)


def split_moe_loss(output):
    """``with_moe_loss``'s inverse: ``(logits, moe_loss or None)``."""
    return output if type(output) is tuple else (output, None)  # HiddenForLoss (liger) is a NamedTuple


def tied_output_logits(embedding: LanguageModelEmbedding, inputs) -> torch.Tensor:
    """``TiedLayerSpec`` forward_fn of the output layer: project with the shared word embedding."""
    hidden, _, moe_loss = split_activation(inputs)
    return with_moe_loss(embedding.logits(hidden), moe_loss)


class OutputLayer(nn.Module):
    """Untied output layer (``--untie-embeddings-and-output-weights``): ``[s, b, h]`` -> ``[b, s, V/tp]``."""

    def __init__(self, hidden_size: int, padded_vocab_size: int, *, init_method_std: float, tp_group=None,
                 sequence_parallel: bool = False, params_dtype: torch.dtype = torch.float32, device=None,
                 vocab_size: int | None = None, fused_loss: bool = False, async_grad_comm: bool = False):
        super().__init__()
        self.tp_group, self.vocab_size, self.fused_loss = tp_group, vocab_size, fused_loss
        self.output_layer = ColumnParallelLinear(
            hidden_size, padded_vocab_size, tp_group=tp_group, bias=False, gather_output=False,
            init_method=init_method_normal(init_method_std), sequence_parallel=sequence_parallel,
            params_dtype=params_dtype, device=device, async_grad_comm=async_grad_comm)
        setattr(self.output_layer.weight, EMBEDDING_OR_OUTPUT, True)  # --decoupled-lr's (model/param_groups.py)

    def forward(self, inputs) -> torch.Tensor:
        hidden, _, moe_loss = split_activation(inputs)
        if use_fused_linear_loss(self.fused_loss, self.training, hidden, self.output_layer.weight, self.tp_group):
            return with_moe_loss(HiddenForLoss(hidden, self.output_layer.weight, self.vocab_size), moe_loss)
        out, _ = self.output_layer(hidden)
        return with_moe_loss(mask_padded_vocab_(out, self.vocab_size, self.tp_group).transpose(0, 1), moe_loss)


class FinalNorm(nn.Module):
    """The norm after the last transformer layer; drops the document ids, which end here (an MoE
    model's auxiliary loss goes on to the output layer).
    ``fp32_input`` (--fp32-residual-connection): it ends the fp32 residual stream, handing the
    output layer the weights' dtype (``model/norms.py`` ``Fp32InputNorm``)."""

    def __init__(self, normalization: str, hidden_size: int, eps: float, *, sequence_parallel: bool = False,
                 params_dtype: torch.dtype = torch.float32, device=None, one_plus: bool = False,
                 fp32_input: bool = False):
        super().__init__()
        self.final_layernorm = build_norm(normalization, hidden_size, eps, sequence_parallel=sequence_parallel,
                                          params_dtype=params_dtype, device=device, one_plus=one_plus,
                                          fp32_input=fp32_input)

    def forward(self, inputs) -> torch.Tensor:
        hidden, _, moe_loss = split_activation(inputs)
        return with_moe_loss(self.final_layernorm(hidden), moe_loss)


Z_LOSS_COEFF = 1e-4
"""--use-z-loss's coefficient: the Swallow fork of Megatron-LM hard-codes it (okoge-kaz/Megatron-LM,
megatron/core/tensor_parallel/cross_entropy.py at commit 306f6def6ad8fddb0a76fc8eda6f47ba784314db:
``log_Z = torch.log(sum_exp_logits) + logits_max; z_loss = 1e-4 * log_Z * log_Z; loss = loss + z_loss``
per token, before the loss mask's mean; the flag: megatron/training/arguments.py at commit
239e20902509a30d0ffad24b4f2fccd56841998a, ``--use-z-loss``, store_true), PaLM's value."""


def language_model_loss(output: torch.Tensor, labels_and_mask, *, tp_group=None, vocab_size: int | None = None,
                sp_group=None, report=None, moe_loss_coeff: float = 0.0, z_loss_coeff: float = 0.0,
                cp=None) -> torch.Tensor:
    """Language-model loss: vocab-parallel cross entropy (fp32) averaged over ``loss_mask``.

    ``output``: logits ``[b, s, V/tp]``; ``labels_and_mask``: ``(labels [b, s], loss_mask [b, s])``;
    ``vocab_size``: the real vocabulary (padding columns excluded; None: no padding).

    DeepSpeed-Ulysses (``sp_group``): ``output`` covers this rank's ``s / SP`` positions and the loss
    is their sum over the whole sequence's mask count, so the SP ranks' losses add up to the mean
    (Megatron-DeepSpeed's loss_func divides the shard's sum by the unsliced ``loss_mask.sum()``), which
    is what DeepSpeed's gradient reduction expects: a sum over SP x DP divided by DP.

    Context parallelism (``cp``): ``output`` covers this rank's two chunks; the loss is their sum over the
    whole sequence's mask count times CP, since DeepSpeed averages the gradients over DP x CP ranks
    (parallel/groups.py). Its gradient is Megatron-LM's (pretrain_gpt.py's loss_func sums the shard's losses and
    the schedule multiplies by the CP size, megatron/core/pipeline_parallel/schedules.py forward_step), and the
    CP ranks' values average to the sequence's mean, the number DeepSpeed's loss average over DP x CP logs.

    ``report``: the ``megatron_ds.model.loss_report.LossReport`` of the run (the engine builder's), to
    which the loss reports the named scalars it declares; None reports nothing.

    Mixture of experts: ``output`` is ``(logits, moe_loss)`` and the loss is the language-model loss +
    ``moe_loss_coeff`` x the layers' summed auxiliary losses (Megatron-DeepSpeed's pretrain_gpt.py
    forward_step and loss_func), reported as "lm loss" and "moe loss" (upstream's log names).

    --calculate-per-token-loss: the report's ``token_scale`` turns the mean into the micro-batch's share
    of the global batch's token mean (``model/token_loss.py``).

    ``z_loss_coeff`` (--use-z-loss: ``Z_LOSS_COEFF``): each token's cross entropy gains that times the
    square of its logits' log-sum-exp over the whole vocabulary (across the tensor parallel ranks), inside
    the mean over ``loss_mask`` and the reported "lm loss", as the fork that defines the flag does.
    """
    output, moe_loss = split_moe_loss(output)
    lm = _lm_loss(output, labels_and_mask, tp_group, vocab_size, sp_group, z_loss_coeff, cp)
    if report is not None and report.token_scale is not None:  # --calculate-per-token-loss (model/token_loss.py)
        lm = report.token_scale.apply(lm, labels_and_mask[1])
    if moe_loss is None:
        return lm
    moe = moe_loss_coeff * moe_loss.sum()
    if report:
        report.add("lm loss", lm)
        report.add("moe loss", moe)
    return lm + moe


def reported_names(moe: bool) -> tuple[str, ...]:
    """The names ``language_model_loss`` (and an MoE model's layers) report: a ``LossReport``'s declaration."""
    return ("lm loss", "moe loss", DROP_FRACTION) if moe else ()


def _lm_loss(output, labels_and_mask, tp_group, vocab_size, sp_group, z_loss_coeff, cp=None) -> torch.Tensor:
    labels, loss_mask = labels_and_mask
    if cp is None and tp_world_size(sp_group) == 1:
        return _mean_token_loss(output, labels, loss_mask, tp_group, vocab_size, z_loss_coeff)
    # a rank holding part of the sequence (context parallel chunks, or DeepSpeed-Ulysses' consecutive shard):
    # its mean weighted by its share of the sequence's loss tokens. The training loop sums the Ulysses ranks'
    # losses; DeepSpeed averages the CP ranks' (its data parallel axis is DP x CP), hence CP x the share
    shard, ranks = (cp.shard, cp.size) if cp is not None else (functools.partial(sequence_shard, sp_group=sp_group), 1)
    full_mask, labels, loss_mask = loss_mask, shard(labels), shard(loss_mask)
    return _mean_token_loss(output, labels, loss_mask, tp_group, vocab_size, z_loss_coeff) * (
        ranks * loss_mask.float().sum().clamp(min=1.0) / full_mask.float().sum().clamp(min=1.0))


def _mean_token_loss(output, labels, loss_mask, tp_group, vocab_size, z_loss_coeff) -> torch.Tensor:
    """The cross entropy (+ z-loss) of ``output`` averaged over the tokens ``loss_mask`` keeps."""
    if isinstance(output, HiddenForLoss):  # liger's fused projection + loss (model/liger.py)
        if z_loss_coeff > 0:  # config.memory.choose_fused_loss never picks liger with --use-z-loss
            raise ValueError("liger's fused loss does not add the z-loss: build the model with fused_loss=False")
        return fused_linear_loss(output, labels, loss_mask)
    if output.dtype in (torch.bfloat16, torch.float16):
        # fp32 math a chunk of tokens at a time: no fp32 copy of the [tokens, vocab/tp] logits
        losses = chunked_vocab_parallel_cross_entropy(output, labels, tp_group, real_vocab_size=vocab_size,
                                                      z_loss_coeff=z_loss_coeff)
    else:
        losses = vocab_parallel_cross_entropy(output.float(), labels, tp_group, vocab_size=vocab_size,
                                              z_loss_coeff=z_loss_coeff)
    return masked_token_loss(losses, loss_mask)


def language_model_loss_fn(tp_group, sp_group=None, loss_report=None, moe_loss_coeff: float = 0.0,
                           z_loss_coeff: float = 0.0, cp=None):
    """``language_model_loss`` bound to a model's groups and report: the ``loss_fn`` a pipeline or
    sequential model of a decoder (the GPT, T5) is given."""
    return functools.update_wrapper(functools.partial(language_model_loss, tp_group=tp_group, sp_group=sp_group,
                                                      report=loss_report, moe_loss_coeff=moe_loss_coeff,
                                                      z_loss_coeff=z_loss_coeff, cp=cp),
                                    language_model_loss)
