"""Today's open models both ways: Llama 3.1 (rope_scaling "llama3"), Llama 3.2 (tied, factor 32), Qwen2
(q/k/v biases, rope_theta 1e6, tied), Qwen3 (per-head q/k RMSNorm, head_dim 32 != hidden 64 / 4 heads)
and Mistral (sliding_window covering the sequence, explicit head_dim), and a Llama with "linear" RoPE
scaling. Each is a tiny random
transformers model built here from its config class.

- import (tools/checkpoint/from_hf.py): our model's logits equal transformers' at every position, and
  the printed flags, parsed as pretrain_gpt.py parses them, give the imported model config;
- export (tools/checkpoint/to_hf.py) of the imported checkpoint: transformers loads the directory
  with the same class, the same config fields and the same tensors (bitwise: fp32 reshuffling);
- trained 5 steps at TP 2 x PP 2 from the imported checkpoint with the printed flags, the losses
  equal the single-process run's (rtol 2e-5 as tests/families/gpt/test_parity.py: the layouts sum
  the same fp32 numbers in different orders; a few seconds per model); the trained TP x PP
  checkpoint, which no longer records the class it was imported from, exports as the class its
  features choose (Mistral by its window) with our logits on the trained weights;
- greedy generation (megatron_ds.inference, with its KV cache) equals transformers' generate token
  for token;
- what a target cannot express is refused in one line naming the field or flag.

Logits: both fp32 on the same weights; different attention kernels and summation orders give ~1e-7
relative differences on logits of size ~1: atol 1e-5 (tests/families/gpt/test_hf.py's).
"""
import json
import os

import pytest
import torch

from tests.training.common import layout_losses, train_losses

transformers = pytest.importorskip("transformers")
from megatron_ds.cli import from_hf, to_hf  # noqa: E402
from megatron_ds.families.gpt import gpt_hf as hf  # noqa: E402
from megatron_ds.families.gpt.gpt_family import GPT  # noqa: E402

LOGIT_TOL = dict(rtol=1e-5, atol=1e-5)
VOCAB, SEQ = 256, 32
_SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=SEQ, rms_norm_eps=1e-6, initializer_range=0.2)
# original_max_position_embeddings 64 at head size 16 and theta 5e5: wavelengths 6.3 (kept: < 64 / 4),
# 32.5 (interpolated) and >= 167 (divided by the factor), every branch of _compute_llama3_parameters
_LLAMA3 = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
               original_max_position_embeddings=64)
