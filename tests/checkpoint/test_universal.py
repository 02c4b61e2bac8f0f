"""DeepSpeed universal checkpoints (``--universal-checkpoint``).

Ours -> universal -> any layout: a run at (TP 2, PP 2) with ZeRO-1 saves at steps 3 and 6;
DeepSpeed's own converter (``deepspeed.checkpoint.ds_to_universal``, run in-process exactly as its
command line does) turns step 3 into a universal checkpoint, and a run at another layout resumes
from it with ``--universal-checkpoint``: losses of steps 4-6 and the step-6 weights must equal the
uninterrupted run's. The run flags, layouts and tolerances are those of test_reshard.py (see its
docstring: same model, same reasons); the universal files hold the same fp32 masters and Adam
moments that resharding reads, so nothing here is looser.
"""
import argparse
import os

import pytest

from tests.checkpoint.test_reshard import BF16, FP32, _check_resumed, _straight


def ds_to_universal(ckpt: str, iteration: int) -> str:
    """``python -m deepspeed.checkpoint.ds_to_universal --input_folder ckpt/global_stepN
    --output_folder ckpt/global_stepN_universal`` (one worker: the test machine has two cores)."""
    from deepspeed.checkpoint import ds_to_universal as tool

    out = os.path.join(ckpt, f"global_step{iteration}_universal")
    tool.main(argparse.Namespace(input_folder=os.path.join(ckpt, f"global_step{iteration}"), output_folder=out,
                                 num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
                                 inject_missing_state=False))
    return out


@pytest.mark.parametrize("precision,tol", [([], FP32), (["--bf16"], BF16)], ids=["fp32", "bf16"])
def test_ours_tp2_pp2_zero1_to_universal_resumes_at_dp2(tmp_path_factory, tmp_path, precision, tol):
    extra = [*precision, "--zero-stage", "1"]
    straight, ckpt = _straight(tmp_path_factory, "uc", (2, 2, 1), extra)
    out = ds_to_universal(ckpt, 3)
    assert sorted(os.listdir(os.path.join(out, "zero", "tied_modules.embed.word_embeddings.weight"))) == \
        ["exp_avg.pt", "exp_avg_sq.pt", "fp32.pt", "step.pt"]
    _check_resumed(straight, ckpt, (1, 1, 2), [*extra, "--universal-checkpoint"], tmp_path, tol)
