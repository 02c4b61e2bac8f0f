"""The ABCI workflow around the job scripts, in simulated Grid Engine / PBS jobs:
DRY_RUN's printed launch (hostfile and mpirun line, field by field) with the real
pretrain_gpt.py --dry-run verdict, node-local data staging, interactive.sh, setup_env.sh,
preprocess_jsonl.sh with the real tools/preprocess_data.py, and shellcheck on every script.

Schedulers are faked by their environment (tests/launch/test_abci_scripts.py's FakeJob), `module`
by a command that records its arguments. Expected values come from the ABCI facts (hostfile
"host slots=N", port 10000 + JOB_ID % 50000) and the scripts' headers, not from their output.
"""
import filecmp
import gzip
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.launch.helpers import PROBE, PYTHON, REPO, clean_env, read_probes, requires_mpirun, run_bounded
from tests.launch.test_abci_scripts import ABCI, EXPECTED_PORT, JOB_SCRIPTS, FakeJob, module_defaults

# GPUs per node and nodes each script's header asks for (the layout is then the real one).
LAYOUT = {"abci2_v100_gpt_345m.sh": (4, 1, "rt_F"), "abci2_v100_gpt_13b.sh": (4, 8, "rt_F"),
          "abci2_a100_gpt_1.3b.sh": (8, 1, "rt_AF"), "abci3_h200_gpt_1.3b.sh": (8, 1, "rt_HF"),
          "abci3_h200_llama_7b.sh": (8, 2, "rt_HF"), "abci3_h200_bert_345m.sh": (8, 1, "rt_HF"),
          "abci3_h200_t5_220m.sh": (8, 1, "rt_HF"), "abci3_h200_llama3.1_8b_cpt.sh": (8, 2, "rt_HF")}


def header_nodes(script):
    text = (ABCI / script).read_text()
    m = re.search(r"^#\$ -l rt_[A-Z]+=(\d+)$", text, re.M) or re.search(r"^#PBS -l select=(\d+)", text, re.M)
    return int(m.group(1))


def real_job(tmp_path, script, e2e_data, hosts):
    """A FakeJob running the real pretrain_gpt.py (not the probe) on real tokenizer files."""
    job = FakeJob(tmp_path, "sge" if script.startswith("abci2") else "pbs", hosts=hosts)
    env = dict(MEGATRON_DS_ENTRY="", PYTHON="", GPUS_PER_NODE="", VOCAB_FILE=e2e_data["vocab"],
               MERGE_FILE=e2e_data["merges"], DATA_PATH=e2e_data["prefix"])
    if "bert" in script or "t5" in script:  # pretrain_bert.py / pretrain_t5.py read a WordPiece vocab.txt (the dry run only its size)
        vocab = tmp_path / "vocab.txt"
        vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(200)]))
        env["VOCAB_FILE"] = str(vocab)
    if "llama3" in script:  # its Hugging Face tokenizer directory is a placeholder here: the same BPE files
        env["TOKENIZER_TYPE"] = "GPT2BPETokenizer"
    return job, env


def printed_mpirun(stdout):
    lines = stdout.splitlines()
    i = lines.index("[abci] DRY_RUN: mpirun line:")
    return shlex.split(lines[i + 1].removeprefix("[abci]   "))


def printed_hostfile(stdout):
    lines = stdout.splitlines()
    i = next(n for n, line in enumerate(lines) if line.startswith("[abci] DRY_RUN: hostfile "))
    out = []
    for line in lines[i + 1:]:
        if not line.startswith("[abci]   "):
            break
        out.append(line.removeprefix("[abci]   "))
    return out


