"""T5's and BERT's activation memory estimates (families/t5/t5_params.py ``t5_stage_activations``,
families/bert/bert_params.py ``bert_stage_activations``, through config/memory.py) against what their real layers
keep for backward, as tests/config/test_memory.py checks the GPT's layer. BERT's transformer layer is the
GPT's (measured there); its MLM head is measured here.

A T5 encoder layer and decoder layer (families/t5/t5_model.py) in bf16 run a forward on the CPU under saved-tensor
hooks; every tensor autograd saves is counted once per storage, parameters left out. Attention dropout 0
lets the CPU run its flash kernel with the masks, as a GPU runs the memory-efficient one (both keep q, k,
v, the output, a logsumexp and the mask, never the scores); hidden dropout stays on (Megatron's 0.1), its
masks bf16 as the fused bias-dropout-add's on a GPU. Relative position biases are left out here: with a
float mask that needs a gradient the CPU falls back to the math kernel (fp32 scores), which no GPU runs.
"""
import dataclasses

import pytest
import torch

from megatron_ds.config import memory, parse_args, resolve
from megatron_ds.config.memory import activation_bytes_per_layer, estimate_stages, logits_bytes
from megatron_ds.families.gpt.gpt_family import GPT
from megatron_ds.families.t5.t5_family import T5
from megatron_ds.families.t5.t5_params import decoder_layer_activation_bytes
from tests.config.test_memory import saved_bytes

S_ENC, S_DEC, B, H, A = 256, 64, 2, 256, 8


def _layout(extra=(), world=1):
    flags = (f"--num-layers 2 --decoder-num-layers 2 --hidden-size {H} --num-attention-heads {A} "
             f"--seq-length {S_ENC} --decoder-seq-length {S_DEC} --max-position-embeddings {S_ENC} "
             f"--micro-batch-size {B} --train-iters 10 --lr 1e-4 --mock-data --vocab-size 1000 --bf16 "
             f"--attention-dropout 0").split() + list(extra)
    cfg, _ = parse_args(flags)
    return resolve(cfg, world_size=world, vocab_size=1000, device_type="cuda", family=T5).layout


def _flags():
    """Encoder and decoder padding flags ([b, s] int64, families/t5/t5_model.py), some padding in each."""
    enc, dec = torch.ones(B, S_ENC, dtype=torch.long), torch.ones(B, S_DEC, dtype=torch.long)
    enc[0, -40:] = 0
    dec[1, -10:] = 0
    return enc, dec


# Left out by the estimate, as for the GPT's layer: the norms' mean/rstd, and here the [b, 1, 1, s_e]
# padding masks of the self- and cross-attention (each under 0.2% at these sizes); the GPT test's bound.
REL = 0.015


def test_encoder_layer_keeps_what_the_estimate_counts():
    from megatron_ds.families.t5.t5_model import T5EncoderLayer
    from megatron_ds.parallel.random import set_parallel_seeds

    layout = _layout()
    set_parallel_seeds(1, 0)
    layer = T5EncoderLayer(layout.model, 1, params_dtype=torch.bfloat16, device="cpu")
    enc_flags, dec_flags = _flags()
    x = torch.randn(S_ENC, B, H, dtype=torch.bfloat16, requires_grad=True)
    measured = saved_bytes(layer, (x, None, enc_flags, dec_flags))
    estimated = activation_bytes_per_layer(layout, recompute=None)  # the GPT layer's, at the encoder length
    assert measured == pytest.approx(estimated, rel=REL), (measured / (S_ENC * B * H), estimated / (S_ENC * B * H))


@pytest.mark.parametrize("extra", [[], ["--geglu", "--normalization", "layernorm", "--disable-bias-linear"]],
                         ids=["gelu", "geglu"])
