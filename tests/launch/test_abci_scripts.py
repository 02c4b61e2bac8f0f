"""The real scripts/abci job scripts, run with bash in a simulated Grid Engine / PBS job.

The scheduler is faked by its environment (host list file, job id, node-local dir), `module` by a
command that records its arguments, and the training entry point by probe_ranks.py, started by a
real Open MPI mpirun on localhost with GPUS_PER_NODE=2. Expected values come from the ABCI facts
(port = 10000 + JOB_ID % 50000, hostfile "host slots=N") and from the scripts' own headers.
"""
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.launch.helpers import (PROBE, PYTHON, REPO, clean_env, free_port, read_probes, requires_mpirun,
                                  run_bounded)

ABCI = REPO / "scripts" / "abci"
JOB_SCRIPTS = sorted(p.name for p in ABCI.glob("abci*.sh"))

def _job_id_for_a_free_port() -> int:
    """A job id whose derived port is free now, so two suites on one host (or a port left in
    TIME_WAIT by an earlier test) do not collide as a fixed id's port would."""
    port = free_port()
    return port - 10000 if 10000 <= port < 60000 else 12345


JOB_ID = _job_id_for_a_free_port()
EXPECTED_PORT = 10000 + JOB_ID % 50000

# Flags each script must pass beyond the common ones (the layouts named in its header).
SPECIFIC = {
    "abci2_v100_gpt_345m.sh": {"--fp16": None, "--num-layers": "24", "--hidden-size": "1024"},
    "abci2_v100_gpt_13b.sh": {"--fp16": None, "--checkpoint-activations": None,
                              "--tensor-model-parallel-size": "4",
                              "--pipeline-model-parallel-size": "8", "--micro-batch-size": "1",
                              "--num-layers": "40", "--hidden-size": "5120"},
    "abci2_a100_gpt_1.3b.sh": {"--bf16": None, "--num-layers": "24", "--hidden-size": "2048"},
    "abci3_h200_gpt_1.3b.sh": {"--bf16": None, "--num-layers": "24", "--hidden-size": "2048"},
    "abci3_h200_llama_7b.sh": {"--bf16": None, "--use-rotary-position-embeddings": None,
                               "--swiglu": None, "--normalization": "rmsnorm",
                               "--num-key-value-heads": "8", "--disable-bias-linear": None,
                               "--untie-embeddings-and-output-weights": None,
                               "--ffn-hidden-size": "11008", "--num-layers": "32",
                               "--hidden-size": "4096"},
    "abci3_h200_llama3.1_8b_cpt.sh": {"--bf16": None, "--pretrained-checkpoint": None, "--use-rope-scaling": None,
                                      "--rope-scaling-factor": "8", "--rotary-base": "500000",
                                      "--num-query-groups": "8", "--ffn-hidden-size": "14336",
                                      "--max-position-embeddings": "131072", "--seq-length": "8192",
                                      "--tokenizer-type": "HuggingFaceTokenizer", "--zero-stage": "2",
                                      "--no-pipeline-parallel": None, "--micro-batch-size": "2"},
    "abci3_h200_t5_220m.sh": {"--bf16": None, "--num-layers": "12", "--decoder-num-layers": "12",
                              "--seq-length": "512", "--decoder-seq-length": "128", "--vocab-extra-ids": "100",
                              "--tokenizer-type": "BertWordPieceLowerCase"},
    "abci3_h200_bert_345m.sh": {"--bf16": None, "--num-layers": "24", "--hidden-size": "1024",
                                "--seq-length": "512", "--tokenizer-type": "BertWordPieceLowerCase"},
}
COMMON = ["--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--num-layers",
          "--hidden-size", "--num-attention-heads", "--seq-length", "--max-position-embeddings",
          "--micro-batch-size", "--global-batch-size", "--train-iters", "--lr", "--min-lr",
          "--data-path", "--tokenizer-type", "--vocab-file", "--merge-file", "--save", "--load",
          "--save-interval", "--tensorboard-dir", "--exit-duration-in-mins", "--deepspeed",
          "--deepspeed_config", "--zero-stage", "--split", "--seed"]


