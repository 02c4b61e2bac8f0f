"""Session-wide fixtures."""
# Before torch is imported anywhere: torch reads its CUDA hooks once, and the fake-CUDA tests need
# the shim's (megatron_ds.fake_cuda; a CUDA build of torch needs none). Where it cannot be built,
# those tests skip with this reason.
from megatron_ds import fake_cuda  # isort: skip

FAKE_CUDA_UNAVAILABLE = fake_cuda.preload()

import importlib  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.e2e_data import make_e2e_data, make_masked_tiny_data  # noqa: E402

# The venv's bin/ first on PATH for everything the session starts, as in an activated venv (the job
# scripts put it first themselves). torch builds DeepSpeed's C++ ops (cpu_adam, which the CPU-offload
# tests load) with whichever `ninja` comes first on PATH, and the venv's (pip's) and the system's
# write build logs the other cannot read: each switch between them rebuilt the op in
# TORCH_EXTENSIONS_DIR (~20-45 s on two cores).
_VENV_BIN = os.path.dirname(sys.executable)
if sys.prefix != sys.base_prefix and os.environ.get("PATH", "").split(os.pathsep)[0] != _VENV_BIN:
    os.environ["PATH"] = os.pathsep.join([_VENV_BIN, os.environ.get("PATH", "")])

# A shell without job control starts `make test &` (a background job) with SIGINT ignored, which every child
# inherits: Python then installs no KeyboardInterrupt handler, and the Ctrl-C tests (tests/training/
# test_signals.py) see no interrupt. A handler, unlike SIG_IGN, is reset to the default in an exec'd child.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Fix this process's view of the GPUs before any test changes CUDA_VISIBLE_DEVICES (the CUDA
# runtime reads it once, on first use): tests marked `gpu` keep seeing the real devices.
HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` skip, with a reason -ra reports, where there is no CUDA device."""
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="marked gpu: needs a CUDA device (make test-gpu on a GPU machine)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _cpu_unless_marked_gpu(request, monkeypatch):
    """The CPU suite runs on the CPU on a machine with GPUs too: in-process runs through
    DS_ACCELERATOR=cpu (megatron_ds.training.device), and launched processes (torchrun, mpirun,
    the CLIs) additionally see no GPU. Tests marked `gpu` get the environment untouched."""
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setenv("DS_ACCELERATOR", "cpu")
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


@pytest.fixture
def bench(monkeypatch):
    """``bench("gpu_mfu")``: a bench/ module as `python bench/X.py` sees it, bench/ first on the path."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    return importlib.import_module


@pytest.fixture(scope="session")
def e2e_data(tmp_path_factory):
    """Preprocessed real text (see tests/e2e_data.py), shared by the end-to-end tests."""
    return make_e2e_data(tmp_path_factory.mktemp("e2e_data"))


@pytest.fixture(scope="session")
def masked_tiny_data(tmp_path_factory):
    """The BERT/T5 quickstarts' corpus, WordPiece vocabulary and sentence data at the tiny size
    (see tests/e2e_data.py), shared by the BERT tests and both masked quickstart tests."""
    return make_masked_tiny_data(tmp_path_factory.mktemp("masked_tiny_data"))


@pytest.fixture(scope="session", autouse=True)
def _stdlib_documents_once():
    """The quickstarts' corpus step parses every standard-library module for its docstrings
    (megatron_ds.data.sample_corpus.stdlib_documents, ~6 s of CPU); in this process it runs for the
    e2e data, the masked data and the GPT quickstart test. The documents are a function of the
    installed standard library alone, so the session parses it once and gives each call a copy."""
    from megatron_ds.data import sample_corpus

    original, parsed = sample_corpus.stdlib_documents, []

    def once() -> list[str]:
        if not parsed:
            parsed.append(original())
        return list(parsed[0])

    sample_corpus.stdlib_documents = once
    yield
    sample_corpus.stdlib_documents = original