@pytest.mark.parametrize("script", JOB_SCRIPTS)
def test_dry_run_prints_the_full_launch(tmp_path, script, e2e_data):
    gpus, nodes, resource = LAYOUT[script]
    assert header_nodes(script) == nodes
    hosts = tuple(f"node{i:03d}" for i in range(1, nodes + 1))
    job, env = real_job(tmp_path, script, e2e_data, hosts)
    result = job.run(script, "--train-iters", "20", DRY_RUN=1, NCCL_IB_TIMEOUT=22, **env)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    out = result.stdout
    world = gpus * nodes

    assert printed_hostfile(out) == [f"{h} slots={gpus}" for h in hosts]
    assert (job.local / "hostfile").read_text().splitlines() == printed_hostfile(out)

    argv = printed_mpirun(out)
    assert argv[:7] == ["mpirun", "-np", str(world), "-npernode", str(gpus), "-hostfile",
                        str(job.local / "hostfile")]
    entry = argv.index(str(REPO / next((f"pretrain_{m}.py" for m in ("bert", "t5") if f"_{m}_" in script), "pretrain_gpt.py")))
    options, train_args = argv[7:entry - 1], argv[entry + 1:]
    exported = [options[i + 1] for i, o in enumerate(options) if o == "-x"]
    expected = {"MASTER_ADDR", "MASTER_PORT", "PATH", "LD_LIBRARY_PATH", "CUDA_DEVICE_MAX_CONNECTIONS",
                "TORCH_NCCL_AVOID_RECORD_STREAMS", "NCCL_IB_TIMEOUT"}
    if job.scheduler == "pbs":  # ABCI 3.0's documented multi-rail settings travel to every rank
        expected |= {"UCX_MAX_RNDV_RAILS", "UCX_MAX_EAGER_RAILS"}
    assert expected <= set(exported), exported
    rest = [o for i, o in enumerate(options) if o != "-x" and (i == 0 or options[i - 1] != "-x")]
    assert rest[:4] == ["-bind-to", "none", "-map-by", "slot"]
    assert argv[entry - 1].endswith("python") or "python" in Path(argv[entry - 1]).name
    assert train_args[-3:] == ["--train-iters", "20", "--use-mpi"]
    # the values those variables carry
    assert f"[abci] DRY_RUN:   MASTER_ADDR={hosts[0]}" in out
    assert f"[abci] DRY_RUN:   MASTER_PORT={EXPECTED_PORT}" in out
    assert "[abci] DRY_RUN:   CUDA_DEVICE_MAX_CONNECTIONS=1" in out
    assert "[abci] DRY_RUN:   NCCL_IB_TIMEOUT=22" in out
    if job.scheduler == "pbs":
        assert "[abci] DRY_RUN:   UCX_MAX_RNDV_RAILS=4" in out and "[abci] DRY_RUN:   UCX_MAX_EAGER_RAILS=1" in out

    # the verdict of pretrain_gpt.py --dry-run for that world size and that GPU's memory
    assert re.search(rf"^world size {world} = TP \d+ x PP \d+ x DP \d+", out, re.M)
    assert re.search(r"^memory per GPU \(stage \d+, GB\): weights ", out, re.M)
    gb = {"rt_F": 16, "rt_AF": 40, "rt_HF": 141}[resource]
    assert re.search(rf"total [\d.]+ of {gb} GB: fits", out), out[-2000:]
    assert f"[abci] DRY_RUN: OK: the job would start {world} processes on {nodes} node(s)" in out
    assert job.module_calls() == [f"load {m}" for m in module_defaults("ABCI2" if job.scheduler == "sge" else "ABCI3")]


def test_dry_run_fails_when_the_layout_does_not_fit(tmp_path, e2e_data):
    # The 7B Llama without tensor parallelism at micro batch 8: ~160 GB of activations at sequence
    # 4096 (flash attention: ~0.7 GB per layer and sample, 16 layers per stage, 2 in flight) on 141 GB.
    job, env = real_job(tmp_path, "abci3_h200_llama_7b.sh", e2e_data, ("n1", "n2"))
    result = job.run("abci3_h200_llama_7b.sh", DRY_RUN=1, TP=1, MICRO_BATCH=8, **env)
    assert result.returncode == 1, result.stdout[-3000:]
    assert "DOES NOT FIT" in result.stdout
    assert "biggest term: activations" in result.stderr and "would fit:" in result.stderr
    assert "--checkpoint-activations" in result.stderr or "--tensor-model-parallel-size" in result.stderr
    assert "DRY_RUN: FAILED" in result.stderr
    # and the GPU memory is overridable: on 300 GB GPUs the same layout passes
    result = job.run("abci3_h200_llama_7b.sh", DRY_RUN=1, TP=1, MICRO_BATCH=8, GPU_MEMORY_GB=300, **env)
    assert result.returncode == 0, result.stderr[-3000:]


