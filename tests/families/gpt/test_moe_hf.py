"""Export of a Llama-style top-2 MoE checkpoint to transformers' MixtralForCausalLM.

The model: rotary positions, RMSNorm, SwiGLU experts, no biases, GQA, untied output layer, 4
experts on every layer (--expert-interval 1), top-2 gating with token dropping and second-expert
sampling disabled, trained 2 steps at EP 2 x DP 2. Exported with tools/checkpoint/to_hf.py, loaded
by ``MixtralForCausalLM.from_pretrained`` (no missing or unexpected weights: the export uses the
hub's ``block_sparse_moe.experts.E.w1/w2/w3`` layout, which transformers 5 fuses on loading).

Ours: the consolidated checkpoint in the inference model (``megatron_ds.inference.model``, the
MoE layers in eval mode). Both fp32 on the same weights: DeepSpeed's gate and Mixtral's router
compute the same fp32 softmax over the same logits and renormalize the same top 2, so the routing
is identical and the outputs differ only by summation order in attention and the expert mixing
(~1e-7 relative on logits of size ~1): atol 1e-5, as tests/families/gpt/test_hf.py. A routing
difference would move a token's output by a whole expert's contribution (~1e-1).

A checkpoint Mixtral cannot express (GPT-2-style MoE with top-1 gating and token dropping) is
refused by the CLI with one line naming the reasons; tools/checkpoint/to_universal.py refuses MoE
checkpoints in one line too (DeepSpeed's converter does not read expert files).
"""
import pytest
import torch

from tests.checkpoint.common import train

transformers = pytest.importorskip("transformers")
from megatron_ds.cli import to_hf  # noqa: E402
from megatron_ds.families.gpt.gpt_family import GPT

pytestmark = pytest.mark.timeout(1500)
LOGIT_TOL = dict(rtol=1e-5, atol=1e-5)
# what Mixtral can express (an MoE layer every layer, top-2, no drops, no sampling), at EP 2; the
# init std is each test's (tests/inference/test_moe_inference.py uses these flags too)
MIXTRAL_MOE = ["--num-experts", "4", "--expert-interval", "1", "--topk", "2", "--disable-moe-token-dropping",
               "--disable-moe-top2-2nd-expert-sampling", "--moe-expert-parallel-size", "2", "--vocab-size", "500"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("moe-ckpt"))
    train("llama", 1, 1, 2, 2, ["--save", ckpt, *MIXTRAL_MOE, "--init-method-std", "0.1"])
    out = str(tmp_path_factory.mktemp("moe-hf"))
    assert to_hf.main(["--load", ckpt, "--out", out]) == 0
    return ckpt, out


def test_mixtral_export_has_equal_logits(exported):
    from megatron_ds.checkpoint import load_consolidated
    from megatron_ds.inference.model import ModelWeights, build_inference_model

    ckpt, out = exported
    hf, info = transformers.MixtralForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched weights
    assert hf.config.num_local_experts == 4 and hf.config.num_experts_per_tok == 2
    c = load_consolidated(ckpt, log=lambda *a: None, family=GPT)
    ours = build_inference_model(ModelWeights(c.model, c.padded_vocab_size, c.vocab_size, c.state_dict), family=GPT)
    tokens = torch.randint(0, 500, (2, 32), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(32).expand_as(tokens)
    with torch.no_grad():
        want = ours.logits(tokens, positions)
        got = hf.eval()(tokens).logits
    assert got.shape == want.shape == (2, 32, 500)
    torch.testing.assert_close(got, want, **LOGIT_TOL)


def test_export_refuses_what_mixtral_cannot_express(tmp_path, capsys):
    ckpt = str(tmp_path / "gpt2-moe")
    train("gpt2", 1, 1, 1, 1, ["--save", ckpt, "--deepspeed", "--num-experts", "2"])  # DeepSpeed-MoE's defaults
    assert to_hf.main(["--load", ckpt, "--out", str(tmp_path / "hf")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: a mixture-of-experts model exports as MixtralForCausalLM")
    for reason in ("--position-embedding-type learned_absolute", "GeLU experts", "biases", "--expert-interval 2",
                   "--topk 1", "token dropping"):
        assert reason in err
    # DeepSpeed's ds_to_universal cannot read expert files (Megatron-DeepSpeed's KeyError 'param_shapes')
    from megatron_ds.cli import to_universal

    assert to_universal.main(["--load", ckpt]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "mixture-of-experts layers, whose expert files" in err