def module_defaults(system):
    """The module names common.sh declares for ABCI2/ABCI3, in load order."""
    text = (ABCI / "common.sh").read_text()
    return [re.search(rf'"\${{{system}_{kind}_MODULE=([^}}]*)}}"', text).group(1)
            for kind in ("CUDA", "CUDNN", "NCCL", "HPCX")]


def walltime_minutes(script):
    text = (ABCI / script).read_text()
    h, m, s = re.search(r"^#(?:\$ -l h_rt|PBS -l walltime)=(\d+):(\d+):(\d+)", text, re.M).groups()
    return int(h) * 60 + int(m) + int(s) / 60


def flag_value(argv, flag):
    """The value the run takes: the last one given (a later flag overrides an earlier one)."""
    return argv[len(argv) - argv[::-1].index(flag)]


class FakeJob:
    """A temporary job: data files, fake `module`, scheduler variables; runs a job script."""

    def __init__(self, root: Path, scheduler: str, hosts=("localhost",)):
        self.root, self.scheduler = root, scheduler
        self.work = root / "work"  # the submit directory: data/, checkpoints/, runs/ go here
        self.local = root / "local"  # node-local scratch ($SGE_LOCALDIR / $PBS_LOCALDIR)
        self.probes = root / "probes"
        for d in (self.work / "data" / "gpt2", self.work / "data" / "tinystories", self.work / "data" / "bert",
                  self.work / "data" / "llama3", self.work / "hf" / "Llama-3.1-8B",
                  self.work / "checkpoints" / "llama3.1_8b_hf", self.local, self.probes, root / "bin"):
            d.mkdir(parents=True, exist_ok=True)
        # The probe never reads these; the scripts check they exist before launching.
        for name in ("gpt2/gpt2-vocab.json", "gpt2/gpt2-merges.txt",
                     "tinystories/tinystories_train_text_document.bin",
                     "tinystories/tinystories_train_text_document.idx",
                     "bert/bert-large-uncased-vocab.txt", "bert/bert_text_sentence.bin",
                     "bert/bert_text_sentence.idx", "llama3/corpus_text_document.bin",
                     "llama3/corpus_text_document.idx"):
            (self.work / "data" / name).write_text("")
        for name in ("hf/Llama-3.1-8B/tokenizer.json", "checkpoints/llama3.1_8b_hf/latest_checkpointed_iteration.txt"):
            (self.work / name).write_text("")
        self.module_log = root / "module.calls"
        fake_module = root / "bin" / "module"
        fake_module.write_text(f'#!/bin/sh\necho "$*" >> "{self.module_log}"\n')
        fake_module.chmod(0o755)
        host_list = root / "hosts"
        if scheduler == "sge":  # one line per host
            host_list.write_text("".join(h + "\n" for h in hosts))
            self.env = dict(SGE_JOB_HOSTLIST=host_list, NHOSTS=len(hosts), JOB_ID=JOB_ID,
                            SGE_LOCALDIR=self.local)
        else:  # PBS: one line per slot, hosts repeated
            host_list.write_text("".join(h + "\n" for h in hosts for _ in range(2)))
            self.env = dict(PBS_NODEFILE=host_list, PBS_JOBID=f"{JOB_ID}.pbs1",
                            PBS_O_WORKDIR=self.work, PBS_LOCALDIR=self.local)

    def run(self, script, *args, path_with_module=True, timeout=150, **overrides):
        path = os.environ["PATH"]
        if path_with_module:
            path = f"{self.root / 'bin'}:{path}"
        env = clean_env(PATH=path, GPUS_PER_NODE=2, MEGATRON_DS_ENTRY=PROBE, PYTHON=PYTHON,
                        PROBE_OUT_DIR=self.probes, MPIRUN_EXTRA_ARGS="--oversubscribe",
                        **self.env)
        env.update({k: str(v) for k, v in overrides.items()})
        # SGE runs the script in the submit dir (-cwd); PBS starts elsewhere and the script cds.
        cwd = self.work if self.scheduler == "sge" else self.root
        return run_bounded(["bash", ABCI / script, *args], env, cwd=cwd, timeout=timeout)

    def module_calls(self):
        return self.module_log.read_text().splitlines() if self.module_log.exists() else []


