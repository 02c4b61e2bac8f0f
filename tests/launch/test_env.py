"""discover_dist_env / apply_dist_env with fake environments: every source, every error.

Expected values are written out from the launchers' documented variables and the port rule
(MASTER_PORT = 10000 + JOB_ID % 50000), not taken from the code under test.
"""
import logging
import os
import types

import pytest

from megatron_ds.launch import DistEnv, apply_dist_env, discover_dist_env

OMPI_RANK1_OF_4 = {  # what Open MPI's mpirun gives rank 1 of 2 nodes x 2 slots
    "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
}


def frozen(mapping):
    """A read-only environment: discovery must not write to what it reads."""
    return types.MappingProxyType(dict(mapping))


def hostfile(tmp_path, name, lines):
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


# --------------------------------------------------------------------------- single process

def test_single_process_defaults():
    expected = DistEnv(0, 1, 0, 1, "127.0.0.1", 29500, "single")
    assert discover_dist_env(environ=frozen({})) == expected


def test_single_process_honours_master_and_job_port():
    env = discover_dist_env(environ=frozen({"JOB_ID": "12345"}))
    assert (env.master_addr, env.master_port) == ("127.0.0.1", 22345)
    env = discover_dist_env(environ=frozen({"MASTER_ADDR": "node7", "MASTER_PORT": "2222"}))
    assert (env.master_addr, env.master_port) == ("node7", 2222)


def test_single_process_world_size_one_alone_is_fine():
    assert discover_dist_env(environ=frozen({"WORLD_SIZE": "1"})).launcher == "single"


def test_single_process_accepts_local_rank_zero_only():
    assert discover_dist_env(environ=frozen({}), local_rank_arg=0).local_rank == 0
    with pytest.raises(ValueError, match="--local_rank 3 disagrees.*single process"):
        discover_dist_env(environ=frozen({}), local_rank_arg=3)