MODELS = {
    "llama3.1": lambda: transformers.LlamaConfig(**_SMALL, rope_parameters=_LLAMA3, tie_word_embeddings=False),
    "llama3.2": lambda: transformers.LlamaConfig(**_SMALL, rope_parameters={**_LLAMA3, "factor": 32.0},
                                                 tie_word_embeddings=True),
    "llama-linear": lambda: transformers.LlamaConfig(**_SMALL, rope_parameters={"rope_type": "linear",
                                                                                "rope_theta": 1e4, "factor": 4.0}),
    "qwen2": lambda: transformers.Qwen2Config(**_SMALL, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                                              tie_word_embeddings=True, use_sliding_window=False,
                                              sliding_window=4096, max_window_layers=2),
    "qwen3": lambda: transformers.Qwen3Config(**_SMALL, head_dim=32, attention_bias=False, tie_word_embeddings=False,
                                              rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "mistral": lambda: transformers.MistralConfig(**_SMALL, head_dim=16, sliding_window=SEQ,
                                                  rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                                                  tie_word_embeddings=False),
}
CLASSES = {"llama3.1": "LlamaForCausalLM", "llama3.2": "LlamaForCausalLM",
           "llama-linear": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
           "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM"}
# the flags each import must print for its features (Megatron-LM's spelling)
FLAGS = {"llama3.1": ["--use-rope-scaling", "--rope-scaling-factor 8", "--rotary-base 500000",
                      "--rope-scaling-original-max-position-embeddings 64", "--untie-embeddings-and-output-weights"],
         "llama3.2": ["--use-rope-scaling", "--rope-scaling-factor 32"],
         "llama-linear": ["--rotary-seq-len-interpolation-factor 4"],
         "qwen2": ["--add-qkv-bias", "--disable-bias-linear", "--rotary-base 1e+06"],
         "qwen3": ["--qk-layernorm", "--kv-channels 32", "--num-key-value-heads 2"],
         "mistral": [f"--window-size {SEQ - 1},0", f"--seq-length {SEQ}"]}
# config.json fields an export must give back as they were
FIELDS = ("rope_parameters", "head_dim", "tie_word_embeddings", "attention_bias", "mlp_bias", "sliding_window",
          "use_sliding_window", "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "intermediate_size")


def _hf_model(name):
    """The model with random weights everywhere: transformers initializes biases to 0 and norm weights
    to 1, which would let a swapped q/k bias or q_norm/k_norm pass unseen."""
    torch.manual_seed(0)
    model = getattr(transformers, CLASSES[name])(MODELS[name]()).eval()
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if param.dim() == 1:
                param.copy_((1.0 if pname.endswith("norm.weight") else 0.0) + 0.3 * torch.randn_like(param))
    return model


def hf_import_cache(tmp_path_factory, build):
    """name -> (HF directory, imported checkpoint, printed text) of the transformers model ``build(name)``;
    built, saved and imported once per model."""
    cache = {}

    def get(name):
        if name not in cache:
            root = tmp_path_factory.mktemp(name)
            hf_dir, ckpt = str(root / "hf"), str(root / "ckpt")
            build(name).save_pretrained(hf_dir)
            lines = []
            from megatron_ds.families.gpt.gpt_hf_import import import_hf
            import_hf(hf_dir, ckpt, family=GPT, log=lines.append)
            cache[name] = hf_dir, ckpt, "\n".join(lines)
        return cache[name]
    return get


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    return hf_import_cache(tmp_path_factory, _hf_model)


def _tokens(n=2, length=SEQ, seed=0):
    return torch.randint(0, VOCAB, (n, length), generator=torch.Generator().manual_seed(seed))


def _ours(ckpt):
    from megatron_ds.checkpoint import load_consolidated
    from megatron_ds.families.gpt.gpt_model import build_sequential_gpt

    c = load_consolidated(ckpt, log=lambda *a: None, family=GPT)
    model = build_sequential_gpt(c.model, padded_vocab_size=c.padded_vocab_size, vocab_size=c.vocab_size, seed=0)
    model.load_state_dict(c.state_dict)
    return c, model.eval()


def _printed_flags(text):
    return text.split("train it with\n  ")[1].split("\n")[0]


@pytest.mark.parametrize("name", list(MODELS))
def test_import_gives_transformers_logits_and_flags(imported, name):
    from megatron_ds.config import parse_args
    from megatron_ds.config.layout import resolve_model_config

    hf_dir, ckpt, text = imported(name)
    c, ours = _ours(ckpt)
    tokens = _tokens()
    with torch.no_grad():
        want = _hf_model(name)(input_ids=tokens).logits
        got = ours((tokens, torch.arange(SEQ).expand_as(tokens)))
    torch.testing.assert_close(got, want, **LOGIT_TOL)
    flags = _printed_flags(text)
    for flag in FLAGS[name]:
        assert f"{flag} " in flags + " ", (flag, flags)
    cfg, _ = parse_args(flags.split() + ["--mock-data", "--micro-batch-size", "1", "--train-iters", "1"])
    printed = resolve_model_config(cfg.model)
    for field in ("kv_channels", "num_key_value_heads", "add_qkv_bias", "add_bias_linear", "qk_layernorm",
                  "use_rope_scaling", "rope_scaling_factor", "rope_scaling_low_freq_factor",
                  "rope_scaling_high_freq_factor", "rope_scaling_original_max_position_embeddings", "rope_theta",
                  "rotary_seq_len_interpolation_factor", "window_size", "untie_embeddings_and_output_weights",
                  "seq_length", "layernorm_epsilon"):
        want_value, got_value = getattr(c.model, field), getattr(printed, field)
        if field == "window_size" and want_value is not None:
            want_value, got_value = hf.sliding_window(c.model), hf.sliding_window(printed)
        assert got_value == want_value, field


@pytest.mark.parametrize("name", list(MODELS))
def test_export_loads_as_the_same_class_with_the_same_config_and_tensors(imported, name, tmp_path):
    hf_dir, ckpt, _ = imported(name)
    out = str(tmp_path / "out")
    assert to_hf.main(["--load", ckpt, "--out", out]) == 0
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert type(theirs).__name__ == CLASSES[name]
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    original = _hf_model(name)
    for field in FIELDS:
        assert getattr(theirs.config, field, None) == getattr(original.config, field, None), field
    got, want = theirs.state_dict(), original.state_dict()
    assert sorted(got) == sorted(want)
    for key in want:
        assert torch.equal(got[key], want[key]), key
    with torch.no_grad():  # the same tensors and config: the same logits
        torch.testing.assert_close(theirs.eval()(input_ids=_tokens()).logits,
                                   original(input_ids=_tokens()).logits, **LOGIT_TOL)


TRAIN = ("--micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --train-iters 5 --mock-data "
         f"--vocab-size {VOCAB} --make-vocab-size-divisible-by 4 --hidden-dropout 0 --attention-dropout 0 "
         "--log-interval 1 --eval-interval 1000 --eval-iters 1 --num-workers 0 --seed 1234").split()


@pytest.mark.parametrize("name", ["llama3.1", "llama3.2", "qwen2", "qwen3", "mistral"])
def test_imported_model_trains_alike_at_tp2_pp2(imported, name, tmp_path):
    _, ckpt, text = imported(name)
    base = _printed_flags(text).split() + TRAIN + ["--load", ckpt]
    single = layout_losses(train_losses, base, 1, 1, 1, timeout=600)
    save = str(tmp_path / "trained")
    assert layout_losses(train_losses, base, 2, 2, 1, ["--save", save], timeout=600) == pytest.approx(single,
                                                                                                       rel=2e-5)
    # the trained checkpoint carries the class it was imported from, which exports it with the logits of
    # our model with the trained (TP x PP consolidated) weights
    (step,) = [d for d in os.listdir(save) if d.startswith("global_step")]
    assert json.load(open(os.path.join(save, step, "megatron_ds_config.json")))["hf_architecture"] == CLASSES[name]
    assert to_hf.main(["--load", save, "--out", str(tmp_path / "out")]) == 0
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    assert type(theirs).__name__ == CLASSES[name]
    _, ours = _ours(save)
    tokens = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(theirs(input_ids=tokens).logits,
                                   ours((tokens, torch.arange(SEQ).expand_as(tokens))), **LOGIT_TOL)


@pytest.mark.parametrize("name", ["llama3.1", "qwen3", "mistral"])
def test_greedy_generation_equals_transformers(imported, name):
    from megatron_ds.checkpoint import load_consolidated
    from megatron_ds.inference.generate import SamplingConfig, generate
    from megatron_ds.inference.model import ModelWeights, build_inference_model

    _, ckpt, _ = imported(name)
    c = load_consolidated(ckpt, log=lambda *a: None, family=GPT)
    model = build_inference_model(ModelWeights(c.model, c.padded_vocab_size, c.vocab_size, c.state_dict), family=GPT)
    prompt = _tokens(1, 8, seed=1)
    ours = generate(model, prompt.tolist(), SamplingConfig(max_new_tokens=16, greedy=True, stop_at_eod=False),
                    eod=0)
    with torch.no_grad():
        theirs = _hf_model(name).generate(prompt, max_new_tokens=16, do_sample=False, eos_token_id=None,
                                          pad_token_id=0)
    assert ours.tokens[0] == theirs[0, 8:].tolist()


def _import_error(tmp_path, capsys, config):
    hf_dir = str(tmp_path / "hf")
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(hf_dir)
    capsys.readouterr()
    assert from_hf.main(["--hf-dir", hf_dir, "--save", str(tmp_path / "ckpt")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    return err


@pytest.mark.parametrize("rope", [{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
                                  {"rope_type": "dynamic", "factor": 2.0}])
def test_unsupported_rope_scaling_is_refused_naming_it(tmp_path, capsys, rope):
    config = transformers.LlamaConfig(**_SMALL, rope_parameters={"rope_theta": 1e4, **rope})
    assert f"rope_scaling rope_type {rope['rope_type']!r}" in _import_error(tmp_path, capsys, config)


def test_qwen3_attention_bias_is_refused_naming_it(tmp_path, capsys):
    config = transformers.Qwen3Config(**_SMALL, head_dim=16, attention_bias=True)
    assert "attention_bias true" in _import_error(tmp_path, capsys, config)


def test_narrow_sliding_window_trains_at_the_window(tmp_path):
    """Mistral's sliding_window 16 under max_position_embeddings 32: the checkpoint's --seq-length is
    the window (it masks nothing there), and the import says so; a longer --seq-length is the model
    features' check to refuse (config/attention.py)."""
    hf_dir = str(tmp_path / "hf")
    torch.manual_seed(0)
    transformers.MistralForCausalLM(transformers.MistralConfig(**_SMALL, sliding_window=16)).save_pretrained(hf_dir)
    lines = []
    from megatron_ds.families.gpt.gpt_hf_import import import_hf
    m = import_hf(hf_dir, str(tmp_path / "ckpt"), family=GPT, log=lines.append)
    assert m.seq_length == 16 and hf.sliding_window(m) == 16
    assert "NOTE: sliding_window 16 is narrower than max_position_embeddings 32: --seq-length 16" in lines[0]


def test_export_refuses_what_the_class_cannot_express(imported, tmp_path, capsys):
    import dataclasses

    from megatron_ds.errors import ConfigError

    _, ckpt, _ = imported("qwen3")
    capsys.readouterr()
    assert to_hf.main(["--load", ckpt, "--out", str(tmp_path / "out"), "--architecture", "LlamaForCausalLM"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "LlamaForCausalLM, which cannot express --qk-layernorm" in err, err

    from megatron_ds.checkpoint.files import open_checkpoint

    m = open_checkpoint(imported("qwen2")[1], None, GPT).model
    for arch, change, named in (
            ("MistralForCausalLM", {}, "--add-qkv-bias (MistralForCausalLM has no biases)"),
            ("LlamaForCausalLM", {}, "--add-qkv-bias without --add-bias-linear"),
            ("Qwen3ForCausalLM", {}, "no --qk-layernorm"),
            ("Qwen2ForCausalLM", {"add_qkv_bias": False}, "no --add-qkv-bias"),
            ("Qwen2ForCausalLM", {"add_bias_linear": True}, "biases on the output projection and MLP"),
            ("LlamaForCausalLM", {"add_qkv_bias": False, "window_size": "(31,0)"}, "--window-size (31,0)"),
            ("Qwen2ForCausalLM", {"use_rope_scaling": True, "rotary_seq_len_interpolation_factor": 2.0},
             "--use-rope-scaling with --rotary-seq-len-interpolation-factor 2"),
            ("MixtralForCausalLM", {"num_experts": (4,), "topk": 2, "disable_moe_token_dropping": True,
                                    "disable_moe_top2_2nd_expert_sampling": True, "qk_layernorm": True},
             "--add-qkv-bias (Mixtral's attention and experts have none; train with --disable-bias-linear); "
             "--qk-layernorm"),
            ("GPT2LMHeadModel", {}, "--position-embedding-type rope"),
            ("MixtralForCausalLM", {}, "needs mixture-of-experts layers"),
            ("OPTForCausalLM", {}, "--architecture OPTForCausalLM: one of")):
        with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace(")", r"\)")):
            hf.choose_architecture(dataclasses.replace(m, **change), asked=arch)
    # by features, without a recorded class
    assert hf.choose_architecture(m) == hf.QWEN2
    assert hf.choose_architecture(dataclasses.replace(m, add_qkv_bias=False)) == hf.LLAMA
    assert hf.choose_architecture(dataclasses.replace(m, add_qkv_bias=False, window_size="(31,0)")) == hf.MISTRAL
    assert hf.choose_architecture(dataclasses.replace(m, add_qkv_bias=False), recorded="MistralForCausalLM") \
        == hf.MISTRAL
    # a recorded class that cannot express the model is passed over
    assert hf.choose_architecture(m, recorded="LlamaForCausalLM") == hf.QWEN2


def test_sharded_export_imports_back(imported, tmp_path):
    """--max-shard-size-gb splits the weights over several files with HF's index; the import reads
    them lazily by name (HFWeights) and gives back the same checkpoint."""
    _, ckpt, _ = imported("qwen3")
    out = str(tmp_path / "out")
    assert to_hf.main(["--load", ckpt, "--out", out, "--max-shard-size-gb", str(100_000 / 2**30)]) == 0
    from safetensors import safe_open

    shards = sorted(set(json.load(open(os.path.join(out, "model.safetensors.index.json")))["weight_map"].values()))
    assert len(shards) > 3
    for shard in shards:  # at most the limit, unless one tensor alone exceeds it
        with safe_open(os.path.join(out, shard), framework="pt") as f:
            sizes = [f.get_tensor(k).numel() * 4 for k in f.keys()]
        assert sum(sizes) <= 100_000 or len(sizes) == 1, (shard, sizes)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out)
    want = _hf_model("qwen3").state_dict()
    assert all(torch.equal(v, want[k]) for k, v in theirs.state_dict().items())
    assert from_hf.main(["--hf-dir", out, "--save", str(tmp_path / "again")]) == 0
    from megatron_ds.checkpoint import load_consolidated

    a, b = (load_consolidated(d, log=lambda *a: None, family=GPT).state_dict for d in (ckpt, str(tmp_path / "again")))
    assert sorted(a) == sorted(b) and all(torch.equal(v, b[k]) for k, v in a.items())



class _PeakAnon:
    """The largest anonymous resident memory (/proc/self/status RssAnon: not the page cache of the
    files read, which the kernel can drop) seen while the block runs, sampled every 2 ms."""

    def __enter__(self):
        import threading

        self.base = self.peak = self._now()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    @staticmethod
    def _now():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))

    def _sample(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self._now())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._now())


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads RssAnon from /proc (Linux)")
def test_a_70b_shaped_model_converts_in_memory_near_one_shard(tmp_path, capfd):
    """Llama 3 70B's shape at 1/32 of its width: 80 layers, 64 query / 8 key-value heads, SwiGLU
    3.5x wide, untied (vocabulary cut to 8192): 71M parameters, 284 MB in sharded safetensors of
    16 MB. Import and export each convert one layer at a time: the extra anonymous memory stays
    within 4 shards (the writer's pending shard, its serialized copy, a layer read, its conversion),
    under a quarter of the model, and each shows its progress per layer."""
    from safetensors.torch import save_file

    shard = 16 * 2**20
    h, heads, kv, ffn, vocab, layers = 256, 64, 8, 896, 8192, 80
    hf_dir = str(tmp_path / "hf")
    transformers.LlamaConfig(vocab_size=vocab, hidden_size=h, intermediate_size=ffn, num_hidden_layers=layers,
                             num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=64,
                             rope_parameters={**_LLAMA3, "original_max_position_embeddings": 8192},
                             tie_word_embeddings=False).save_pretrained(hf_dir)
    g, d = torch.Generator().manual_seed(0), h // heads
    shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,), "lm_head.weight": (vocab, h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (heads * d, h), p + "self_attn.k_proj.weight": (kv * d, h),
                       p + "self_attn.v_proj.weight": (kv * d, h), p + "self_attn.o_proj.weight": (h, heads * d),
                       p + "mlp.gate_proj.weight": (ffn, h), p + "mlp.up_proj.weight": (ffn, h),
                       p + "mlp.down_proj.weight": (h, ffn)})
    total, files, pending, weight_map = 0, 0, {}, {}

    def flush():
        nonlocal files, pending
        files += 1
        save_file(pending, os.path.join(hf_dir, f"model-{files:05d}.safetensors"), metadata={"format": "pt"})
        weight_map.update({k: f"model-{files:05d}.safetensors" for k in pending})
        pending = {}

    for name, shape in shapes.items():
        pending[name] = torch.randn(shape, generator=g) * 0.02
        total += pending[name].numel() * 4
        if sum(t.numel() * 4 for t in pending.values()) >= shard:
            flush()
    flush()
    with open(os.path.join(hf_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    del pending
    capfd.readouterr()
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    with _PeakAnon() as imported_memory:
        assert from_hf.main(["--hf-dir", hf_dir, "--save", ckpt]) == 0
    with _PeakAnon() as exported_memory:
        assert to_hf.main(["--load", ckpt, "--out", out, "--max-shard-size-gb", str(shard / 2**30)]) == 0
    err = capfd.readouterr().err
    assert f"import: {layers + 3}/{layers + 3} layers (100%)" in err and f"export: {layers + 3}/{layers + 3} " \
        "layers (100%)" in err, err
    assert total > 250 * 2**20
    for memory in (imported_memory, exported_memory):
        assert memory.peak - memory.base < 4 * shard, (memory.peak - memory.base) / 2**20
    from safetensors import safe_open

    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))["weight_map"]
    assert sorted(index) == sorted(shapes)
    name = "model.layers.79.mlp.down_proj.weight"
    with safe_open(os.path.join(hf_dir, weight_map[name]), "pt") as a, safe_open(os.path.join(out, index[name]),
                                                                                  "pt") as b:
        assert torch.equal(a.get_tensor(name), b.get_tensor(name))