def scheduler_of(script):
    return "sge" if script.startswith("abci2") else "pbs"


@pytest.mark.parametrize("path", sorted(ABCI.glob("*.sh")), ids=lambda p: p.name)
def test_bash_syntax(path):
    result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("script", JOB_SCRIPTS)
def test_headers(script):
    text = (ABCI / script).read_text()
    if script.startswith("abci2"):
        resource = "rt_F" if "v100" in script else "rt_AF"
        assert re.search(rf"^#\$ -l {resource}=\d+$", text, re.M)
        for line in ("#$ -cwd", "#$ -j y"):
            assert line in text.splitlines()
        assert "qsub -g GROUP" in text and "qrsh -g GROUP" in text
    else:
        for line in ("#PBS -q rt_HF", "#PBS -k oed"):
            assert line in text.splitlines()
        # N nodes, 8 MPI ranks each (https://docs.abci.ai/v3/en/mpi/)
        assert re.search(r"^#PBS -l select=\d+:mpiprocs=8$", text, re.M)
        assert 'cd "${PBS_O_WORKDIR' in text
        assert "qsub -P GROUP" in text and "qsub -I" in text


@requires_mpirun
@pytest.mark.parametrize("script", JOB_SCRIPTS)
def test_job_script_launches_two_ranks(tmp_path, script):
    job = FakeJob(tmp_path, scheduler_of(script))
    result = job.run(script, "--train-iters", "7")
    assert result.returncode == 0, result.stdout + result.stderr

    reports = read_probes(job.probes)
    assert [r["rank"] for r in reports] == [0, 1]
    assert sorted(r["local_rank"] for r in reports) == [0, 1]
    for report in reports:
        assert report["world_size"] == 2 and report["rank_sum"] == 1
        assert report["launcher"] == "openmpi"
        assert (report["master_addr"], report["master_port"]) == ("localhost", EXPECTED_PORT)
    argv = reports[0]["argv"]
    assert argv == reports[1]["argv"]

    # The pretrain flags, the user's extra arguments after them, --use-mpi last.
    for flag in COMMON:
        if flag == "--merge-file" and ("bert" in script or "_t5_" in script):
            continue  # a WordPiece vocabulary is one file
        if flag in ("--vocab-file", "--merge-file") and "--tokenizer-model" in argv:
            continue  # a Hugging Face / SentencePiece tokenizer: --tokenizer-model instead
        assert flag in argv, flag
    for flag, value in SPECIFIC[script].items():
        assert flag in argv, flag
        if value is not None:
            assert flag_value(argv, flag) == value, flag
    assert argv[-3:] == ["--train-iters", "7", "--use-mpi"]

    # The DeepSpeed template matches the command line's ZeRO stage and precision.
    ds_config = Path(flag_value(argv, "--deepspeed_config"))
    assert ds_config.parent == REPO / "ds_configs"
    config = json.loads(ds_config.read_text())
    assert config["zero_optimization"]["stage"] == int(flag_value(argv, "--zero-stage"))
    precision = "bf16" if "--bf16" in argv else "fp16"
    assert precision in config

    # Outputs under the submit directory; checkpoints saved where they are resumed from.
    assert flag_value(argv, "--save") == flag_value(argv, "--load")
    assert Path(flag_value(argv, "--save")).parent == job.work / "checkpoints"
    assert Path(flag_value(argv, "--tensorboard-dir")).is_relative_to(job.work / "runs")
    # The job stops (and saves) a few minutes before the scheduler kills it.
    margin = walltime_minutes(script) - int(flag_value(argv, "--exit-duration-in-mins"))
    assert 5 <= margin <= 30, margin

    log = next((job.work / "runs").glob(f"*/logs/train.{JOB_ID}.log"))
    assert "PROBE" in log.read_text()
    assert (job.local / "hostfile").read_text() == "localhost slots=2\n"
    system = "ABCI2" if job.scheduler == "sge" else "ABCI3"
    assert job.module_calls() == [f"load {name}" for name in module_defaults(system)]


