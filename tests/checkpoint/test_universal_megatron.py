"""Universal checkpoints that Megatron-DeepSpeed users already have, loaded with ``--universal-checkpoint``.

The checkpoint is built here from an independent source, a transformers model (GPT2LMHeadModel or
LlamaForCausalLM with a tiny config and large random weights, so that a wrong row order changes
the loss far beyond the tolerance), laid out as Megatron-DeepSpeed's ``GPTModelPipe`` names and
orders its parameters and as DeepSpeed's ``ds_to_universal`` writes them; each rule is transcribed
from their sources (cited at the functions). Our CLI loads it at another TP size and trains one
step; the loss it reports for that step (computed with the loaded weights) must be the loss
transformers computes for the same global batch.

Tolerance: both fp32 on the same weights; the TP split and the attention kernels sum in other
orders (~1e-7 relative per op), a loss of ~5-10: abs 1e-4.
"""
import argparse
import collections
import os
import random

import numpy as np
import pytest
import torch

from tests.distributed import run_distributed
from tests.training.common import train_losses

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, GBS, ITERATION = 97, 32, 4, 5  # an odd vocabulary: padded differently at every TP size


def _qkv(q, k, v, groups: int, *, fpdt: bool, saved_tp: int):
    """Megatron-DeepSpeed's fused QKV rows from separate q, k, v (rows = heads x head_dim).

    megatron/model/transformer.py ParallelAttention.forward before commit 676a482c (2024-12-04):
    ``mixed_x_layer.view(..., -1, num_key_value_groups + 2, head_dim)`` then ``split_tensor``:
    per key/value head, its query heads, then its key, then its value. From 676a482c on (the FPDT
    change): each tensor parallel rank's rows are ``[Q; K; V]`` of its own heads
    (``each_hidden_size = mixed_x_layer.shape[-1] // 3``); ds_to_universal concatenates the ranks.
    """
    if fpdt:
        return torch.cat([torch.cat([q.chunk(saved_tp)[r], k.chunk(saved_tp)[r], v.chunk(saved_tp)[r]])
                          for r in range(saved_tp)])
    rest = q.shape[1:]
    return torch.cat([q.reshape(groups, -1, *rest), k.reshape(groups, -1, *rest), v.reshape(groups, -1, *rest)],
                     dim=1).reshape(-1, *rest)


def _gpt2_params(hf, *, fpdt: bool, saved_tp: int) -> dict:
    """GPTModelPipe's parameters (megatron/model/gpt_model.py): layer 0 is ``_to_float16`` (no
    parameters), the tied embedding ``tied_modules.embed`` (language_model.py Embedding:
    ``word_embeddings``, ``position_embeddings``), blocks from index 2 (transformer.py
    ParallelTransformerLayer), the final LayerNorm as layer L+2. transformers' Conv1D stores
    [in, out]: transposed to torch Linear's [out, in]."""
    t, cfg = hf.transformer, hf.config
    out = {"tied_modules.embed.word_embeddings.weight": t.wte.weight,
           "tied_modules.embed.position_embeddings.weight": t.wpe.weight}
    for i, blk in enumerate(t.h):
        p, h = f"{i + 2}.", cfg.n_embd
        w, b = blk.attn.c_attn.weight.T, blk.attn.c_attn.bias
        out.update({
            p + "input_layernorm.weight": blk.ln_1.weight, p + "input_layernorm.bias": blk.ln_1.bias,
            p + "self_attention.query_key_value.weight": _qkv(w[:h], w[h:2 * h], w[2 * h:], cfg.n_head, fpdt=fpdt,
                                                              saved_tp=saved_tp),
            p + "self_attention.query_key_value.bias": _qkv(b[:h], b[h:2 * h], b[2 * h:], cfg.n_head, fpdt=fpdt,
                                                            saved_tp=saved_tp),
            p + "self_attention.dense.weight": blk.attn.c_proj.weight.T, p + "self_attention.dense.bias":
                blk.attn.c_proj.bias,
            p + "post_attention_layernorm.weight": blk.ln_2.weight, p + "post_attention_layernorm.bias": blk.ln_2.bias,
            p + "mlp.dense_h_to_4h.weight": blk.mlp.c_fc.weight.T, p + "mlp.dense_h_to_4h.bias": blk.mlp.c_fc.bias,
            p + "mlp.dense_4h_to_h.weight": blk.mlp.c_proj.weight.T, p + "mlp.dense_4h_to_h.bias": blk.mlp.c_proj.bias,
        })
    n = len(t.h)
    out.update({f"{n + 2}.weight": t.ln_f.weight, f"{n + 2}.bias": t.ln_f.bias})
    return out


