"""Helpers for the launcher tests: a clean environment, bounded subprocesses, probe reports."""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROBE = Path(__file__).with_name("probe_ranks.py")

# Anything a launcher or scheduler sets: inherited values would make the tests depend on where they
# run (e.g. inside a real qrsh session, or under a test runner started by torchrun).
_LAUNCH_VARS = re.compile(
    r"^(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|LOCAL_SIZE|CROSS_RANK|CROSS_SIZE|MASTER_ADDR|"
    r"MASTER_PORT|GROUP_RANK|ROLE_RANK|TORCHELASTIC_.*|OMPI_.*|PMI_.*|PMIX_.*|MPI_LOCAL.*|MV2_.*|"
    r"PALS_.*|SGE_.*|JOB_ID|NHOSTS|PE_HOSTFILE|PBS_.*|NUM_NODES|DRY_RUN|GPUS_PER_NODE|PYTHON|"
    r"MEGATRON_DS_.*|MPIRUN.*|TP|PP|ZERO_STAGE|DS_CONFIG|DATA_.*|VOCAB_FILE|MERGE_FILE|"
    r"TOKENIZER_.*|CHECKPOINT_DIR|RUN_DIR|RUN_NAME|LOG_DIR|WORK_DIR|TENSORBOARD_DIR|"
    r".*_MODULE|PROBE_OUT_DIR|RESOURCE_TYPE|GPU_MEMORY_GB|STAGE_DATA|UCX_.*|NCCL_.*|"
    r"CUDA_DEVICE_MAX_CONNECTIONS|TORCH_NCCL_.*|VENV_DIR|SETUP_.*|BUILD_APEX|TORCH_(?!EXTENSIONS_DIR$).*)$")
# Kept: TORCH_EXTENSIONS_DIR, where the session's C++ ops (DeepSpeed's cpu_adam, the fake-CUDA shim)
# are already built (the Makefile sets it). Without it a launched process that needs one builds it
# again in ~/.cache/torch_extensions (~45 s on two cores), and again whenever a checkout with
# another venv used that cache in between.


def clean_env(**overrides):
    env = {k: v for k, v in os.environ.items() if not _LAUNCH_VARS.match(k)}
    # Open MPI refuses to start as root unless told twice; CI runs as root.
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMP_NUM_THREADS="1")
    env.update({k: str(v) for k, v in overrides.items()})
    return env


def run_bounded(cmd, env, cwd=None, timeout=120):
    """Run a launcher; on timeout kill its whole process group (mpirun/torchrun children too)."""
    proc = subprocess.Popen([str(c) for c in cmd], env=env, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        command = " ".join(map(str, cmd))
        pytest.fail(f"{command} hung for {timeout}s\nstdout:\n{out}\nstderr:\n{err}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def read_probes(directory):
    """The probe's per-rank reports, in rank order."""
    reports = [json.loads(p.read_text()) for p in sorted(Path(directory).glob("rank*.json"))]
    return sorted(reports, key=lambda r: r["rank"])


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _have_open_mpi():
    if shutil.which("mpirun") is None:
        return False
    try:
        out = subprocess.run(["mpirun", "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "Open MPI" in out.stdout + out.stderr  # MPICH's mpirun takes other flags


requires_mpirun = pytest.mark.skipif(
    not _have_open_mpi(),
    reason="Open MPI's mpirun is not installed (apt-get install openmpi-bin; .ci/run does this)")

PYTHON = sys.executable