@pytest.mark.parametrize("scheduler", ["sge", "pbs"])
def test_multi_node_hostfile_and_dry_run(tmp_path, scheduler):
    # Two nodes can't be launched here, so DRY_RUN: one local process gets --dry-run --world-size.
    job = FakeJob(tmp_path, scheduler, hosts=("g0001", "g0002"))
    script = "abci2_v100_gpt_345m.sh" if scheduler == "sge" else "abci3_h200_gpt_1.3b.sh"
    result = job.run(script, DRY_RUN=1)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (job.local / "hostfile").read_text() == "g0001 slots=2\ng0002 slots=2\n"
    [report] = read_probes(job.probes)
    resource = "rt_F" if scheduler == "sge" else "rt_HF"
    assert report["argv"][-5:] == ["--dry-run", "--world-size", "4", "--gpu-memory-gb", resource]
    assert "--use-mpi" not in report["argv"]
    # The script exported the first host and the job's port for the real launch.
    assert (report["master_addr"], report["master_port"]) == ("g0001", EXPECTED_PORT)


def test_login_node_dry_run_takes_num_nodes(tmp_path):
    job = FakeJob(tmp_path, "sge")
    job.env = {}  # no scheduler at all
    result = job.run("abci2_v100_gpt_13b.sh", NUM_NODES=8, DRY_RUN=1, GPUS_PER_NODE=4)
    assert result.returncode == 0, result.stdout + result.stderr
    [report] = read_probes(job.probes)
    assert report["argv"][-4:-2] == ["--world-size", "32"]  # 8 nodes x GPUS_PER_NODE=4: TP 4 x PP 8
    # Without a scheduler a real multi-node launch is refused, not attempted on this host.
    result = job.run("abci2_v100_gpt_13b.sh", NUM_NODES=8)
    assert result.returncode != 0 and "NUM_NODES=8 without a scheduler" in result.stderr


def test_module_overrides_and_missing_module_command(tmp_path):
    job = FakeJob(tmp_path, "sge")
    result = job.run("abci2_v100_gpt_345m.sh", DRY_RUN=1, CUDA_MODULE="cuda/custom",
                     NCCL_MODULE="")
    assert result.returncode == 0, result.stderr
    cudnn, hpcx = module_defaults("ABCI2")[1], module_defaults("ABCI2")[3]
    assert job.module_calls() == ["load cuda/custom", f"load {cudnn}", f"load {hpcx}"]
    result = job.run("abci2_v100_gpt_345m.sh", DRY_RUN=1, path_with_module=False)
    assert result.returncode == 0, result.stderr
    assert "skipping module loads" in result.stdout


@pytest.mark.parametrize("script", ["abci2_v100_gpt_345m.sh", "abci3_h200_gpt_1.3b.sh"])
def test_outside_a_job_a_script_loads_its_own_systems_modules(tmp_path, script):
    """On a login node (no scheduler) an ABCI 3.0 script loads ABCI 3.0's modules, not ABCI 2.0's."""
    job = FakeJob(tmp_path, scheduler_of(script))
    job.env = {"WORK_DIR": job.work}  # no scheduler at all
    result = job.run(script, DRY_RUN=1)
    assert result.returncode == 0, result.stdout + result.stderr
    system = "ABCI2" if script.startswith("abci2") else "ABCI3"
    assert job.module_calls() == [f"load {name}" for name in module_defaults(system)]