def test_reads_os_environ_by_default(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_RANK",
                 "PMI_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setenv("MASTER_ADDR", "h")
    monkeypatch.setenv("MASTER_PORT", "1234")
    env = discover_dist_env()
    assert (env.rank, env.world_size, env.local_rank) == (2, 3, 2)


# --------------------------------------------------------------------------- torchrun / deepspeed

def test_torchrun():
    env = discover_dist_env(environ=frozen({
        "TORCHELASTIC_RUN_ID": "abc", "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "node0", "MASTER_PORT": "29400"}))
    assert env == DistEnv(3, 4, 1, 2, "node0", 29400, "torchrun")


def test_deepspeed_launcher_env_and_local_rank_argument():
    base = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_SIZE": "4", "CROSS_RANK": "1",
            "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}
    env = discover_dist_env(environ=frozen(base), local_rank_arg=1)
    assert env == DistEnv(5, 8, 1, 4, "node0", 29500, "deepspeed")
    # --no_local_rank style: only the argument carries it
    no_env = {k: v for k, v in base.items() if k not in ("LOCAL_RANK", "CROSS_RANK")}
    env = discover_dist_env(environ=frozen(no_env), local_rank_arg=1)
    assert (env.local_rank, env.launcher) == (1, "deepspeed")


def test_local_rank_argument_must_agree_with_environment():
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}
    with pytest.raises(ValueError, match="--local_rank 0 disagrees with LOCAL_RANK=1"):
        discover_dist_env(environ=frozen(env), local_rank_arg=0)


def test_hand_made_env_without_local_rank():
    with pytest.raises(ValueError, match="LOCAL_RANK is not"):
        discover_dist_env(environ=frozen({"RANK": "1", "WORLD_SIZE": "2"}))
    env = discover_dist_env(environ=frozen({"RANK": "0", "WORLD_SIZE": "1"}))
    assert (env.rank, env.world_size, env.local_rank, env.launcher) == (0, 1, 0, "torchrun")


def test_rank_without_world_size_and_vice_versa():
    with pytest.raises(ValueError, match="RANK=1 is set but WORLD_SIZE is not"):
        discover_dist_env(environ=frozen({"RANK": "1", "LOCAL_RANK": "1"}))
    with pytest.raises(ValueError, match="WORLD_SIZE=4 is set but RANK is not"):
        discover_dist_env(environ=frozen({"WORLD_SIZE": "4"}))


def test_torchrun_under_mpirun_keeps_torchrun_ranks():
    # mpirun starting one torchrun per node: the OMPI ranks count agents, not workers.
    env = dict(OMPI_RANK1_OF_4, TORCHELASTIC_RUN_ID="x", RANK="9", WORLD_SIZE="16",
               LOCAL_RANK="1", LOCAL_WORLD_SIZE="8", MASTER_ADDR="n0", MASTER_PORT="1")
    assert discover_dist_env(environ=frozen(env)) == DistEnv(9, 16, 1, 8, "n0", 1, "torchrun")


# --------------------------------------------------------------------------- Open MPI

def test_openmpi_with_use_mpi():
    env = discover_dist_env(use_mpi=True, environ=frozen(dict(OMPI_RANK1_OF_4, MASTER_ADDR="g1")))
    assert env == DistEnv(1, 4, 1, 2, "g1", 29500, "openmpi")


def test_openmpi_autodetected_every_rank_distinct(caplog):
    """The classic bug: without mapping OMPI_* every process would think it is rank 0."""
    seen = []
    with caplog.at_level(logging.WARNING, logger="megatron_ds.launch.env"):
        for rank in range(4):
            env = {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": "4",
                   "OMPI_COMM_WORLD_LOCAL_RANK": str(rank % 2), "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
                   "MASTER_ADDR": "g1"}
            seen.append(discover_dist_env(environ=frozen(env)))
    assert [e.rank for e in seen] == [0, 1, 2, 3]
    assert {e.world_size for e in seen} == {4} and {e.launcher for e in seen} == {"openmpi"}
    # one line, from rank 0 only, saying where the ranks came from
    notes = [r for r in caplog.records if "without --use-mpi" in r.getMessage()]
    assert len(notes) == 1


def test_openmpi_with_use_mpi_does_not_log(caplog):
    env = dict(OMPI_RANK1_OF_4, OMPI_COMM_WORLD_RANK="0", MASTER_ADDR="g1")
    with caplog.at_level(logging.WARNING, logger="megatron_ds.launch.env"):
        discover_dist_env(use_mpi=True, environ=frozen(env))
    assert not caplog.records


def test_use_mpi_without_mpi_variables():
    with pytest.raises(ValueError, match="--use-mpi was given but neither OMPI_COMM_WORLD_RANK"):
        discover_dist_env(use_mpi=True, environ=frozen({"RANK": "0", "WORLD_SIZE": "1"}))


def test_openmpi_incomplete():
    env = {k: v for k, v in OMPI_RANK1_OF_4.items() if k != "OMPI_COMM_WORLD_LOCAL_SIZE"}
    with pytest.raises(ValueError, match="missing OMPI_COMM_WORLD_LOCAL_SIZE"):
        discover_dist_env(use_mpi=True, environ=frozen(env))


def test_openmpi_disagreeing_with_exported_rank_or_world_size():
    # A RANK/WORLD_SIZE exported by the job script reaches every process with the same value.
    with pytest.raises(ValueError, match="RANK=0 in the environment disagrees with openmpi"):
        discover_dist_env(use_mpi=True, environ=frozen(dict(OMPI_RANK1_OF_4, RANK="0",
                                                            MASTER_ADDR="g1")))
    with pytest.raises(ValueError, match="WORLD_SIZE=8 in the environment disagrees"):
        discover_dist_env(environ=frozen(dict(OMPI_RANK1_OF_4, WORLD_SIZE="8", MASTER_ADDR="g1")))
    agreeing = dict(OMPI_RANK1_OF_4, RANK="1", WORLD_SIZE="4", MASTER_ADDR="g1")
    assert discover_dist_env(use_mpi=True, environ=frozen(agreeing)).rank == 1


def test_openmpi_local_rank_argument_must_agree():
    with pytest.raises(ValueError, match="--local_rank 0 disagrees with local rank 1 of openmpi"):
        discover_dist_env(use_mpi=True, environ=frozen(dict(OMPI_RANK1_OF_4, MASTER_ADDR="g")),
                          local_rank_arg=0)


# --------------------------------------------------------------------------- PMI family

@pytest.mark.parametrize("local_vars", [
    {"MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "4"},                       # Hydra / Intel MPI
    {"MV2_COMM_WORLD_LOCAL_RANK": "0", "MV2_COMM_WORLD_LOCAL_SIZE": "4"},   # MVAPICH2
    {"PALS_LOCAL_RANKID": "0", "PALS_LOCAL_SIZE": "4"},                     # Cray PALS
])
def test_pmi(local_vars):
    env = dict(local_vars, PMI_RANK="4", PMI_SIZE="8", MASTER_ADDR="n0")
    assert discover_dist_env(use_mpi=True, environ=frozen(env)) == \
        DistEnv(4, 8, 0, 4, "n0", 29500, "pmi")
    assert discover_dist_env(environ=frozen(env)).launcher == "pmi"  # auto-detected too


def test_pmi_errors():
    with pytest.raises(ValueError, match="PMI_SIZE is not"):
        discover_dist_env(use_mpi=True, environ=frozen({"PMI_RANK": "0"}))
    with pytest.raises(ValueError, match="node-local rank/size are not"):
        discover_dist_env(use_mpi=True, environ=frozen({"PMI_RANK": "1", "PMI_SIZE": "2"}))
    env = discover_dist_env(use_mpi=True, environ=frozen({"PMI_RANK": "0", "PMI_SIZE": "1"}))
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (0, 1, 0, 1)


# --------------------------------------------------------------------------- master address / port

def test_master_addr_from_sge_host_list(tmp_path):
    hosts = hostfile(tmp_path, "sge_hosts", ["g0012.abci.local", "g0013.abci.local"])
    env = discover_dist_env(use_mpi=True, environ=frozen(dict(
        OMPI_RANK1_OF_4, SGE_JOB_HOSTLIST=hosts, JOB_ID="12345")))
    assert (env.master_addr, env.master_port) == ("g0012.abci.local", 22345)


def test_master_addr_from_pbs_nodefile(tmp_path):
    nodes = hostfile(tmp_path, "pbs_nodes", ["hnode001", "hnode001", "hnode002", "hnode002"])
    env = discover_dist_env(use_mpi=True, environ=frozen(dict(
        OMPI_RANK1_OF_4, PBS_NODEFILE=nodes, PBS_JOBID="12345.pbs1")))
    assert (env.master_addr, env.master_port) == ("hnode001", 22345)


def test_sge_host_list_wins_over_pbs_and_master_addr_over_both(tmp_path):
    sge = hostfile(tmp_path, "sge", ["sgehost"])
    pbs = hostfile(tmp_path, "pbs", ["pbshost"])
    both = dict(OMPI_RANK1_OF_4, SGE_JOB_HOSTLIST=sge, PBS_NODEFILE=pbs)
    assert discover_dist_env(environ=frozen(both)).master_addr == "sgehost"
    assert discover_dist_env(environ=frozen(dict(both, MASTER_ADDR="m"))).master_addr == "m"


def test_unreadable_or_empty_host_list(tmp_path):
    with pytest.raises(ValueError, match="SGE_JOB_HOSTLIST=.*cannot be read"):
        discover_dist_env(environ=frozen(dict(OMPI_RANK1_OF_4,
                                              SGE_JOB_HOSTLIST=str(tmp_path / "nope"))))
    empty = hostfile(tmp_path, "empty", [])
    with pytest.raises(ValueError, match="PBS_NODEFILE=.*lists no hosts"):
        discover_dist_env(environ=frozen(dict(OMPI_RANK1_OF_4, PBS_NODEFILE=empty)))


def test_multi_host_world_without_master_is_an_error():
    # 4 ranks, 2 per host: 127.0.0.1 would make each node wait for itself forever.
    with pytest.raises(ValueError, match="spans several hosts but MASTER_ADDR is unset"):
        discover_dist_env(use_mpi=True, environ=frozen(OMPI_RANK1_OF_4))
    one_host = dict(OMPI_RANK1_OF_4, OMPI_COMM_WORLD_LOCAL_SIZE="4")
    assert discover_dist_env(use_mpi=True, environ=frozen(one_host)).master_addr == "127.0.0.1"


@pytest.mark.parametrize("job_env, port", [
    ({"JOB_ID": "12345"}, 22345),
    ({"JOB_ID": "60001"}, 20001),               # 10000 + 60001 % 50000
    ({"JOB_ID": "50000"}, 10000),
    ({"PBS_JOBID": "12345.pbs1"}, 22345),       # suffix stripped
    ({"PBS_JOBID": "777[3].pbs1"}, 10777),      # array job: the parent id
    ({"JOB_ID": "12345", "MASTER_PORT": "4000"}, 4000),
    ({"PBS_JOBID": "not-a-number"}, 29500),
])
def test_master_port(job_env, port):
    env = dict(OMPI_RANK1_OF_4, OMPI_COMM_WORLD_LOCAL_SIZE="4", **job_env)
    assert discover_dist_env(use_mpi=True, environ=frozen(env)).master_port == port


@pytest.mark.parametrize("value, message", [("abc", "MASTER_PORT='abc' is not an integer"),
                                            ("70000", "MASTER_PORT=70000 is not a TCP port")])
def test_bad_master_port(value, message):
    with pytest.raises(ValueError, match=message):
        discover_dist_env(environ=frozen({"MASTER_PORT": value}))


# --------------------------------------------------------------------------- inconsistent values

@pytest.mark.parametrize("env, message", [
    ({"RANK": "4", "WORLD_SIZE": "4", "LOCAL_RANK": "0"}, "rank 4 is outside world size 4"),
    ({"RANK": "-1", "WORLD_SIZE": "4", "LOCAL_RANK": "0"}, "rank -1 is outside world size 4"),
    ({"RANK": "0", "WORLD_SIZE": "0", "LOCAL_RANK": "0"}, "world size 0"),
    ({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"},
     "local rank 2 is outside local world size 2"),
    ({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "8"},
     "local world size 8 must be between 1 and the world size 4"),
    ({"RANK": "one", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}, "RANK='one' is not an integer"),
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, r"rank 2 is outside world size 2 \(from openmpi\)"),
])
def test_inconsistent_values(env, message):
    with pytest.raises(ValueError, match=message):
        discover_dist_env(environ=frozen(env))


# --------------------------------------------------------------------------- apply_dist_env

def test_apply_dist_env_round_trip():
    original = DistEnv(3, 8, 1, 4, "g0001", 22345, "openmpi")
    target = {"UNRELATED": "x"}
    apply_dist_env(original, target)
    assert target == {"UNRELATED": "x", "RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                      "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "g0001", "MASTER_PORT": "22345"}
    # What a torch env:// consumer (or a second discovery) reads back is the same world.
    again = discover_dist_env(environ=frozen(target))
    assert again == DistEnv(3, 8, 1, 4, "g0001", 22345, "torchrun")


def test_apply_then_discover_under_mpi_with_use_mpi_is_consistent():
    # pretrain_gpt.py may discover twice (e.g. DeepSpeed's init after ours): still one world.
    mpi_env = dict(OMPI_RANK1_OF_4, MASTER_ADDR="g1")
    first = discover_dist_env(use_mpi=True, environ=frozen(mpi_env))
    apply_dist_env(first, mpi_env)
    assert discover_dist_env(use_mpi=True, environ=frozen(mpi_env)) == first


def test_apply_dist_env_defaults_to_os_environ(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT"):
        monkeypatch.setenv(name, "stale")  # recorded, so the test leaves os.environ as it was
    apply_dist_env(DistEnv(0, 1, 0, 1, "127.0.0.1", 29555, "single"))
    assert (os.environ["RANK"], os.environ["MASTER_PORT"]) == ("0", "29555")
