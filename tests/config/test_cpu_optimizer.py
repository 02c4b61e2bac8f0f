"""--cpu-optimizer / --cpu_torch_adam against the DeepSpeed JSON's ZeRO-Offload, at resolve time.

What must agree (deepspeedai/Megatron-DeepSpeed megatron/optimizer/__init__.py builds DeepSpeedCPUAdam for
--cpu-optimizer, torch.optim.AdamW with --cpu_torch_adam, and asserts Adam; deepspeedai/DeepSpeed
runtime/engine.py refuses ZeRO-Offload with a client optimizer other than DeepSpeedCPUAdam unless
"zero_force_ds_cpu_optimizer" is false; runtime/zero/config.py allows a partial "ratio" at ZeRO-3 only and
runtime/zero/stage3.py asserts DeepSpeedCPUAdam for it).
"""
from __future__ import annotations

import pytest

from megatron_ds.config import parse_args, resolve
from megatron_ds.errors import ConfigError
from megatron_ds.families.gpt.gpt_family import GPT

BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
        "--lr 1e-3 --train-iters 10 --mock-data --vocab-size 512 --no-pipeline-parallel --bf16").split()


def _resolve(flags: str, zero: dict | None = None, **top):
    cfg, ignored = parse_args(BASE + flags.split())
    template = {"zero_optimization": zero or {"stage": 2}, **top}
    return resolve(cfg, world_size=2, vocab_size=512, ds_template=template, ignored=ignored, family=GPT)


CPU = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
PARTIAL = {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True, "ratio": 0.3}}


@pytest.mark.parametrize("flags,zero,top", [
    ("--cpu-optimizer", CPU, {}),  # DeepSpeedCPUAdam: DeepSpeed needs no switch
    ("--cpu-optimizer", PARTIAL, {}),
    ("--cpu-optimizer", {"stage": 1, "offload_optimizer": {"device": "nvme", "nvme_path": "/local"}}, {}),
    ("--cpu-optimizer --cpu_torch_adam", CPU, {"zero_force_ds_cpu_optimizer": False}),
    ("", CPU, {"zero_force_ds_cpu_optimizer": False}),  # megatron_ds's own AdamW, offloaded
])
def test_agreeing_combinations_resolve(flags, zero, top):
    run = _resolve(flags, zero, **top)
    assert run.optimizer.cpu_optimizer == ("--cpu-optimizer" in flags)
    assert run.optimizer.cpu_torch_adam == ("--cpu_torch_adam" in flags)


@pytest.mark.parametrize("flags,zero,top,message", [
    ("--cpu-optimizer", None, {}, r"--cpu-optimizer steps the optimizer on the CPU, but the DeepSpeed JSON does "
                                  r"not offload it; add \"offload_optimizer\""),
    ("--cpu-optimizer --cpu_torch_adam", {"stage": 2, "offload_optimizer": {"device": "none"}}, {},
     "does not offload it"),
    ("--cpu-optimizer --optimizer sgd", CPU, {}, "builds an Adam optimizer"),
    ("", CPU, {}, r"without --cpu-optimizer the optimizer is torch.optim.AdamW, which DeepSpeed refuses"),
    ("--cpu-optimizer --cpu_torch_adam", CPU, {}, r"--cpu_torch_adam builds torch.optim.AdamW, which DeepSpeed"),
    ("", PARTIAL, {"zero_force_ds_cpu_optimizer": False}, r"\"ratio\" 0.3 .* runs only DeepSpeedCPUAdam"),
    ("--cpu-optimizer --cpu_torch_adam", PARTIAL, {"zero_force_ds_cpu_optimizer": False}, "runs only DeepSpeedCPUAdam"),
])
def test_disagreements_are_one_line_errors(flags, zero, top, message):
    with pytest.raises(ConfigError, match=message) as err:
        _resolve(flags, zero, **top)
    assert "\n" not in str(err.value)


def test_cpu_torch_adam_alone_has_no_effect_and_says_so():
    run = _resolve("--cpu_torch_adam")
    assert "--cpu_torch_adam has no effect without --cpu-optimizer (as in Megatron-DeepSpeed)" in run.notes


def test_json_bf16_wins_over_fp16_but_not_the_reverse():
    cfg, _ = parse_args([f for f in BASE if f != "--bf16"] + ["--fp16"])
    both = {"zero_optimization": {"stage": 2}}
    run = resolve(cfg, world_size=2, vocab_size=512,
                  ds_template={**both, "fp16": {"enabled": False}, "bf16": {"enabled": True}}, family=GPT)
    assert run.layout.precision == "bf16" and any("--fp16 gives way" in n for n in run.notes)
    with pytest.raises(ConfigError, match=r'"fp16.enabled" = False contradicts the precision flag: --fp16'):
        resolve(cfg, world_size=2, vocab_size=512, ds_template={**both, "fp16": {"enabled": False}}, family=GPT)
    cfg, _ = parse_args(BASE)  # --bf16 with an fp16 JSON: fp16 could overflow where bf16 does not
    with pytest.raises(ConfigError, match=r'"fp16.enabled" = True contradicts the precision flag: --bf16'):
        resolve(cfg, world_size=2, vocab_size=512,
                ds_template={**both, "fp16": {"enabled": True}, "bf16": {"enabled": False}}, family=GPT)