GPT2_DIR = REPO / ".." / "shared" / "data" / "gpt2"


@pytest.mark.skipif(not (GPT2_DIR / "gpt2-vocab.json").is_file(), reason="GPT-2 files (../shared/data/gpt2) absent")
def test_documented_estimates_are_what_the_dry_run_prints(tmp_path, e2e_data):
    """docs/abci.md's two blocks (generated by scripts/abci/abci_numbers.py from the estimator) are
    what the real DRY_RUN of the 7B script prints with GPT-2's vocabulary: fitting at its own layout,
    refused at TP 1 / micro batch 8."""
    import sys

    sys.path.insert(0, str(ABCI))
    import abci_numbers

    blocks = {m.group("case"): " ".join(m.group("body").split("\n")).strip()
              for m in abci_numbers.DOC_BLOCK.finditer((REPO / "docs" / "abci.md").read_text())}
    job, env = real_job(tmp_path, "abci3_h200_llama_7b.sh", e2e_data, ("n1", "n2"))
    env.update(VOCAB_FILE=GPT2_DIR / "gpt2-vocab.json", MERGE_FILE=GPT2_DIR / "gpt2-merges.txt")
    result = job.run("abci3_h200_llama_7b.sh", DRY_RUN=1, **env)
    assert result.returncode == 0, result.stderr[-3000:]
    printed = re.search(r"^memory per GPU \(stage .*$", result.stdout, re.M).group(0)
    assert printed == blocks["abci3_h200_llama_7b.sh"]
    result = job.run("abci3_h200_llama_7b.sh", DRY_RUN=1, TP=1, MICRO_BATCH=8, **env)
    assert result.returncode == 1
    error = next(line for line in result.stderr.splitlines() if line.startswith("error: "))
    assert f" ... {error} [abci] DRY_RUN: FAILED" in blocks["TP=1 MICRO_BATCH=8 abci3_h200_llama_7b.sh"]


@requires_mpirun
def test_stage_data_copies_to_node_local_storage(tmp_path):
    job = FakeJob(tmp_path, "pbs")
    prefix = job.work / "data" / "tinystories" / "tinystories_train_text_document"
    prefix.with_suffix(".bin").write_bytes(b"\x01" * 1000)
    prefix.with_suffix(".idx").write_bytes(b"MMIDIDX\x00\x00" + b"\x02" * 50)
    result = job.run("abci3_h200_gpt_1.3b.sh", STAGE_DATA=1)  # real mpirun, the probe as entry point
    assert result.returncode == 0, result.stdout + result.stderr
    reports = read_probes(job.probes)
    assert len(reports) == 2 and reports[0]["argv"] == reports[1]["argv"]
    argv = reports[0]["argv"]
    staged = Path(argv[argv.index("--data-path") + 1])
    assert staged.parent == job.local / "data"  # $PBS_LOCALDIR
    for suffix in (".bin", ".idx"):
        assert filecmp.cmp(staged.with_name(staged.name + suffix), str(prefix) + suffix, shallow=False)
    assert not list((job.local / "data").glob("*.part"))
    # the index cache is built once on the shared file system, not once per node
    assert argv[argv.index("--data-cache-path") + 1] == str(job.work / "runs" / "gpt_1.3b" / "index-cache")


# --------------------------------------------------------------------------- interactive.sh

@pytest.mark.parametrize("script,expected", [
    ("abci2_v100_gpt_13b.sh", "qrsh -g GROUP -l rt_F=8 -l h_rt=1:00:00"),
    ("abci3_h200_llama_7b.sh", "qsub -I -P GROUP -q rt_HF -l select=2:mpiprocs=8 -l walltime=1:00:00"),
])
def test_interactive_outside_a_job_prints_the_allocation_command(tmp_path, script, expected):
    env = clean_env()
    result = run_bounded(["bash", ABCI / "interactive.sh", f"scripts/abci/{script}"], env, cwd=REPO, timeout=60)
    assert result.returncode == 1
    assert "not inside an interactive job" in result.stderr and expected in result.stderr


