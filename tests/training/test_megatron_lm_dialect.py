"""A run written in upstream Megatron-LM's flags alone (no --deepspeed: the engine from its flags) trains as
the same run written in Megatron-DeepSpeed's flags with a DeepSpeed JSON: equal losses, step for step."""
from __future__ import annotations

import json

import pytest

from tests.distributed import run_distributed
from tests.training.cli import SMALL_GPT, cli_many, iterations

STEPS = ["--train-iters", "10", "--num-attention-heads", "4", "--global-batch-size", "8"]

# Megatron-LM's spelling: grouped-query attention, the distributed optimizer with overlapped reduction and
# 4M-element buckets, and the implementation selectors its example scripts pass
MEGATRON_LM = ["--use-mcore-models", "--group-query-attention", "--num-query-groups", "2", "--use-distributed-optimizer",
               "--overlap-grad-reduce", "--overlap-param-gather", "--ddp-bucket-size", "4000000",
               "--context-parallel-size", "1", "--attention-backend", "auto", "--cross-entropy-loss-fusion",
               "--ckpt-format", "torch_dist", "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files"]
# the same run in Megatron-DeepSpeed's: --deepspeed with the JSON that says the same
MEGATRON_DEEPSPEED_JSON = {"zero_optimization": {"stage": 1, "overlap_comm": True, "reduce_bucket_size": 4000000}}


@pytest.mark.slow
def test_megatron_lm_flags_train_as_the_same_megatron_deepspeed_run(tmp_path):
    ds_json = tmp_path / "zero1.json"
    ds_json.write_text(json.dumps(MEGATRON_DEEPSPEED_JSON))
    mds = ["--deepspeed", "--deepspeed_config", str(ds_json), "--num-key-value-heads", "2"]
    # one run per set of processes: DeepSpeed's ZeRO optimizer keeps state between two engines of one process
    runs = [run_distributed(cli_many, 2, [SMALL_GPT + STEPS + argv], timeout=600) for argv in (MEGATRON_LM, mds)]
    for ranks in runs:
        for [(rc, _, err)] in ranks:
            assert rc == 0, err[-3000:]
    mlm, mds_run = runs
    assert any("ZeRO stage 1: --use-distributed-optimizer" in out + err for [(_, out, err)] in mlm)
    losses = iterations(mlm[-1][0][1])  # the last rank prints the iteration lines
    assert [it for it, _ in losses] == list(range(1, 11)) and losses == iterations(mds_run[-1][0][1])