def _llama_params(hf, *, saved_tp: int) -> dict:
    """GPTModelPipe untied (gpt_model.py: ``LayerSpec(EmbeddingPipe, ...)`` as layer 1, RMSNorm
    as L+2, ``LMHeadPipe`` (``lm_head``) as L+3), GQA rows per key/value group, SwiGLU's
    ``dense_h_to_4h`` as ParallelMLP builds it (transformer.py: ``swiglu`` chunks each rank's
    output in [gate; up]) and as ds_to_universal concatenates it *without* the
    PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0 pattern (checkpoints written before gpt_model.py had
    ``_get_swiglu_col_parallel_param_patterns``): [gate_0; up_0; gate_1; up_1]."""
    m, cfg = hf.model, hf.config
    out = {"1.word_embeddings.weight": m.embed_tokens.weight}
    for i, blk in enumerate(m.layers):
        p, a, f = f"{i + 2}.", blk.self_attn, blk.mlp
        gate, up = f.gate_proj.weight.chunk(saved_tp), f.up_proj.weight.chunk(saved_tp)
        out.update({
            p + "input_layernorm.weight": blk.input_layernorm.weight,
            p + "self_attention.query_key_value.weight": _qkv(a.q_proj.weight, a.k_proj.weight, a.v_proj.weight,
                                                              cfg.num_key_value_heads, fpdt=False, saved_tp=saved_tp),
            p + "self_attention.dense.weight": a.o_proj.weight,
            p + "post_attention_layernorm.weight": blk.post_attention_layernorm.weight,
            p + "mlp.dense_h_to_4h.weight": torch.cat([torch.cat([gate[r], up[r]]) for r in range(saved_tp)]),
            p + "mlp.dense_4h_to_h.weight": f.down_proj.weight,
        })
    n = len(m.layers)
    out.update({f"{n + 2}.weight": m.norm.weight, f"{n + 3}.lm_head.weight": hf.lm_head.weight})
    return out


def _write_universal(params: dict, args: argparse.Namespace, ckpt_dir: str, *, padded_vocab: int | None) -> None:
    """What ``ds_to_universal`` leaves (deepspeed/checkpoint/ds_to_universal.py ``merge_tp_slices``:
    ``zero/<name>/{fp32,exp_avg,exp_avg_sq}.pt`` as ``{"param": full tensor, "cat_dim": d}``, vocabulary
    tensors cut to ``original_vocab_size`` and marked ``vocab_tensor``, ``step.pt``; ``main`` copies
    the mp_rank files and writes ``latest_universal``) for a Megatron-DeepSpeed run whose client
    state is megatron/checkpointing.py ``save_checkpoint``'s (args, iteration, tokens,
    universal_checkpoint_info) and whose LR scheduler counts samples (megatron/training.py).
    ``padded_vocab``: keep the padded rows instead (a converter run without vocabulary patterns)."""
    tag = f"global_step{ITERATION}_universal"
    gen = torch.Generator().manual_seed(7)
    for name, tensor in params.items():
        tensor = tensor.detach().float()
        entry = {"cat_dim": 1 if name.endswith(("dense.weight", "dense_4h_to_h.weight")) else 0}
        if "word_embeddings" in name or "lm_head" in name:
            if padded_vocab:  # padding rows hold junk: they must never be read
                tensor = torch.cat([tensor, torch.randn(padded_vocab - VOCAB, tensor.shape[1], generator=gen)])
            else:
                entry["vocab_tensor"] = True
        folder = os.path.join(ckpt_dir, tag, "zero", name)
        os.makedirs(folder)
        moments = {"fp32": tensor, "exp_avg": 1e-3 * torch.randn(tensor.shape, generator=gen),
                   "exp_avg_sq": 1e-6 * torch.rand(tensor.shape, generator=gen)}
        for state, value in moments.items():
            torch.save({**entry, "param": value}, os.path.join(folder, f"{state}.pt"))
        torch.save(torch.tensor(float(ITERATION)), os.path.join(folder, "step.pt"))
    gbs = args.global_batch_size
    state = {"module": None, "optimizer": None, "global_steps": ITERATION, "global_samples": ITERATION * gbs,
             "skipped_steps": 0, "dp_world_size": 1, "mp_world_size": args.tensor_model_parallel_size,
             "lr_scheduler": {"max_lr": 1e-3, "lr_warmup_steps": 2 * gbs, "num_steps": ITERATION * gbs,
                              "lr_decay_style": "cosine", "lr_decay_steps": 6 * gbs, "min_lr": 0.0, "start_wd": 0.01,
                              "end_wd": 0.01, "wd_incr_style": "constant", "wd_incr_steps": 6 * gbs},
             "param_shapes": [collections.OrderedDict((n, t.shape) for n, t in params.items())],
             "ds_config": {"train_batch_size": gbs, "bf16": {"enabled": False}}, "ds_version": "0.14.0",
             # megatron/checkpointing.py get_rng_state(): numpy's state holds an ndarray
             "rng_state": [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                            "torch_rng_state": torch.get_rng_state(), "rng_tracker_states": {}}],
             "args": args, "checkpoint_version": 3.0, "iteration": ITERATION, "tokens": ITERATION * gbs * SEQ,
             "universal_checkpoint_info": {"universal_checkpoint_version": 0.2, "original_vocab_size": VOCAB,
                                           "padded_vocab_size": args.padded_vocab_size}}
    for mp in range(args.tensor_model_parallel_size * args.pipeline_model_parallel_size):
        torch.save(state, os.path.join(ckpt_dir, tag, f"mp_rank_{mp:02d}_model_states.pt"))
    with open(os.path.join(ckpt_dir, "latest_universal"), "w") as f:
        f.write(tag)