def test_dry_run_world_size_not_divisible_names_num_nodes(tmp_path):
    job = FakeJob(tmp_path, "sge")
    job.env = {}
    # 13B: TP 4 x PP 8 = 32 ranks per model copy; 3 nodes x GPUS_PER_NODE=2 cannot hold them
    result = job.run("abci2_v100_gpt_13b.sh", NUM_NODES=3, DRY_RUN=1)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "[abci] ERROR: world size 6 (NUM_NODES=3 x GPUS_PER_NODE=2) is not divisible by TP x PP = 4 x 8 = 32: use "
        "a multiple of 16 node(s) (e.g. NUM_NODES=16), or change TP/PP")
    assert not list(job.probes.iterdir())  # refused before the dry run itself
    # a layout overridden after the script name counts: PP 2 x TP 4 = 8 ranks fit 4 nodes x 2 GPUs
    result = job.run("abci2_v100_gpt_13b.sh", "--pipeline-model-parallel-size", "2", NUM_NODES=4, DRY_RUN=1)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dry_run_outside_a_job_leaves_no_temporary_hostfile(tmp_path):
    job = FakeJob(tmp_path, "pbs")
    job.env = {"WORK_DIR": job.work}
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    for nodes, expected in ((2, 0), (3, 1)):  # a dry run that passes, and one refused (13B's 32-rank blocks)
        result = job.run("abci2_v100_gpt_13b.sh" if expected else "abci3_h200_gpt_1.3b.sh", NUM_NODES=nodes,
                         DRY_RUN=1, TMPDIR=scratch)
        assert result.returncode == expected, result.stdout + result.stderr
        assert "hostfile=" + str(scratch) in result.stdout or expected
        assert list(scratch.iterdir()) == []


def _abci_numbers():
    import importlib.util

    spec = importlib.util.spec_from_file_location("abci_numbers", ABCI / "abci_numbers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quoted_numbers_are_the_estimators():
    """The memory and checkpoint numbers in the job scripts' headers and docs/abci.md are generated
    from the dry run's estimator (scripts/abci/abci_numbers.py); a change to the estimator or to a
    script's layout without regenerating them fails here."""
    numbers = _abci_numbers()
    for script in JOB_SCRIPTS:
        lines = (ABCI / script).read_text().splitlines()
        at = next(i for i, line in enumerate(lines) if line.endswith(numbers.MARKER))
        assert lines[at + 1].startswith("#   stage ") and " GB" in lines[at + 2], script
    assert len(numbers.DOC_BLOCK.findall(open(numbers.DOC).read())) == 2
    assert numbers.main(["--check"]) == 0, "run: python scripts/abci/abci_numbers.py"


def test_missing_data_fails_before_launch(tmp_path):
    job = FakeJob(tmp_path, "pbs")
    missing = job.work / "data" / "nowhere"
    result = job.run("abci3_h200_gpt_1.3b.sh", DATA_PATH=f"0.3 {missing} 0.7 {missing}")
    assert result.returncode != 0
    assert f"missing input file: {missing}.bin" in result.stderr
    assert not list(job.probes.iterdir())  # nothing was started
    assert job.module_calls() == []


def test_repository_found_from_submit_directory(tmp_path):
    # qsub runs a spooled copy of the script: its own path says nothing about the repository.
    job = FakeJob(tmp_path, "sge")
    spooled = tmp_path / "spool" / "job_script"
    spooled.parent.mkdir()
    spooled.write_text((ABCI / "abci2_v100_gpt_345m.sh").read_text())
    env = clean_env(GPUS_PER_NODE=2, MEGATRON_DS_ENTRY=PROBE, PYTHON=PYTHON, DRY_RUN=1,
                    PROBE_OUT_DIR=job.probes, WORK_DIR=job.work, **job.env)
    result = run_bounded(["bash", spooled], env, cwd=REPO, timeout=60)  # submitted from the repo
    assert result.returncode == 0, result.stderr
    [report] = read_probes(job.probes)
    assert flag_value(report["argv"], "--deepspeed_config").startswith(str(REPO / "ds_configs"))
    result = run_bounded(["bash", spooled], env, cwd=tmp_path, timeout=60)  # submitted elsewhere
    assert result.returncode != 0 and "repository not found" in result.stderr


@requires_mpirun
def test_training_failure_fails_the_job(tmp_path):
    # The scheduler (and a chain of dependent jobs) must see a crashed training as a failed job.
    job = FakeJob(tmp_path, "sge")
    crash = tmp_path / "crash.py"
    crash.write_text("import sys\nprint('boom', flush=True)\nsys.exit(3)\n")
    result = job.run("abci2_v100_gpt_345m.sh", MEGATRON_DS_ENTRY=crash)
    assert result.returncode != 0
    assert "boom" in (job.work / "runs" / "gpt_345m" / "logs" / f"train.{JOB_ID}.log").read_text()
