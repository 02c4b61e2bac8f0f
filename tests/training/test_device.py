"""Device placement: a rank without a GPU of its own stops with one line saying what to fix, and
DS_ACCELERATOR=cpu trains on the CPU on a machine with GPUs. The GPUs are simulated here (torch's
device queries patched); the real ones are exercised by tests/gpu."""
import contextlib
import io

import pytest
import torch

from megatron_ds.errors import ConfigError
from megatron_ds.families.gpt.gpt_family import GPT
from megatron_ds.training import device as dev
from tests.distributed import run_distributed
from tests.training.common import TINY_GPT


@pytest.fixture
def one_gpu(monkeypatch):
    """A machine with one visible GPU; records what would be made current."""
    calls = {"set_device": [], "accelerator": []}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: calls["set_device"].append(i))
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(dev, "_match_deepspeed_accelerator", lambda kind: calls["accelerator"].append(kind))
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    return calls


def test_rank_without_gpu_stops_with_one_line(one_gpu):
    with pytest.raises(ConfigError) as err:
        dev.select_device(1, 2)
    message = str(err.value)
    assert "\n" not in message
    for part in ("LOCAL_RANK 1", "1 CUDA device(s) visible for 2 processes", "CUDA_VISIBLE_DEVICES='0'",
                 "-npernode", "--nproc_per_node", "GPUS_PER_NODE", "DS_ACCELERATOR=cpu"):
        assert part in message, (part, message)
    assert one_gpu["set_device"] == []  # no modulo placement onto GPU 0


def test_message_says_when_cuda_visible_devices_is_unset(one_gpu, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with pytest.raises(ConfigError, match=r"LOCAL_RANK 3 has no GPU: 1 CUDA device\(s\) visible "
                                          r"\(CUDA_VISIBLE_DEVICES=unset\)"):
        dev.select_device(3)


def test_each_rank_gets_its_own_gpu(one_gpu):
    assert dev.select_device(0, 1) == torch.device("cuda", 0)
    assert one_gpu == {"set_device": [0], "accelerator": ["cuda"]}


def test_ds_accelerator_cpu_forces_the_cpu(one_gpu, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert dev.select_device(5, 8) == torch.device("cpu")  # no GPU check at all on the CPU
    assert one_gpu == {"set_device": [], "accelerator": ["cpu"]}
    assert not dev.pin_memory() and dev.device_type() == "cpu"
    monkeypatch.delenv("DS_ACCELERATOR")
    assert dev.pin_memory() and dev.device_type() == "cuda"


def test_cli_prints_the_error_and_exits_1(one_gpu, monkeypatch):
    """Through pretrain_gpt.py's main, as torchrun would start the second process of two."""
    from megatron_ds.families import main

    for key, value in dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2",
                           MASTER_ADDR="127.0.0.1", MASTER_PORT="29999").items():
        monkeypatch.setenv(key, value)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(TINY_GPT + ["--train-iters", "1"])
    assert rc == 1
    lines = err.getvalue().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: LOCAL_RANK 1 has no GPU"), err.getvalue()
    assert not torch.distributed.is_initialized()


def _train_with_a_visible_gpu(rank, world_size, argv):
    """In a spawned rank: CUDA looks available (as on a GPU node), DS_ACCELERATOR=cpu is set by the
    spawn helper; training must run on the CPU with gloo and never touch CUDA."""
    import torch as t

    from tests.training.common import train_losses

    t.cuda.is_available = lambda: True
    t.cuda.device_count = lambda: 1

    def no_cuda(name):
        def fail(*args, **kwargs):
            raise AssertionError(f"torch.cuda.{name} was called in a DS_ACCELERATOR=cpu run")
        return fail

    for name in ("set_device", "current_device", "init"):  # one function each: dynamo wants that
        setattr(t.cuda, name, no_cuda(name))
    history = train_losses(rank, world_size, argv)
    from deepspeed.accelerator import get_accelerator

    return history, get_accelerator().device_name()


def test_cpu_training_on_a_gpu_machine():
    """Two ranks on a 'one-GPU' machine: without DS_ACCELERATOR=cpu rank 1 would stop (above);
    with it both train on the CPU (the multi-process tests rely on this on GPU machines)."""
    argv = TINY_GPT + ["--num-layers", "2", "--train-iters", "2", "--global-batch-size", "4"]
    results = run_distributed(_train_with_a_visible_gpu, 2, argv, timeout=300)
    for history, accelerator in results:
        assert accelerator == "cpu"
        assert [it for it, _ in history] == [1, 2]
    assert results[0][0] == results[1][0]  # data parallel ranks report the same mean loss


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_model_built_in_place_equals_built_then_cast(dtype):
    """Training builds the model directly in its compute precision on its device (no full fp32
    copy first): the weights are exactly those of the fp32 build cast afterwards."""
    from megatron_ds.config import parse_args, resolve
    from megatron_ds.families.gpt.gpt_model import build_sequential_gpt
    from tests.training.common import LLAMA_FLAGS

    cfg, _ = parse_args(TINY_GPT + LLAMA_FLAGS + ["--train-iters", "1"])
    layout = resolve(cfg, world_size=1, vocab_size=512, device_type="cpu", family=GPT).layout
    direct = build_sequential_gpt(layout.model, padded_vocab_size=layout.padded_vocab_size, seed=5,
                                  params_dtype=dtype, device="cpu").state_dict()
    cast = build_sequential_gpt(layout.model, padded_vocab_size=layout.padded_vocab_size, seed=5).to(dtype)
    cast = cast.state_dict()
    assert direct.keys() == cast.keys()
    for key in direct:
        assert direct[key].dtype == dtype and torch.equal(direct[key], cast[key]), key
