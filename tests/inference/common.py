"""Tiny models with known weights for the inference tests."""
from __future__ import annotations

import dataclasses

import torch

from megatron_ds.config.layout import resolve_model_config
from megatron_ds.config.schema import ModelConfig
from megatron_ds.families.gpt.gpt_model import build_sequential_gpt
from megatron_ds.inference.model import ModelWeights

PADDED_VOCAB = 128
VOCAB = 120  # real vocabulary; ids 120..127 are padding and must never be generated
EOD = 3


def gpt2_config(**over) -> ModelConfig:
    # init std 0.2 (not 0.02): logits of a random model are then far apart, so greedy choices are
    # not near-ties that rounding differences between two correct computations could flip.
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=32,
                      max_position_embeddings=48, hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.2)
    return resolve_model_config(dataclasses.replace(cfg, **over))


def llama_config(**over) -> ModelConfig:
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                      ffn_hidden_size=48, seq_length=32, use_rotary_position_embeddings=True, swiglu=True,
                      normalization="rmsnorm", add_bias_linear=False, untie_embeddings_and_output_weights=True,
                      hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.2)
    return resolve_model_config(dataclasses.replace(cfg, **over))


def open_model_config(**over) -> ModelConfig:
    """Llama-style with Qwen's QKV bias and q/k norms, head dim 12 != 32 / 4, and both RoPE scalings: Llama
    3.1's from an original context of 8 (prompts plus new tokens run past it) and linear; a cache whose
    tables ignored a scaling would rotate its new positions otherwise than the full forward does."""
    return llama_config(kv_channels=12, add_qkv_bias=True, qk_layernorm=True, use_rope_scaling=True,
                        rope_scaling_original_max_position_embeddings=8, rotary_seq_len_interpolation_factor=2.0,
                        **over)


def mla_config(**over) -> ModelConfig:
    """Llama-style with DeepSeek's multi-latent attention: a query latent, values narrower than keys (the cache
    keeps both), YaRN x40 with DeepSeek-V2's mscale."""
    return llama_config(multi_latent_attention=True, num_key_value_heads=4, q_lora_rank=12, kv_lora_rank=10,
                        qk_head_dim=8, qk_pos_emb_head_dim=8, v_head_dim=6, rotary_scaling_factor=40.0, mscale=0.707,
                        mscale_all_dim=0.707, **over)


def olmo_config(**over) -> ModelConfig:
    """Llama-style with OLMo 2 / OLMoE's q/k norms over the whole projections (--qk-layernorm-scope projection):
    at TP 2 each rank normalizes its heads by the statistic of all of them, in the cache's new positions too."""
    return llama_config(qk_layernorm=True, qk_layernorm_scope="projection", **over)


CONFIGS = {"gpt2": gpt2_config, "llama": llama_config, "open": open_model_config, "mla": mla_config,
           "olmo": olmo_config}


def random_weights(cfg: ModelConfig, seed: int = 7) -> ModelWeights:
    module = build_sequential_gpt(cfg, padded_vocab_size=PADDED_VOCAB, seed=seed)
    return ModelWeights(model=cfg, padded_vocab_size=PADDED_VOCAB, vocab_size=VOCAB,
                        state_dict={k: v.detach().clone() for k, v in module.state_dict().items()})


def prompts(lengths=(5, 9, 2), seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, VOCAB, (n,), generator=g).tolist() for n in lengths]


def reference_greedy(weights: ModelWeights, prompt: list[int], n: int) -> tuple[list[int], float]:
    """Greedy decoding written independently of the engine: one prompt (no padding, no cache), the
    training-path forward over the whole sequence for every token. Also returns the smallest gap
    between the best and second-best logit seen, to show the choices were not near-ties."""
    module = build_sequential_gpt(weights.model, padded_vocab_size=weights.padded_vocab_size, seed=0).eval()
    module.load_state_dict(weights.state_dict)
    tokens, margin = list(prompt), float("inf")
    with torch.no_grad():
        for _ in range(n):
            ids = torch.tensor([tokens])
            logits = module((ids, torch.arange(len(tokens))[None]))[0, -1, :weights.vocab_size]
            top2 = torch.topk(logits, 2).values
            margin = min(margin, float(top2[0] - top2[1]))
            tokens.append(int(logits.argmax()))
    return tokens[len(prompt):], margin


CORPUS_WORDS = ("the cat sat on a mat while the dog ran to the park and a bird sang in the tree near the old house "
                "by the river where children play every day after school").split()


def sentence(i: int, n: int) -> str:
    """``n`` words of a small fixed vocabulary, different for each ``i``."""
    return " ".join(CORPUS_WORDS[(i * 7 + k * 3) % len(CORPUS_WORDS)] for k in range(n))


def imported_gpt2(root) -> str:
    """A checkpoint directory under ``root`` (a pathlib.Path) holding a tiny GPT-2 (2 layers, hidden 32, 4
    heads, 48 positions) with random weights (init std 0.2, layer norms perturbed so they count),
    built by transformers with a byte-level BPE trained here (320 tokens, files in ``root/src``) and
    imported with tools/checkpoint/from_hf.py: a real checkpoint with a recorded tokenizer, no training."""
    import json
    import shutil

    import transformers

    from megatron_ds.cli import from_hf, train_tokenizer

    with open(root / "corpus.jsonl", "w") as f:
        f.writelines(json.dumps({"text": sentence(i, 12)}) + "\n" for i in range(40))
    assert train_tokenizer.main(["--input", str(root / "corpus.jsonl"), "--type", "bpe", "--vocab-size", "320",
                                 "--min-frequency", "1", "--output-dir", str(root / "tok")]) == 0
    vocab = json.load(open(root / "tok" / "vocab.json"))
    eod = vocab["<|endoftext|>"]
    config = transformers.GPT2Config(vocab_size=len(vocab), n_positions=48, n_embd=32, n_layer=2, n_head=4,
                                     activation_function="gelu", initializer_range=0.2, bos_token_id=eod,
                                     eos_token_id=eod)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln_" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(root / "src")
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(root / "tok" / name, root / "src" / name)
    assert from_hf.main(["--hf-dir", str(root / "src"), "--save", str(root / "ckpt")]) == 0
    return str(root / "ckpt")
