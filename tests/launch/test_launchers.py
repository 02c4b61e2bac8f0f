"""Real launchers start probe_ranks.py: every process must find its own rank and join one world.

The probe all-reduces its rank over gloo; a sum of 0 + 1 = 1 proves two distinct ranks met in one
process group (two "rank 0 of 1" processes would each report 0).
"""
import base64
import json

import pytest

from tests.launch.helpers import (PROBE, PYTHON, clean_env, free_port, read_probes,
                                  requires_mpirun, run_bounded)


def check_two_ranks(reports, launcher, port=None):
    assert [r["rank"] for r in reports] == [0, 1], reports
    for report in reports:
        assert report["world_size"] == 2
        assert report["local_world_size"] == 2
        assert report["rank_sum"] == 1
        assert report["launcher"] == launcher
        if port is not None:
            assert report["master_port"] == port
    assert sorted(r["local_rank"] for r in reports) == [0, 1]


def test_plain_python_is_a_single_process(tmp_path):
    result = run_bounded([PYTHON, PROBE, "--foo"], clean_env(PROBE_OUT_DIR=tmp_path), timeout=60)
    assert result.returncode == 0, result.stderr
    [report] = read_probes(tmp_path)
    assert report == {"rank": 0, "world_size": 1, "local_rank": 0, "local_world_size": 1,
                      "master_addr": "127.0.0.1", "master_port": 29500, "launcher": "single",
                      "rank_sum": 0, "argv": ["--foo"]}


def test_torchrun(tmp_path):
    # --standalone picks a free port itself: other test sessions may be running on this host.
    cmd = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           PROBE, "--bar"]
    result = run_bounded(cmd, clean_env(PROBE_OUT_DIR=tmp_path))
    assert result.returncode == 0, result.stderr
    check_two_ranks(read_probes(tmp_path), "torchrun")


def test_deepspeed_launcher(tmp_path):
    # The per-node launcher the `deepspeed` command runs; it passes --local_rank=N to the script.
    world_info = base64.urlsafe_b64encode(json.dumps({"localhost": [0, 1]}).encode()).decode()
    port = free_port()
    cmd = [PYTHON, "-m", "deepspeed.launcher.launch", f"--world_info={world_info}",
           "--master_addr", "127.0.0.1", "--master_port", port, PROBE, "--baz"]
    result = run_bounded(cmd, clean_env(PROBE_OUT_DIR=tmp_path))
    assert result.returncode == 0, result.stderr
    reports = read_probes(tmp_path)
    check_two_ranks(reports, "deepspeed", port)
    assert [r["argv"][0] for r in reports] == ["--local_rank=0", "--local_rank=1"]


@requires_mpirun
@pytest.mark.parametrize("use_mpi", [True, False])
def test_mpirun(tmp_path, use_mpi):
    port = free_port()
    cmd = ["mpirun", "-np", "2", "--oversubscribe", "-bind-to", "none", PYTHON, PROBE]
    cmd += ["--use-mpi"] if use_mpi else []
    result = run_bounded(cmd, clean_env(PROBE_OUT_DIR=tmp_path, MASTER_PORT=port))
    assert result.returncode == 0, result.stderr
    check_two_ranks(read_probes(tmp_path), "openmpi", port)
    # Without --use-mpi the ranks are still right, and rank 0 says where they came from.
    assert ("without --use-mpi" in result.stderr) == (not use_mpi)


def test_a_misspelt_flag_under_torchrun_names_the_flag_meant(tmp_path):
    """The real entry point with a typo under torchrun (and --dry-run): each rank refuses it in one line
    naming the flag meant, exit status 2; torchrun then reports its children's failure its own way."""
    from tests.launch.helpers import REPO

    cmd = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           REPO / "pretrain_gpt.py", "--dry-run", "--num-layers", "2", "--hidden_size", "32"]
    result = run_bounded(cmd, clean_env(), cwd=tmp_path)
    assert result.returncode != 0
    line = "pretrain_gpt.py: error: unrecognized arguments: --hidden_size 32 (did you mean --hidden-size?)"
    assert result.stderr.splitlines().count(line) == 2, result.stderr[-3000:]
    assert "exitcode  : 2" in result.stderr  # torchrun's report of the rank that failed first