def test_decoder_layer_keeps_what_the_estimate_counts(extra):
    """Causal self-attention and MLP at the decoder length, cross-attention's query side at the decoder
    length and its keys and values at the encoder length; the encoder output (the key/value projection's
    input) is left out of the layer: the stage holds it once for all its decoder layers."""
    from megatron_ds.families.t5.t5_model import T5DecoderLayer
    from megatron_ds.parallel.random import set_parallel_seeds

    layout = _layout(extra)
    set_parallel_seeds(1, 0)
    layer = T5DecoderLayer(layout.model, 1, params_dtype=torch.bfloat16, device="cpu")
    enc_flags, dec_flags = _flags()
    y = torch.randn(S_DEC, B, H, dtype=torch.bfloat16, requires_grad=True)
    encoder_output = torch.randn(S_ENC, B, H, dtype=torch.bfloat16, requires_grad=True)
    measured = saved_bytes(layer, (y, encoder_output, enc_flags, dec_flags), held_elsewhere=[encoder_output])
    estimated = decoder_layer_activation_bytes(layout, recompute=None)
    assert measured == pytest.approx(estimated, rel=REL), (measured / (S_DEC * B * H), estimated / (S_DEC * B * H))
    # the estimate before the decoder was counted: a GPT layer at the encoder length; it is not this
    assert abs(activation_bytes_per_layer(layout, recompute=None) - measured) > 0.2 * measured


def test_pipeline_stages_hold_their_own_lengths_and_the_encoder_output():
    """PP 2 split at 1 (stage 0 the encoder, stage 1 the decoder): each stage's activations are its layers
    at its stack's length times the micro-batches in flight (DeepSpeed's 1F1B: 2 on both), plus the
    stage's hidden state and, on the decoder stage, the encoder output; only the decoder stage has
    logits, at the decoder length."""
    layout = _layout(["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-split-rank", "1",
                      "--global-batch-size", "8"], world=2)
    enc_stage, dec_stage = (dict(e.terms) for e in estimate_stages(layout))
    sbh_enc, sbh_dec = S_ENC * B * H * 2, S_DEC * B * H * 2
    encoder_layer = activation_bytes_per_layer(layout, recompute=None)
    decoder_layer = decoder_layer_activation_bytes(layout, recompute=None)
    assert enc_stage["activations"] == pytest.approx(2 * (2 * encoder_layer + sbh_enc), rel=1e-12)
    assert dec_stage["activations"] == pytest.approx(2 * (2 * decoder_layer + sbh_dec + sbh_enc), rel=1e-12)
    assert enc_stage["logits"] == 0
    # bf16 logits and their gradient over the decoder's tokens, and the chunked cross entropy's fp32 chunks
    # (config/memory.py logits_bytes, at most 3 fp32 copies of the logits)
    elements = S_DEC * B * layout.padded_vocab_size
    assert dec_stage["logits"] == logits_bytes(layout) == elements * 4 + min(memory.CHUNK_BYTES, elements * 12)


def test_full_recompute_keeps_each_layers_input_at_its_length():
    """--checkpoint-activations on one stage: one chunk input per layer (encoder ones at the encoder length,
    decoder ones at the decoder length), the largest layer's working set (a decoder layer's here), and the
    stage's buffers (both stacks' hidden states and the encoder output)."""
    layout = _layout(["--checkpoint-activations"])
    est = dict(estimate_stages(layout)[0].terms)
    sbh_enc, sbh_dec = S_ENC * B * H * 2, S_DEC * B * H * 2
    working = max(decoder_layer_activation_bytes(layout, recompute=None),
                  activation_bytes_per_layer(layout, recompute=None))
    assert est["activations"] == pytest.approx(2 * sbh_enc + 2 * sbh_dec + working + sbh_enc + sbh_dec + sbh_enc,
                                               rel=1e-12)