def _args(saved_tp: int, **model) -> argparse.Namespace:
    """megatron/arguments.py's names, as validate_args() leaves them."""
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, max_position_embeddings=SEQ, seq_length=SEQ,
                tensor_model_parallel_size=saved_tp, pipeline_model_parallel_size=2, global_batch_size=GBS,
                consumed_train_samples=ITERATION * GBS, consumed_valid_samples=0, num_experts=[1],
                make_vocab_size_divisible_by=128, padded_vocab_size=128 * saved_tp, rampup_batch_size=None,
                params_dtype=torch.float32, normalization="layernorm", add_position_embedding=True, use_rotary_position_embeddings=False,
                add_bias_linear=True, swiglu=False, untie_embeddings_and_output_weights=False, apply_layernorm_1p=False)
    return argparse.Namespace(**{**base, **model})


def _hf_loss(hf) -> float:
    """transformers' loss on the global batch our run trains on at step ITERATION + 1: mock samples
    ITERATION * GBS ... (megatron_ds.training.data.MockGPTDataset, seed 1234 = --seed)."""
    from megatron_ds.training.data import MockGPTDataset

    data = MockGPTDataset(100, SEQ, VOCAB, 1234)
    text = torch.stack([torch.as_tensor(data[i]["text"]) for i in range(ITERATION * GBS, (ITERATION + 1) * GBS)])
    with torch.no_grad():
        logits = hf(input_ids=text[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), text[:, 1:].reshape(-1)).item()


def _randomize(hf):
    torch.manual_seed(0)
    with torch.no_grad():
        for p in hf.parameters():  # norms ~1 +- 0.2, biases ~0.2, weights std 0.2 (initializer_range)
            p.add_(0.2 * torch.randn_like(p))
    return hf.eval()


CASES = {
    # GPT-2 (tied, learned positions, LayerNorm, biases), per-head QKV, vocabulary cut to the tokenizer's
    "gpt2": dict(tp=2, fpdt=False, padded=None),
    # the same from Megatron-DeepSpeed after 676a482c (rank-major QKV, saved at TP 2), padded rows kept
    "gpt2-fpdt": dict(tp=1, fpdt=True, padded=256),
    # Llama (untied, RoPE, RMSNorm, SwiGLU, GQA, no biases) saved at TP 2 without the SwiGLU pattern
    "llama": dict(tp=2, fpdt=False, padded=None),
}
GPT2_FLAGS = "--num-layers 2 --hidden-size 64 --num-attention-heads 4"
LLAMA_FLAGS = (GPT2_FLAGS + " --num-key-value-heads 2 --ffn-hidden-size 128 --use-rotary-position-embeddings "
               "--swiglu --normalization rmsnorm --disable-bias-linear --untie-embeddings-and-output-weights")