# config.json as the hub has them (transformers 4 spelling: rope_theta beside rope_scaling)
HUB = {
    "Llama-3.1-8B": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                         rms_norm_eps=1e-5, rope_theta=500000.0, vocab_size=128256, tie_word_embeddings=False,
                         attention_bias=False, mlp_bias=False, hidden_act="silu", torch_dtype="bfloat16",
                         rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                           original_max_position_embeddings=8192, rope_type="llama3")),
    "Llama-3.2-1B": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
                         rms_norm_eps=1e-5, rope_theta=500000.0, vocab_size=128256, tie_word_embeddings=True,
                         rope_scaling=dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                           original_max_position_embeddings=8192, rope_type="llama3")),
    "Qwen2.5-0.5B": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                         rms_norm_eps=1e-6, rope_theta=1000000.0, vocab_size=151936, tie_word_embeddings=True,
                         use_sliding_window=False, sliding_window=32768, max_window_layers=24, rope_scaling=None),
    "Qwen3-0.6B": dict(model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                       rms_norm_eps=1e-6, rope_theta=1000000, vocab_size=151936, tie_word_embeddings=True,
                       attention_bias=False, use_sliding_window=False, sliding_window=None, max_window_layers=28,
                       rope_scaling=None),
    "Mistral-7B-v0.1": dict(model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                            num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768,
                            rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=4096, vocab_size=32000,
                            tie_word_embeddings=False),
    "Mistral-7B-v0.3": dict(model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                            num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=32768,
                            rms_norm_eps=1e-5, rope_theta=1000000.0, sliding_window=None, vocab_size=32768,
                            tie_word_embeddings=False),
}