def test_interactive_runs_the_job_script_in_the_session(tmp_path):
    job = FakeJob(tmp_path, "pbs")
    # qstat -f answers the session's walltime: 2 hours
    qstat = tmp_path / "bin" / "qstat"
    qstat.write_text("#!/bin/sh\necho '    Resource_List.walltime = 02:00:00'\n")
    qstat.chmod(0o755)
    env = clean_env(PATH=f"{tmp_path / 'bin'}:{clean_env()['PATH']}", GPUS_PER_NODE=2, MEGATRON_DS_ENTRY=PROBE,
                    PYTHON=PYTHON, PROBE_OUT_DIR=job.probes, DRY_RUN=1, PBS_ENVIRONMENT="PBS_INTERACTIVE",
                    **{k: v for k, v in job.env.items() if k != "PBS_O_WORKDIR"},
                    PBS_O_WORKDIR=tmp_path)  # qsub -I was typed elsewhere; the user cd'ed to work/
    result = run_bounded(["bash", ABCI / "interactive.sh", ABCI / "abci3_h200_gpt_1.3b.sh", "--train-iters", "5"],
                         env, cwd=job.work, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    [report] = read_probes(job.probes)
    argv = report["argv"]
    assert argv[argv.index("--exit-duration-in-mins") + 1] == "115"  # 120 minutes - 5 to save
    assert Path(argv[argv.index("--save") + 1]).parent == job.work / "checkpoints"  # the current directory
    assert "--train-iters" in argv and argv[argv.index("--dry-run") - 1] == "5"
    assert "--world-size" in argv and argv[argv.index("--world-size") + 1] == "2"


# --------------------------------------------------------------------------- setup_env.sh

def fake_venv(tmp_path):
    """A venv whose python is this test's (so the environment check really runs) and a pip that
    only records its arguments."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(f'#!/bin/sh\nexec "{PYTHON}" "$@"\n')
    (venv / "bin" / "python").chmod(0o755)
    pip_log = tmp_path / "pip.calls"
    pip = tmp_path / "bin" / "pip"
    pip.parent.mkdir(exist_ok=True)
    pip.write_text(f'#!/bin/sh\necho "$*" >> "{pip_log}"\n')
    pip.chmod(0o755)
    return venv, pip, pip_log


@pytest.mark.parametrize("scheduler", ["sge", "pbs"])
def test_setup_env_installs_once_and_reports(tmp_path, scheduler):
    job = FakeJob(tmp_path, scheduler)
    venv, pip, pip_log = fake_venv(tmp_path)
    env = clean_env(PATH=f"{tmp_path / 'bin'}:{clean_env()['PATH']}", VENV_DIR=venv, PIP=pip, BUILD_APEX=1,
                    **job.env)
    if scheduler == "sge":
        env["RESOURCE_TYPE"] = "rt_AG.small"  # an A100 node of ABCI 2.0
    first = run_bounded(["bash", ABCI / "setup_env.sh"], env, cwd=REPO, timeout=300)
    assert first.returncode == 0, first.stdout + first.stderr
    calls = pip_log.read_text().splitlines()
    assert calls[0] == "install -q torch"
    assert any(c.startswith("install -q -r ") and "requirements.txt" in c for c in calls)
    assert f"install -q --no-build-isolation -e {REPO}[tensorboard]" in calls  # the job scripts' --tensorboard-dir
    arch = "8.0" if scheduler == "sge" else "9.0"  # A100 / H200 (no nvidia-smi here)
    assert f"TORCH_CUDA_ARCH_LIST={arch}" in first.stdout
    assert any("--build-option=--cuda_ext" in c and c.endswith("apex.git") for c in calls)
    system = "ABCI2" if scheduler == "sge" else "ABCI3"
    loads = [c.split(" ", 1)[1] for c in job.module_calls()]
    assert loads[:4] == module_defaults(system)  # the training modules, before anything is built
    # the start-up report, from the venv's python
    for line in ("[check] torch:", "[check] nccl:", "[check] attention:", "[check] layernorm:", "[check] optimizer:"):
        assert line in first.stdout, line
    # idempotent: a second run installs nothing
    second = run_bounded(["bash", ABCI / "setup_env.sh"], env, cwd=REPO, timeout=300)
    assert second.returncode == 0, second.stderr
    assert pip_log.read_text().splitlines() == calls
    assert "[setup] ok: torch" in second.stdout and "[setup] ok: apex" in second.stdout
    # a changed input redoes that step only
    env["TORCH_SPEC"] = "torch==2.13.0"
    third = run_bounded(["bash", ABCI / "setup_env.sh"], env, cwd=REPO, timeout=300)
    assert third.returncode == 0
    assert pip_log.read_text().splitlines() == calls + ["install -q torch==2.13.0"]


# --------------------------------------------------------------------------- preprocess_jsonl.sh

def test_preprocess_jsonl_in_a_cpu_job(tmp_path, e2e_data):
    corpus = Path(e2e_data["prefix"]).parents[1] / "corpus.jsonl"
    lines = corpus.read_text().splitlines(keepends=True)
    src = tmp_path / "corpus"
    src.mkdir()
    (src / "part0.jsonl").write_text("".join(lines[:60]))
    with gzip.open(src / "part1.jsonl.gz", "wt") as f:
        f.write("".join(lines[60:120]))
    job = FakeJob(tmp_path, "sge")  # an rt_C.large job of ABCI 2.0
    group = tmp_path / "groups" / "gAB" / "data"
    env = clean_env(PATH=f"{tmp_path / 'bin'}:{clean_env()['PATH']}", PYTHON=PYTHON, VOCAB_FILE=e2e_data["vocab"],
                    MERGE_FILE=e2e_data["merges"], WORKERS=2, **job.env)
    result = run_bounded(["bash", ABCI / "preprocess_jsonl.sh", src, group / "corpus"], env, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(rf"staging 2 file\(s\), .* to {re.escape(str(job.local))}/preprocess\.\d+/input", result.stdout)

    # the same bytes as tools/preprocess_data.py run directly on the same files
    from megatron_ds.cli import preprocess_data
    ref = tmp_path / "ref"
    assert preprocess_data.main(["--input", str(src), "--output-prefix", str(ref / "corpus"), "--json-keys", "text",
                                 "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", e2e_data["vocab"],
                                 "--merge-file", e2e_data["merges"], "--append-eod", "--workers", "1"]) in (0, None)
    for suffix in (".bin", ".idx"):
        assert filecmp.cmp(group / f"corpus_text_document{suffix}", ref / f"corpus_text_document{suffix}",
                           shallow=False)
    assert sorted(p.name for p in group.iterdir()) == ["corpus_text_document.bin", "corpus_text_document.idx"]
    # re-running keeps what is there
    again = run_bounded(["bash", ABCI / "preprocess_jsonl.sh", src, group / "corpus"], env, cwd=tmp_path, timeout=120)
    assert again.returncode == 0 and "already present" in again.stdout


# --------------------------------------------------------------------------- shellcheck

def test_shellcheck_clean():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck; .ci/run installs it)")
    files = sorted(str(p.relative_to(REPO)) for p in [*ABCI.glob("*.sh"), *(REPO / "dataset").glob("*.sh")])
    result = subprocess.run(["shellcheck", "-x", *files], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


def test_check_env_reports_the_cuda_of_extension_builds(tmp_path, monkeypatch, capsys):
    import torch

    from megatron_ds.cli import check_env
    nvcc = tmp_path / "nvcc"
    nvcc.write_text('#!/bin/sh\necho "Cuda compilation tools, release 12.8, V12.8.93"\n')
    nvcc.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{clean_env()['PATH']}")
    assert check_env.main([]) == 0
    out = capsys.readouterr().out
    assert "[check] nvcc (the loaded CUDA module): 12.8" in out
    mismatch = (torch.version.cuda or "none").split(".")[0] != "12"
    assert ("another CUDA major" in out) == mismatch
    assert check_env.main(["--require-cuda"]) == (0 if torch.cuda.is_available() else 1)
