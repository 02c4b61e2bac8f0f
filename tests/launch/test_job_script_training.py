"""The ABCI 3.0 job script driving the real pretrain_gpt.py: a simulated PBS job on localhost,
Open MPI's mpirun starting 2 ranks that find each other through --use-mpi, 2 pipeline stages, real
preprocessed data, a checkpoint, and the resubmitted job resuming from it (as a job chain does)."""
import re

from tests.launch.helpers import requires_mpirun
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
    first = job.run("abci3_h200_gpt_1.3b.sh", *CPU_ARGS, "--exit-interval", "3", TRAIN_ITERS=5, **env)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    log = first.stdout
    assert "world size 2 = TP 1 x PP 2 x DP 1 (pipeline engine, ZeRO 1, bf16)" in log
    assert [int(i) for i in re.findall(r"^ iteration\s+(\d+)/\s+5 \|", log, re.M)] == [1, 2, 3]
    assert "validation loss" not in log  # an early exit leaves right after its save
    ckpt = job.work / "checkpoints" / "gpt_1.3b"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "3"

    second = job.run("abci3_h200_gpt_1.3b.sh", *CPU_ARGS, TRAIN_ITERS=5, **env)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "(iteration 3)" in second.stdout
    assert [int(i) for i in re.findall(r"^ iteration\s+(\d+)/\s+5 \|", second.stdout, re.M)] == [4, 5]
