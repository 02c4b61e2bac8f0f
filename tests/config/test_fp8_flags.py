"""The FP8 flags of Megatron-DeepSpeed (megatron/arguments.py _add_transformer_engine_args) and Megatron-LM
(--fp8-format, --fp8-recipe): each accepted with its meaning, which --dry-run states (recipe, layers in FP8,
memory effect), or refused in one line naming what to use; a GPU without FP8 stops at start-up in one line."""
from __future__ import annotations

import pytest
import torch

from megatron_ds.config import parse_args
from megatron_ds.config.fp8_flags import fp8_recipe
from megatron_ds.errors import ConfigError
from megatron_ds.families import main
from megatron_ds.parallel.fp8 import Fp8Recipe
from megatron_ds.training.device import check_fp8_device

BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 16 --micro-batch-size 2 "
        "--train-iters 10 --lr 1e-3 --mock-data --vocab-size 128 --bf16 --dry-run --world-size 1").split()


def _dry_run(capsys, *flags) -> tuple[int, str, str]:
    try:
        rc = main(BASE + list(flags))
    except SystemExit as exc:  # a refusal by the parser (status 2)
        rc = exc.code
    out, err = capsys.readouterr()
    return rc, out, err.strip()


def _recipe(*flags) -> Fp8Recipe | None:
    return fp8_recipe(parse_args(list(flags))[0].model)


@pytest.mark.parametrize("flags,recipe", [
    ((), None),
    (("--fp8-margin", "2", "--no-fp8-wgrad"), None),  # the knobs alone turn nothing on, as in Megatron
    (("--fp8-hybrid",), Fp8Recipe("hybrid")),
    (("--fp8-e4m3",), Fp8Recipe("e4m3")),
    (("--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"), Fp8Recipe("hybrid")),
    (("--fp8-format", "e4m3", "--fp8-recipe", "rowwise"), Fp8Recipe("e4m3", "rowwise")),
    (("--fp8-hybrid", "--fp8-margin", "2", "--no-fp8-wgrad", "--fp8-interval", "4", "--fp8-amax-history-len", "1",
      "--fp8-amax-compute-algo", "max"), Fp8Recipe("hybrid", margin=2, wgrad=False)),
    # Megatron-LM's --fp8-format without --fp8-recipe: its default, delayed (TransformerConfig.fp8_recipe)
    (("--fp8-format", "hybrid"), Fp8Recipe("hybrid", "delayed")),
    # NVIDIA's examples/llama/train_llama3_8b_h100_fp8.sh, as written
    (("--fp8-format", "hybrid", "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo", "max",
      "--fp8-param-gather"), Fp8Recipe("hybrid", "delayed", amax_history_len=1024, amax_compute_algo="max")),
    (("--fp8-e4m3", "--fp8-recipe", "delayed", "--fp8-margin", "1"), Fp8Recipe("e4m3", "delayed", margin=1)),
    # Megatron-DeepSpeed's spelling with a history: the history is delayed scaling's
    (("--fp8-hybrid", "--fp8-amax-history-len", "16"), Fp8Recipe("hybrid", "delayed", amax_history_len=16)),
])
def test_flags_make_the_recipe(flags, recipe):
    assert _recipe(*flags) == recipe


def test_dry_run_states_recipe_layers_and_memory(capsys):
    rc, out, _ = _dry_run(capsys, "--fp8-hybrid", "--fp8-margin", "1", "--no-fp8-wgrad", "--fp8-interval", "4",
                          "--fp8-amax-history-len", "1", "--fp8-amax-compute-algo", "max", "--transformer-impl", "local")
    assert rc == 0
    line = next(l for l in out.splitlines() if l.startswith("FP8: "))
    for says in ("hybrid (E4M3 forward, E5M2 gradients)", "tensorwise current scaling", "margin 1",
                 "weight gradient in bf16/fp32", "QKV, attention output, MLP in/out", "output layer",
                 "memory: unchanged", "--fp8-interval 4: ignored", "--fp8-amax-compute-algo max"):
        assert says in line, (says, line)
    rc, out, _ = _dry_run(capsys, "--fp8-format", "e4m3", "--fp8-recipe", "rowwise", "--num-experts", "2",
                          "--create-moe-param-group")
    line = next(l for l in out.splitlines() if l.startswith("FP8: "))
    assert rc == 0 and "E4M3 everywhere" in line and "rowwise" in line and "MoE experts" in line, line
    assert "FP8: off" in _dry_run(capsys)[1]


def test_dry_run_says_which_scaling_runs_and_why(capsys):
    rc, out, _ = _dry_run(capsys, "--fp8-format", "hybrid", "--fp8-amax-history-len", "1024",
                          "--fp8-amax-compute-algo", "max", "--fp8-param-gather")
    line = next(l for l in out.splitlines() if l.startswith("FP8: "))
    for says in ("delayed scaling (Megatron-LM's default --fp8-recipe for --fp8-format", "max amax of a history of 1024",
                 "reduced over tensor and data parallel ranks", "--fp8-param-gather: not made, the weights stay bf16/fp32"):
        assert rc == 0 and says in line, (says, line)
    rc, out, _ = _dry_run(capsys, "--fp8-hybrid")
    line = next(l for l in out.splitlines() if l.startswith("FP8: "))
    assert "tensorwise current scaling (--fp8-hybrid without --fp8-recipe" in line and "--fp8-recipe delayed" in line


@pytest.mark.parametrize("flags,says", [
    (("--fp8-hybrid", "--fp8-recipe", "mxfp8"), "use --fp8-recipe delayed (Megatron-LM's default), rowwise"),
    (("--fp8-e4m3", "--fp8-recipe", "blockwise"), "rowwise (torchao's per-row scales)"),
    (("--fp8-hybrid", "--fp8-recipe", "rowwise"), "use --fp8-format e4m3"),
    (("--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--fp8-amax-history-len", "1024"),
     "use --fp8-recipe delayed or drop it"),
    (("--fp8-format", "hybrid", "--fp8-amax-history-len", "0"), "must be >= 1"),
    (("--fp8-e4m3", "--fp8-hybrid"), "choose one"),
    (("--fp8-format", "e4m3", "--fp8-hybrid"), "pass one of them"),
])
def test_unavailable_recipes_are_refused_in_one_line(capsys, flags, says):
    rc, _, err = _dry_run(capsys, *flags)
    lines = [l for l in err.splitlines() if "--help)" not in l]  # argparse's errors add a pointer to --help
    assert rc != 0 and len(lines) == 1 and says in lines[0], err


def test_gpu_without_fp8_stops_at_start_up():
    cuda = torch.device("cuda", 0)
    for capability in ((7, 0), (8, 0), (8, 6)):  # V100, A100, RTX 30xx: no FP8 tensor cores
        with pytest.raises(ConfigError) as info:
            check_fp8_device(True, cuda, capability=lambda device, c=capability: c)
        assert len(str(info.value).splitlines()) == 1 and f"is {capability[0]}.{capability[1]}" in str(info.value)
        assert "--bf16" in str(info.value)
    for capability in ((8, 9), (9, 0), (10, 0)):  # Ada, Hopper (H100/H200), Blackwell
        check_fp8_device(True, cuda, capability=lambda device, c=capability: c)
    check_fp8_device(False, cuda, capability=lambda device: (7, 0))  # no FP8 asked: nothing to say
    check_fp8_device(True, torch.device("cpu"), capability=lambda device: (7, 0))  # the CPU emulates
