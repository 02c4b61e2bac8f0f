"""The sequence-length warm-up's schedule against two references, and its refusals.

References: (1) a transcription, written here, of DeepSpeed's CurriculumScheduler as Megatron-DeepSpeed
ran it (deepspeedai/DeepSpeed: deepspeed/runtime/data_pipeline/curriculum_scheduler.py: the state starts
at min_difficulty; ``update_difficulty(step)`` replaces it with ``get_difficulty(step)`` only while it is
below max_difficulty; fixed_root is ``floor((step / total) ** (1 / degree) * (max - min) + min)`` rounded
down to a multiple of difficulty_step, capped at max; fixed_linear is degree 1; fixed_discrete returns
``difficulty[i]`` for the first ``step <= max_step[i]``, else the last difficulty); (2) the installed
DeepSpeed's own scheduler object, called step by step as megatron/training.py calls it.
"""
from __future__ import annotations

import math

import pytest

from megatron_ds.config import parse_args, resolve
from megatron_ds.config.curriculum import legacy_curriculum, parse_curriculum
from megatron_ds.errors import ConfigError
from megatron_ds.families.gpt.gpt_family import GPT


class TranscribedScheduler:
    def __init__(self, cfg):
        self.cfg, self.current = cfg, cfg["min_difficulty"]

    def get(self, step):
        c, sc = self.cfg, self.cfg["schedule_config"]
        if c["schedule_type"] == "fixed_discrete":
            if step > sc["max_step"][-1]:
                return sc["difficulty"][-1]
            return next(d for d, m in zip(sc["difficulty"], sc["max_step"]) if step <= m)
        degree = 1 if c["schedule_type"] == "fixed_linear" else sc["root_degree"]
        span = c["max_difficulty"] - c["min_difficulty"]
        d = math.floor((step / sc["total_curriculum_step"]) ** (1 / degree) * span + c["min_difficulty"])
        return min(d - d % sc["difficulty_step"], c["max_difficulty"])

    def update(self, step):
        if self.current < self.cfg["max_difficulty"]:
            self.current = self.get(step)
        return self.current


def _block(kind, lo=64, hi=2048, **sc):
    return {"enabled": True, "curriculum_type": "seqlen", "min_difficulty": lo, "max_difficulty": hi,
            "schedule_type": kind, "schedule_config": sc}


BLOCKS = [
    # the rebase 1.3B RoPE script's block (cl_step 953) and the MoE family's dense_cl one (13767)
    _block("fixed_linear", total_curriculum_step=953, difficulty_step=8),
    _block("fixed_linear", 80, total_curriculum_step=13767, difficulty_step=8),
    _block("fixed_root", 80, total_curriculum_step=5000, difficulty_step=16, root_degree=2),
    _block("fixed_root", 128, 1024, total_curriculum_step=77, difficulty_step=64, root_degree=3),
    _block("fixed_discrete", 8, 64, difficulty=[8, 16, 64], max_step=[3, 10]),
    # reaches max_difficulty, then asks for less: the scheduler stays at the maximum
    _block("fixed_discrete", 8, 32, difficulty=[8, 32, 16], max_step=[2, 5]),
]


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: f"{b['schedule_type']}-{b['min_difficulty']}")
def test_schedule_equals_transcription_and_deepspeed(block):
    from deepspeed.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler

    cl = parse_curriculum(block, seq_length=2048)
    steps = range(1, 16000)  # every step, in order: both references keep state between calls
    ours = [cl.seqlen_at(step) for step in steps]
    ref = TranscribedScheduler(block)
    ds = CurriculumScheduler(block)
    assert ours == [ref.update(step) for step in steps]
    assert ours == [ds.update_difficulty(step) for step in steps]


def test_named_values_of_the_rebase_script():
    cl = parse_curriculum(BLOCKS[0], seq_length=2048)
    # floor(64 + 1984 * n / 953) rounded down to 8: n=1 -> 66 -> 64; n=4 -> 72.3 -> 72; n=477 -> 1057 -> 1056
    assert [cl.seqlen_at(n) for n in (1, 4, 477, 952, 953, 10 ** 6)] == [64, 72, 1056, 2040, 2048, 2048]


@pytest.mark.parametrize("block,message", [
    (_block("custom"), r'"schedule_type" \'custom\' is not supported'),
    ({**_block("fixed_linear", total_curriculum_step=9, difficulty_step=8), "curriculum_type": "vocab"},
     r'"curriculum_type" \'vocab\' is not supported'),
    (_block("fixed_linear", 60, total_curriculum_step=9, difficulty_step=8),
     r"not a multiple of \"difficulty_step\" 8"),
    (_block("fixed_linear", 64, 4096, total_curriculum_step=9, difficulty_step=8), r"4096 is above --seq-length 2048"),
    (_block("fixed_root", total_curriculum_step=9, difficulty_step=8), r'needs "root_degree"'),
    (_block("fixed_discrete", difficulty=[8, 16], max_step=[1, 2]), r"one longer than"),
])
def test_refusals_are_one_line(block, message):
    with pytest.raises(ConfigError, match=message) as err:
        parse_curriculum(block, seq_length=2048)
    assert "\n" not in str(err.value)


def test_enabled_comes_from_the_block_else_the_flag():
    block = _block("fixed_linear", total_curriculum_step=9, difficulty_step=8)
    assert legacy_curriculum({"curriculum_learning": block}, False, 2048) is not None
    # megatron/training.py pretrain: the JSON's "enabled" overrides --curriculum-learning-legacy
    assert legacy_curriculum({"curriculum_learning": {**block, "enabled": False}}, True, 2048) is None
    without = {k: v for k, v in block.items() if k != "enabled"}
    assert legacy_curriculum({"curriculum_learning": without}, False, 2048) is None
    assert legacy_curriculum({"curriculum_learning": without}, True, 2048) is not None
    with pytest.raises(ConfigError, match="needs a \"curriculum_learning\" block"):
        legacy_curriculum({}, True, 2048)


BASE = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --micro-batch-size 2 --lr 1e-3 "
        "--train-iters 10 --mock-data --vocab-size 512").split()


def _resolve(argv, block, world=4):
    cfg, _ = parse_args(BASE + argv)
    return resolve(cfg, world_size=world, vocab_size=512, ds_template={"curriculum_learning": block}, family=GPT)


def test_resolve_takes_the_block_out_of_the_engine_json_and_refuses_what_cannot_run():
    block = _block("fixed_linear", 16, 64, total_curriculum_step=9, difficulty_step=8)
    disabled = _resolve(["--curriculum-learning-legacy"], {**block, "enabled": False})
    assert disabled.layout.curriculum is None and "curriculum_learning" not in disabled.layout.ds_config
    run = _resolve([], block)
    assert run.layout.curriculum.seqlen_at(1) == 16 and "curriculum_learning" not in run.layout.ds_config
    with pytest.raises(ConfigError, match="interleaved pipeline schedule"):
        _resolve(["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
                  "--global-batch-size", "8"], block)
    _resolve(["--tensor-model-parallel-size", "4", "--sequence-parallel"], block)  # lengths 16, 24, ..., 64
    odd = _block("fixed_linear", 16, 64, total_curriculum_step=9, difficulty_step=2)
    with pytest.raises(ConfigError, match=r"lengths \(2, 64\) are not all multiples of 4"):
        _resolve(["--tensor-model-parallel-size", "4", "--sequence-parallel"], odd)
