"""The spawn helper itself: results in rank order, a failing rank, a hang, the launcher environment."""
import multiprocessing as mp
import os
import sys
import time

import pytest
import torch
import torch.distributed as dist

from tests.distributed import DistributedTestError, DistributedTimeoutError, cuda_env, run_distributed


def _sum_ranks(rank, world_size, scale, *, offset):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    env = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MY_FLAG")}
    return rank, dist.get_rank(), dist.get_world_size(), t.item() * scale + offset, env, torch.get_num_threads()


def test_results_in_rank_order_with_env():
    out = run_distributed(_sum_ranks, 3, 2.0, offset=1.0, env={"MY_FLAG": "x"})
    for rank, (r, dist_rank, ws, total, env, threads) in enumerate(out):
        assert (r, dist_rank, ws) == (rank, rank, 3)
        assert total == (0 + 1 + 2) * 2.0 + 1.0
        assert env == {"RANK": str(rank), "WORLD_SIZE": "3", "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": "3", "MY_FLAG": "x"}
        assert threads == 1


def _device_env(rank, world_size):
    return {k: os.environ.get(k) for k in ("DS_ACCELERATOR", "CUDA_VISIBLE_DEVICES")}


def test_children_run_on_the_cpu_unless_given_cuda_env(monkeypatch):
    """The default child sees no GPU; ``cuda_env()`` hands it the parent's (a GPU test measuring
    CUDA memory in a child needs it: without, its statistics calls find no device)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,3")
    assert run_distributed(_device_env, 1) == [{"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}]
    assert run_distributed(_device_env, 1, env=cuda_env()) == [{"DS_ACCELERATOR": "cuda",
                                                                "CUDA_VISIBLE_DEVICES": "1,3"}]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert cuda_env() == {"DS_ACCELERATOR": "cuda", "CUDA_VISIBLE_DEVICES": "0,1"}


def _deepspeed_sees_group(rank, world_size):
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")  # must find the existing group, not re-initialize
    t = torch.ones(1)
    deepspeed.comm.all_reduce(t)
    return t.item()


def test_deepspeed_init_distributed_reuses_group():
    assert run_distributed(_deepspeed_sees_group, 2) == [2.0, 2.0]


_PRELOADED = ("deepspeed", "megatron_ds.families", "megatron_ds.training.trainer")


def _imported(rank, world_size):
    return {m: m in sys.modules for m in _PRELOADED}


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA a child imports DeepSpeed itself, after its "
                    "env picks the accelerator")
def test_children_start_with_deepspeed_imported_where_no_cuda_exists():
    """Without CUDA the forkserver imports DeepSpeed and the training stack once for all children
    (seconds of start-up per child); a preload that stopped importing would only show as a slower
    suite."""
    assert run_distributed(_imported, 1) == [dict.fromkeys(_PRELOADED, True)]


def _fail_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("boom from rank one")
    dist.barrier()  # rank 0 blocks on the dead peer: the helper must not wait for it to time out


def test_exception_on_one_rank_reports_traceback():
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_fail_on_rank_one, 2, timeout=60)
    msg = str(info.value)
    assert "rank 1 failed" in msg
    assert "ValueError: boom from rank one" in msg and "_fail_on_rank_one" in msg
    assert 1 in info.value.failures
    assert time.monotonic() - start < 30  # far below the 60 s timeout: failure is detected at once
    assert not mp.active_children()


def _hang_on_rank_zero(rank, world_size):
    if rank == 0:
        time.sleep(3600)
    return rank


def test_timeout_kills_hung_ranks_and_shows_stack():
    with pytest.raises(DistributedTimeoutError) as info:
        run_distributed(_hang_on_rank_zero, 2, timeout=5)
    msg = str(info.value)
    assert "ranks [0] still running after 5 s" in msg
    assert "_hang_on_rank_zero" in msg  # the stack dump names the function it hung in
    assert not mp.active_children()


def _crash(rank, world_size):
    os._exit(7)


def test_crash_without_exception_is_reported():
    with pytest.raises(DistributedTestError, match="exit code 7"):
        run_distributed(_crash, 1, timeout=60)


def _unpicklable_result(rank, world_size):
    return lambda: None


def test_unpicklable_result_is_an_error():
    with pytest.raises(DistributedTestError, match="pickle"):
        run_distributed(_unpicklable_result, 1, timeout=60)
