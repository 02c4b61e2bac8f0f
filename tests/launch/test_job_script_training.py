"""The ABCI 3.0 job scripts driving the real pretrain_gpt.py: a simulated PBS job on localhost,
Open MPI's mpirun starting 2 ranks that find each other through --use-mpi, 2 pipeline stages, real
preprocessed data, a checkpoint, and the resubmitted job resuming from it (as a job chain does)."""
import filecmp
import re
from pathlib import Path

from tests.launch.helpers import free_port, requires_mpirun
from tests.launch.test_abci_scripts import FakeJob

TINY = dict(TP=1, PP=2, ZERO_STAGE=1, NUM_LAYERS=2, HIDDEN_SIZE=64, NUM_HEADS=4, SEQ_LENGTH=64, MICRO_BATCH=2,
            GLOBAL_BATCH=4, LR="1e-3", SAVE_INTERVAL=3)
# CPU only: gloo instead of the script's nccl; later flags override earlier ones
CPU_ARGS = ["--distributed-backend", "gloo", "--log-interval", "1", "--eval-interval", "100", "--eval-iters", "1",
            "--num-workers", "0", "--split", "95,5,0"]


@requires_mpirun
def test_h200_job_script_trains_and_resumes(tmp_path, e2e_data):
    job = FakeJob(tmp_path, "pbs")
    env = dict(TINY, MEGATRON_DS_ENTRY="", PYTHON="", DATA_PATH=e2e_data["prefix"], VOCAB_FILE=e2e_data["vocab"],
               MERGE_FILE=e2e_data["merges"])
    # a job chain: the first job stops early (as at its walltime), the resubmitted one finishes
    first = job.run("abci3_h200_gpt_1.3b.sh", *CPU_ARGS, "--exit-interval", "3", TRAIN_ITERS=5, timeout=600, **env)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    log = first.stdout
    assert "world size 2 = TP 1 x PP 2 x DP 1 (pipeline engine, ZeRO 1, bf16)" in log
    assert [int(i) for i in re.findall(r"^ iteration\s+(\d+)/\s+5 \|", log, re.M)] == [1, 2, 3]
    assert "validation loss" not in log  # an early exit leaves right after its save
    ckpt = job.work / "checkpoints" / "gpt_1.3b"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "3"

    second = job.run("abci3_h200_gpt_1.3b.sh", *CPU_ARGS, TRAIN_ITERS=5, timeout=600, **env)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "(iteration 3)" in second.stdout
    assert [int(i) for i in re.findall(r"^ iteration\s+(\d+)/\s+5 \|", second.stdout, re.M)] == [4, 5]


FAKE_SSH = """#!/bin/sh
# Open MPI's rsh launcher calls `AGENT [options] HOST COMMAND...`: note the host, run it here.
while [ $# -gt 0 ]; do case "$1" in -*) shift ;; *) break ;; esac; done
echo "$1" >> "{log}"
shift
exec /bin/sh -c "$*"
"""


@requires_mpirun
def test_multi_node_job_script_trains_on_two_nodes(tmp_path, e2e_data):
    """The 2-node Llama script as a 2-node PBS job: two host names in $PBS_NODEFILE, mpirun starting
    one rank per "node" through its ssh launcher (a stand-in that runs the command on this machine,
    so each rank really is on another Open MPI node: its own daemon, local rank 0), data parallel
    across the nodes."""
    job = FakeJob(tmp_path, "pbs", hosts=("hnode001", "hnode002"))
    ssh_log = tmp_path / "ssh.hosts"
    agent = tmp_path / "bin" / "fake_ssh"
    agent.write_text(FAKE_SSH.replace("{log}", str(ssh_log)))
    agent.chmod(0o755)
    env = dict(TINY, TP=1, PP=1, NUM_KV_HEADS=2, FFN_HIDDEN_SIZE=128, GLOBAL_BATCH=4, MEGATRON_DS_ENTRY="",
               PYTHON="", GPUS_PER_NODE=1, DATA_PATH=e2e_data["prefix"], VOCAB_FILE=e2e_data["vocab"],
               MERGE_FILE=e2e_data["merges"],
               # the simulated host names don't resolve: rank 0's address is this machine's
               MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port(),  # not the job id's port: other
               # test runs on this machine may hold it
               # rtc_hwloc_vmhole=none: each Open MPI 4.1 daemon maps its hardware topology into
               # shared memory at a hole of its address space (orte/mca/rtc/hwloc); with both
               # simulated "nodes" on one machine a daemon now and then segfaulted there
               # (hwloc_shmem_topology_write), which killed the job. "none" skips that sharing (an
               # optimisation: each process reads the topology itself); real nodes run one daemon each
               MPIRUN_EXTRA_ARGS=f"--mca plm_rsh_agent {agent} --mca rtc_hwloc_vmhole none",
               STAGE_DATA=1)  # each node copies the data to its $PBS_LOCALDIR first (through mpirun)
    result = job.run("abci3_h200_llama_7b.sh", *CPU_ARGS, "--eval-iters", "0", TRAIN_ITERS=3, timeout=600, **env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (job.local / "hostfile").read_text() == "hnode001 slots=1\nhnode002 slots=1\n"
    assert sorted(set(ssh_log.read_text().split())) == ["hnode001", "hnode002"]  # one daemon per node
    log = result.stdout
    assert "world size 2 = TP 1 x PP 1 x DP 2 (pipeline engine, ZeRO 1, bf16)" in log
    assert [int(i) for i in re.findall(r"^ iteration\s+(\d+)/\s+3 \|", log, re.M)] == [1, 2, 3]
    assert (job.work / "checkpoints" / "llama_7b" / "latest_checkpointed_iteration.txt").read_text() == "3"
    # the staged copies (the simulated nodes share one $PBS_LOCALDIR) are the shared files
    staged = job.local / "data" / ("1_" + Path(e2e_data["prefix"]).name)
    for suffix in (".bin", ".idx"):
        assert filecmp.cmp(f"{staged}{suffix}", e2e_data["prefix"] + suffix, shallow=False)
    assert not list((job.local / "data").glob("*.part*"))
    assert (job.work / "runs" / "llama_7b" / "index-cache").is_dir()  # the shared index cache
