"""Which output layer + loss a run gets: liger-kernel's fused linear + cross entropy only when asked
(--liger-kernel) or where the logits would crowd the GPU (more than 15% of its memory), else
logits + vocab-parallel cross entropy; the start-up line and --dry-run say which and why."""
from __future__ import annotations

import contextlib
import io

import pytest

from megatron_ds.config import parse_args, resolve
from megatron_ds.families import main as pretrain_main
from megatron_ds.families.gpt.gpt_family import GPT
from megatron_ds.model.kernels import describe_kernels

# GPT 1.3B as measured on an H200 (liger's fused loss cost ~20% per iteration there)
GPT_1_3B = ("--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 "
            "--max-position-embeddings 2048 --micro-batch-size 4 --global-batch-size 4 --train-iters 10 "
            "--lr 1e-4 --mock-data --vocab-size 50257 --bf16").split()


def _logits_gb(micro: int, seq: int) -> float:
    """The unfused path's bytes, counted from the tensors it makes: bf16 logits [tokens, 50304] (the
    GPT-2 vocabulary padded to a multiple of 128) and their bf16 gradient, plus the chunked cross
    entropy's three fp32 work tensors of 2^26 elements."""
    tokens, padded = micro * seq, 50304
    assert padded % 128 == 0 and 0 <= padded - 50257 < 128
    return (tokens * padded * (2 + 2) + 3 * 2 ** 26 * 4) / 1e9


def _choice(argv, gpu_memory=None):
    cfg, _ = parse_args(argv)
    run = resolve(cfg, world_size=1, vocab_size=50257, device_type="cuda", gpu_memory=gpu_memory, family=GPT)
    return run.layout.model.liger_kernel, run.fused_loss_reason


def test_the_rule_on_both_sides_of_fifteen_percent():
    logits = _logits_gb(4, 2048)  # 2.45 GB: 15% of a 16.4 GB GPU
    assert 16 < logits / 0.15 < 17
    fused, why = _choice(GPT_1_3B, gpu_memory=16e9)  # a V100's 16 GB: 15.3%
    assert fused is True
    assert why == f"logits + cross entropy {logits:.1f} GB = {100 * logits / 16:.1f}% of 16 GB > 15%"
    fused, why = _choice(GPT_1_3B, gpu_memory=17e9)  # 14.4%
    assert fused is False and why.endswith(f"= {100 * logits / 17:.1f}% of 17 GB <= 15%")
    # no device: --gpu-memory-gb, else an H200 (141 GB) is assumed
    assert _choice(GPT_1_3B + ["--gpu-memory-gb", "v100"])[0] is True
    fused, why = _choice(GPT_1_3B)
    assert fused is False and f"{100 * logits / 141:.1f}% of 141 GB (h200, assumed) <= 15%" in why
    # on an H200 it takes 16x the tokens: micro batch 16 at seq 8192 (27 GB, 19%)
    big = [a if a != "2048" else "8192" for a in GPT_1_3B]
    big[big.index("--micro-batch-size") + 1] = big[big.index("--global-batch-size") + 1] = "16"
    assert _logits_gb(16, 8192) / 141 > 0.15 and _choice(big)[0] is True
    # the flags win over the rule, both ways
    assert _choice(GPT_1_3B + ["--liger-kernel"]) == (True, "--liger-kernel")
    assert _choice(GPT_1_3B + ["--no-liger-kernel"], gpu_memory=16e9) == (False, "--no-liger-kernel")


def test_start_up_line_names_the_loss_kernel_and_why():
    fused, why = _choice(GPT_1_3B)
    cfg, _ = parse_args(GPT_1_3B)
    model = resolve(cfg, world_size=1, vocab_size=50257, device_type="cuda", family=GPT).layout.model
    line = describe_kernels(model, 1, why)["output layer + loss"]
    assert line.startswith("logits + vocab-parallel cross entropy (logits + cross entropy 2.5 GB")
    assert "--liger-kernel" in line


@pytest.mark.parametrize("memory, liger", [(None, False), ("v100", True)])
def test_dry_run_of_gpt_1_3b_says_which_loss_a_gpu_run_uses(memory, liger):
    out = io.StringIO()
    argv = GPT_1_3B + ["--dry-run"] + (["--gpu-memory-gb", memory] if memory else [])
    with contextlib.redirect_stdout(out):
        assert pretrain_main(argv) == (0 if memory is None else 1)  # 49.7 GB does not fit a V100
    line = next(x for x in out.getvalue().splitlines() if x.startswith("output layer + loss on CUDA: "))
    if not liger:
        assert line == ("output layer + loss on CUDA: logits + vocab-parallel cross entropy (logits + cross "
                        f"entropy 2.5 GB = {100 * _logits_gb(4, 2048) / 141:.1f}% of 141 GB (h200, assumed) "
                        "<= 15%; liger-kernel's fused linear + cross entropy: --liger-kernel)")
    else:
        assert "liger-kernel fused linear + cross entropy" in line or "liger-kernel not installed" in line
        assert "15.3% of 16 GB > 15%" in line


@pytest.mark.parametrize("extra, layers, optimizer", [
    ([], "transformer layers: each compiled with torch.compile",
     "optimizer: apex.optimizers.FusedAdam where apex's CUDA extension imports, else torch.optim.AdamW(fused=True)"),
    (["--no-compile-layers", "--optimizer", "sgd"], "transformer layers: eager", "optimizer: torch.optim.SGD"),
])
def test_dry_run_names_every_kernel_a_gpu_run_uses(extra, layers, optimizer):
    """Before the queue, on a host without a GPU: the attention, norm, fusion, layer and optimizer
    choices of a CUDA run, as the start-up `kernels:` line would print them there."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert pretrain_main(GPT_1_3B + ["--dry-run"] + extra) == 0
    line = next(x for x in out.getvalue().splitlines() if x.startswith("kernels on CUDA: "))
    for piece in ("attention: torch scaled_dot_product_attention", "layernorm: ", "elementwise fusions: "
                  "bias_gelu+bias_dropout_add with torch.compile on CUDA", layers, optimizer):
        assert piece in line, piece
    assert "output layer + loss" not in line  # its own line follows, with the reason
