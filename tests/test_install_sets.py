"""What each entry point installs (issue 41: first contact is lean). `make quickstart` installs torch,
the runtime set and the package only; `make quickstart-bert` / `quickstart-t5` add setup.py's "hf"
extra (transformers, for their export step); `make test` adds requirements-test.txt. The Makefile is
read through `make -n` (prints the commands, runs none) for a venv that does not exist yet: a fresh
clone's first call."""
from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# installed by `make test` or an extra, never by `make quickstart` (none of them is imported by it)
NOT_RUNTIME = {"pytest", "pytest-timeout", "transformers", "lm_eval", "accelerate", "wandb", "tensorboard"}


def requirements(name: str) -> list[str]:
    lines = (line.split("#")[0].strip() for line in (REPO / name).read_text().splitlines())
    return [line for line in lines if line]


def setup_keywords() -> dict:
    """setup()'s literal keyword arguments, read from setup.py without running it."""
    tree = ast.parse((REPO / "setup.py").read_text())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    out = {}
    for kw in call.keywords:
        try:
            out[kw.arg] = ast.literal_eval(kw.value)
        except ValueError:  # ext_modules, cmdclass: not literals
            pass
    return out


def project(spec: str) -> str:
    return re.split(r"[<>=!~\[ ]", spec, maxsplit=1)[0]


def test_requirement_files_are_setup_pys_sets():
    kw = setup_keywords()
    # pybind11: the C++ helpers' build, which `pip install --no-build-isolation -e .` takes from the venv
    assert requirements("requirements.txt") == kw["install_requires"] + ["pybind11>=2.10"]
    assert requirements("requirements-test.txt") == kw["extras_require"]["test"]
    assert not {project(r) for r in kw["install_requires"]} & NOT_RUNTIME
    assert {project(r) for r in kw["extras_require"]["test"]} == NOT_RUNTIME


def make_dry_run(target: str, tmp_path: Path) -> str:
    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    venv = tmp_path / "fresh-venv"
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}  # under `make test`
    run = subprocess.run(["make", "-n", "--no-print-directory", "-C", str(REPO), f"VENV={venv}", target],
                         capture_output=True, text=True, timeout=60, env=env)
    assert run.returncode == 0, run.stderr
    return run.stdout


def test_quickstart_installs_the_runtime_set_only(tmp_path):
    commands = make_dry_run("quickstart", tmp_path)
    assert "install -q -r requirements.txt" in commands and "install -q --no-build-isolation -e ." in commands
    assert "requirements-test.txt" not in commands and "[hf]" not in commands
    assert commands.rstrip().endswith("tools/quickstart.py")


@pytest.mark.parametrize("model", ["bert", "t5"])
def test_masked_quickstarts_add_the_hf_extra_for_their_export(tmp_path, model):
    commands = make_dry_run(f"quickstart-{model}", tmp_path)
    assert "install -q -r requirements.txt" in commands and '-e ".[hf]"' in commands
    assert "requirements-test.txt" not in commands


def test_make_test_adds_the_test_set(tmp_path):
    commands = make_dry_run("test", tmp_path)
    assert "install -q -r requirements.txt" in commands and "install -q -r requirements-test.txt" in commands
    assert commands.index("requirements.txt") < commands.index("requirements-test.txt")