@pytest.mark.parametrize("case", list(CASES))
def test_megatron_deepspeed_universal_checkpoint_gives_transformers_loss(tmp_path, case):
    c = CASES[case]
    ckpt = str(tmp_path / "ckpt")
    if case.startswith("gpt2"):
        hf = _randomize(transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=4, activation_function="gelu",
            resid_pdrop=0, embd_pdrop=0, attn_pdrop=0, layer_norm_epsilon=1e-5, initializer_range=0.2)))
        args = _args(2, ffn_hidden_size=256, kv_channels=16, num_key_value_heads=4)
        if c["fpdt"]:
            args.ds_sequence_parallel_fpdt = False  # an argument that commit added
        params, flags = _gpt2_params(hf, fpdt=c["fpdt"], saved_tp=2), GPT2_FLAGS
    else:
        hf = _randomize(transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=SEQ, rms_norm_eps=1e-5, tie_word_embeddings=False,
            initializer_range=0.2)))
        args = _args(2, ffn_hidden_size=128, kv_channels=16, num_key_value_heads=2, normalization="rmsnorm",
                     add_position_embedding=False, use_rotary_position_embeddings=True, add_bias_linear=False,
                     swiglu=True, untie_embeddings_and_output_weights=True)
        params, flags = _llama_params(hf, saved_tp=2), LLAMA_FLAGS
    _write_universal(params, args, ckpt, padded_vocab=c["padded"])
    argv = (f"{flags} --seq-length {SEQ} --max-position-embeddings {SEQ} --micro-batch-size 2 "
            f"--global-batch-size {GBS} --lr 1e-3 --lr-decay-style cosine --lr-warmup-iters 2 --train-iters 6 "
            f"--mock-data --vocab-size {VOCAB} --make-vocab-size-divisible-by 4 --hidden-dropout 0 "
            f"--attention-dropout 0 --log-interval 1 --eval-interval 1000 --eval-iters 1 --num-workers 0 "
            f"--seed 1234 --tensor-model-parallel-size {c['tp']} --load {ckpt} --universal-checkpoint").split()
    [(iteration, loss)] = run_distributed(train_losses, c["tp"], argv, timeout=600)[-1]
    assert iteration == ITERATION + 1
    assert loss == pytest.approx(_hf_loss(hf), abs=1e-4)


def test_parameter_names_of_every_scheme_map_and_the_rest_is_refused():
    """GPTModelPipe (tied), GPTModel (--no-pipeline-parallel, language_model.py / transformer.py
    names) and ours give the same canonical keys; MoE experts are refused naming the parameter."""
    from megatron_ds.checkpoint import megatron_names
    from megatron_ds.errors import ConfigError

    pipe = ["tied_modules.embed.word_embeddings.weight", "2.self_attention.query_key_value.weight",
            "3.mlp.dense_4h_to_h.bias", "4.weight", "5.lm_head.weight"]
    plain = ["language_model.embedding.word_embeddings.weight",
             "language_model.encoder.layers.0.self_attention.query_key_value.weight",
             "language_model.encoder.layers.1.mlp.dense_4h_to_h.bias", "language_model.encoder.final_layernorm.weight",
             "language_model.output_layer.weight"]
    ours = ["0.word_embeddings.weight", "1.self_attention.query_key_value.weight", "2.mlp.dense_4h_to_h.bias",
            "3.final_layernorm.weight", "4.output_layer.weight"]
    keys = [("word_embeddings",), ("block", 0, "self_attention.query_key_value.weight"),
            ("block", 1, "mlp.dense_4h_to_h.bias"), ("final_layernorm", "weight"), ("output_layer",)]
    for names in (pipe, plain, ours):
        assert megatron_names.index(names) == dict(zip(keys, names))
    assert [megatron_names.canonical(n, ours=True) for n in ours] == keys
    with pytest.raises(ConfigError, match=r"2\.mlp\.deepspeed_moe\.experts.* mixture-of-experts"):
        megatron_names.index(pipe + ["2.mlp.deepspeed_moe.experts.deepspeed_experts.0.dense_h_to_4h.weight"])
