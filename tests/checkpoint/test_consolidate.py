"""load_consolidated: a checkpoint written at TP 2 x PP 2 gives the same full weights as the same
training run at TP 1 x PP 1, and they load into the single-process model key for key.

Tolerance: the two runs sum the same numbers in different orders (TP splits the matmul
reductions, PP the tied-embedding gradient), ~1e-7 relative per step, which two Adam steps at
lr 1e-3 turn into at most ~1e-6 on weights of size ~0.02-1; a wrong shard order or a transposed
merge moves whole rows (differences of the weights' own size, ~1e-2).
"""
import pytest
import torch

from tests.checkpoint.common import train
from megatron_ds.families.gpt.gpt_family import GPT

TOL = dict(rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_tp2_pp2_consolidates_to_the_single_process_weights(tmp_path, style):
    from megatron_ds.checkpoint import load_consolidated
    from megatron_ds.families.gpt.gpt_model import build_sequential_gpt

    dirs = {}
    for tp, pp in ((1, 1), (2, 2)):
        dirs[tp, pp] = str(tmp_path / f"tp{tp}pp{pp}")
        train(style, tp, pp, 1, 2, ["--save", dirs[tp, pp]])
    ref = load_consolidated(dirs[1, 1], log=lambda *a: None, family=GPT)
    got = load_consolidated(dirs[2, 2], log=lambda *a: None, family=GPT)
    assert got.iteration == 2 and got.vocab_size == 512 and got.padded_vocab_size == 512
    assert got.model == ref.model
    assert sorted(got.state_dict) == sorted(ref.state_dict)
    for name, tensor in ref.state_dict.items():
        assert got.state_dict[name].dtype == torch.float32
        torch.testing.assert_close(got.state_dict[name], tensor, **TOL, msg=name)
    model = build_sequential_gpt(got.model, padded_vocab_size=got.padded_vocab_size, seed=1)
    model.load_state_dict(got.state_dict)  # strict: every key and shape of the real model
    # trained: not the initial weights (seed 1234 is the runs' seed)
    init = build_sequential_gpt(got.model, padded_vocab_size=got.padded_vocab_size, seed=1234).state_dict()
    assert any(not torch.equal(init[k], got.state_dict[k]) for k in init)
