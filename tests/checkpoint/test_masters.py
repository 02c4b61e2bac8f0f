"""Consolidation and Hugging Face export from the fp32 master weights (``from_masters`` /
``tools/checkpoint/to_hf.py --from-fp32-masters``) of a bf16 run.

The reference is DeepSpeed's own reader, ``deepspeed.utils.zero_to_fp32``, on a bf16 ZeRO-1
checkpoint of the plain engine (DP 2): our masters must be the same bits. The module's bf16
weights must be exactly those masters rounded to bf16 (DeepSpeed copies the rounded masters into
the module after each step), and after two steps at lr 1e-3 some masters must differ from their
rounding, or the comparison would not tell the two sources apart.
"""
import os

import pytest
import torch

from megatron_ds.cli import to_hf
from megatron_ds.families.gpt.gpt_family import GPT
from tests.checkpoint.common import train

EMBED = "tied_modules.embed.word_embeddings.weight"


@pytest.fixture(scope="module")
def bf16_zero1(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("bf16-zero1"))
    # --deepspeed: DeepSpeed's default bf16 gradients, its ZeRO optimizer, whose files zero_to_fp32 reads (Megatron-LM's
    # command line would accumulate in fp32: BF16_Optimizer, whose files it does not read)
    train("gpt2", 1, 1, 2, 2, ["--bf16", "--zero-stage", "1", "--deepspeed", "--no-pipeline-parallel", "--save", ckpt])
    return ckpt


def test_masters_are_deepspeeds_fp32_weights(bf16_zero1):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from megatron_ds.checkpoint import load_consolidated

    masters = load_consolidated(bf16_zero1, from_masters=True, log=lambda *a: None, family=GPT).state_dict
    weights = load_consolidated(bf16_zero1, log=lambda *a: None, family=GPT).state_dict
    reference = get_fp32_state_dict_from_zero_checkpoint(bf16_zero1, tag="global_step2")
    assert sorted(masters) == sorted(reference) == sorted(weights)
    for name, tensor in reference.items():
        assert torch.equal(masters[name], tensor), name
        assert torch.equal(masters[name].to(torch.bfloat16).float(), weights[name]), name
    assert any(not torch.equal(masters[k], weights[k]) for k in masters)


def test_export_from_fp32_masters(bf16_zero1, tmp_path):
    from safetensors.torch import load_file

    from megatron_ds.checkpoint import load_consolidated

    masters = load_consolidated(bf16_zero1, from_masters=True, log=lambda *a: None, family=GPT).state_dict
    exported = {}
    for flag in ([], ["--from-fp32-masters"]):
        out = str(tmp_path / ("masters" if flag else "weights"))
        assert to_hf.main(["--load", bf16_zero1, "--out", out, "--dtype", "fp32", *flag]) == 0
        exported[bool(flag)] = load_file(os.path.join(out, "model.safetensors"))
    assert sorted(exported[True]) == sorted(exported[False])
    # the embedding is exported as it is (GPT-2 names it transformer.wte), real vocabulary rows only
    wte = exported[True]["transformer.wte.weight"]
    assert torch.equal(wte, masters[EMBED][:wte.shape[0]])
    for name, tensor in exported[True].items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor.to(torch.bfloat16).float(), exported[False][name]), name
