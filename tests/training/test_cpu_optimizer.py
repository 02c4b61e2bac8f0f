"""--cpu-optimizer trained end to end on CPU under ZeRO-Offload, as Megatron-DeepSpeed builds it.

DeepSpeed refuses ZeRO-Offload with any client optimizer but DeepSpeedCPUAdam unless the JSON says
"zero_force_ds_cpu_optimizer": false (deepspeed/runtime/engine.py), and ZeRO-3's partial offload asserts
DeepSpeedCPUAdam (runtime/zero/stage3.py): the runs below without that switch prove what DeepSpeed got.
The reference is torch.optim.AdamW (--cpu_torch_adam, the same AdamW update), on the same model and data.
DeepSpeedCPUAdam builds its CPU op with the host compiler on first use (cached in TORCH_EXTENSIONS_DIR).
"""
from __future__ import annotations

import json

import pytest

from tests.distributed import run_distributed
from tests.training.common import TINY_GPT
from tests.training.test_token_rampup import _train

ARGV = TINY_GPT + ["--train-iters", "3", "--no-pipeline-parallel", "--hidden-dropout", "0", "--attention-dropout", "0"]


def _run(tmp_path, flags, zero, **top):
    path = tmp_path / f"ds{len(list(tmp_path.iterdir()))}.json"
    path.write_text(json.dumps({"zero_optimization": zero, **top}))
    return run_distributed(_train, 1, ARGV + flags + ["--deepspeed_config", str(path)], timeout=900)[-1]


def test_deepspeed_cpu_adam_trains_like_torch_adamw_under_offload(tmp_path):
    offload = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    cpu_adam = _run(tmp_path, ["--cpu-optimizer"], offload)
    torch_adam = _run(tmp_path, ["--cpu-optimizer", "--cpu_torch_adam"], offload, zero_force_ds_cpu_optimizer=False)
    partial = _run(tmp_path, ["--cpu-optimizer"],
                   {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True, "ratio": 0.3}})
    assert "optimizer: deepspeed.ops.adam.DeepSpeedCPUAdam" in cpu_adam["log"]
    assert "optimizer: torch.optim.AdamW (--cpu_torch_adam)" in torch_adam["log"]
    assert len(cpu_adam["history"]) == 3
    # the same AdamW update in fp32; DeepSpeedCPUAdam's vectorised loop rounds differently from torch's
    for run in (torch_adam, partial):
        assert [loss for _, loss in run["history"]] == pytest.approx([loss for _, loss in cpu_adam["history"]],
                                                                     rel=1e-5)