@pytest.mark.parametrize("name", list(HUB))
def test_hub_configs_export_as_transformers_reads_them(name):
    """A hub config.json read here and written back by the export describes the model transformers
    reads from the original: every field its layers use, as transformers parses each (AutoConfig)."""
    d = HUB[name]
    arch, m = hf.model_config_from_hf(d)
    assert hf.choose_architecture(m, recorded=hf.ARCHITECTURES[arch]) == arch
    theirs = transformers.AutoConfig.for_model(**d)
    ours = hf.hf_config(arch, m, d["vocab_size"], bos=None, eos=None, dtype=torch.float32)
    assert type(ours) is type(theirs)
    for field in FIELDS + ("hidden_size", "num_hidden_layers", "num_attention_heads", "layer_types"):
        want = getattr(theirs, field, None)
        if field == "head_dim" and want is None:  # Qwen2: hidden / heads
            want = theirs.hidden_size // theirs.num_attention_heads
        got = getattr(ours, field, None)
        if field == "head_dim" and got is None:
            got = m.kv_channels
        if field == "rope_parameters":
            want, got = {k: float(v) if isinstance(v, (int, float)) else v for k, v in want.items()}, \
                {k: float(v) if isinstance(v, (int, float)) else v for k, v in got.items()}
        assert got == want, (field, got, want)
    assert m.seq_length == (4096 if name == "Mistral-7B-v0.1" else d["max_position_embeddings"])