def test_bert_mlm_head_keeps_what_the_estimate_counts():
    """BERT's heads (families/bert/bert_model.py BertHeads, binary head on) and the tied projection after the
    final norm: the MLM transform's dense output, GeLU output and LayerNorm output (the projection's input); their input
    (the final norm's output) is left out, as for the GPT's output layer. The pooler's [b, h] tensors and the LayerNorm's mean/rstd are what differs."""
    from megatron_ds.families.bert.bert_family import BERT
    from megatron_ds.families.bert.bert_model import BertHeads
    from megatron_ds.families.bert.bert_params import mlm_head_activation_bytes
    from megatron_ds.parallel.random import set_parallel_seeds

    cfg, _ = parse_args(f"--num-layers 2 --hidden-size {H} --num-attention-heads {A} --seq-length {S_ENC} "
                        f"--max-position-embeddings {S_ENC} --micro-batch-size {B} --train-iters 10 --lr 1e-4 "
                        f"--mock-data --vocab-size 1000 --bf16".split())
    layout = resolve(cfg, world_size=1, vocab_size=1000, device_type="cuda", family=BERT).layout
    set_parallel_seeds(1, 0)
    m = layout.model
    heads = BertHeads(H, init_method_std=m.init_method_std, layernorm_epsilon=m.layernorm_epsilon, binary_head=True,
                      params_dtype=torch.bfloat16, device="cpu")
    # the tied projection by the word embedding after the heads keeps the LayerNorm's output as its input
    head_and_projection = torch.nn.Module()
    head_and_projection.heads = heads
    head_and_projection.embedding = torch.nn.Parameter(torch.randn(1000, H, dtype=torch.bfloat16))
    head_and_projection.forward = lambda x: heads(x)[0] @ head_and_projection.embedding.t()
    x = torch.randn(S_ENC, B, H, dtype=torch.bfloat16, requires_grad=True)
    measured = saved_bytes(head_and_projection, x, held_elsewhere=[x])
    assert measured == pytest.approx(mlm_head_activation_bytes(layout), rel=REL)
    # on the last stage only, beside the GPT's count of the same layers
    pp2 = resolve(dataclasses.replace(cfg, parallel=dataclasses.replace(
        cfg.parallel, pipeline_model_parallel_size=2)), world_size=2, vocab_size=1000, device_type="cuda",
        family=BERT).layout
    gpt_like = dataclasses.replace(pp2, family=GPT)
    acts = [dict(e.terms)["activations"] for e in estimate_stages(pp2)]
    gpt_acts = [dict(e.terms)["activations"] for e in estimate_stages(gpt_like)]
    in_flight_last = 2  # DeepSpeed's 1F1B keeps at least 2 buffers (config/memory.py in_flight_micro_batches)
    assert acts == [gpt_acts[0], gpt_acts[1] + in_flight_last * mlm_head_activation_bytes(pp2)]


def test_t5_suggestions_name_a_split_rank_that_runs():
    """--dry-run's "would fit" list for a T5 (12 + 12 layers of T5-base on 8 GPUs at PP 1): a pipeline size it
    proposes comes with the split rank pretrain_t5.py needs, and every suggestion, applied to the flags, passes
    pretrain_t5.py's checks and is estimated as the suggestion says."""
    base = ("--num-layers 12 --decoder-num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 512 "
            "--decoder-seq-length 128 --max-position-embeddings 512 --micro-batch-size 32 --global-batch-size 256 "
            "--train-iters 10 --lr 1e-4 --mock-data --vocab-size 32128 --bf16").split()

    def layout(extra):
        cfg, _ = parse_args(base + list(extra))
        return resolve(cfg, world_size=8, vocab_size=32128, device_type="cuda", family=T5).layout

    start = layout([])
    budget = 2 * memory.estimate_memory(start).total  # every single change is listed
    fixes = memory.suggestions(start, budget, limit=20)
    pipeline = [f for f in fixes if "--pipeline-model-parallel-size" in f]
    assert pipeline and all("--pipeline-model-parallel-split-rank" in f for f in pipeline), fixes
    for fix in fixes:
        flags, said = fix.split(" (~")
        applied = layout(flags.split())
        assert f"{memory.estimate_memory(applied).total / memory.GB:.1f} GB)" == said, fix
