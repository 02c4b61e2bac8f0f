"""megatron_ds.ds_compat: the one DeepSpeed version check and the internals it guards."""
from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys

import deepspeed
import pytest

from megatron_ds import ds_compat
from megatron_ds.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_installed_deepspeed_passes():
    ds_compat.check_deepspeed()
    ds_compat.check_deepspeed(interleaved=True)
    assert ds_compat.missing_hooks() == []


@pytest.mark.parametrize("version", ["0.15.4", "0.20.0", "1.0.0+cu121"])
def test_out_of_range_version_is_one_config_error(monkeypatch, version):
    monkeypatch.setattr(deepspeed, "__version__", version)
    with pytest.raises(ConfigError) as info:
        ds_compat.check_deepspeed()
    text = str(info.value)
    assert "\n" not in text
    assert f"DeepSpeed {version} cannot be used" in text
    assert f">= {ds_compat.TESTED[0]}, < {ds_compat.TESTED[1]}" in text
    assert "pip install" in text and "megatron_ds/ds_compat.py" in text


def test_interleaved_needs_its_minimum(monkeypatch):
    monkeypatch.setattr(deepspeed, "__version__", "0.18.2")
    ds_compat.check_deepspeed()  # in the tested range: fine without the interleaved schedule
    with pytest.raises(ConfigError, match=r"DeepSpeed 0\.18\.2 cannot be used: the interleaved pipeline schedule "
                                          r"needs DeepSpeed >= 0\.19"):
        ds_compat.check_deepspeed(interleaved=True)


def _resolve(module: str, cls: str | None):
    mod = importlib.import_module(module)
    return getattr(mod, cls) if cls else mod


@pytest.mark.parametrize("module,cls,attr,_why", ds_compat._HOOKS)
def test_each_asserted_hook_exists(module, cls, attr, _why):
    assert callable(getattr(_resolve(module, cls), attr))


@pytest.mark.parametrize("name", sorted(ds_compat._INTERNAL_NAMES))
def test_each_internal_name_resolves(name):
    # looked up through ds_compat, as the modules that use it do, and the same object DeepSpeed has
    assert getattr(ds_compat, name) is getattr(_resolve(ds_compat._INTERNAL_NAMES[name], None), name)


@pytest.mark.parametrize("module,cls,method,attr", ds_compat._READ_BY_DEEPSPEED)
def test_deepspeed_still_reads_what_guarded_optimizer_sets(module, cls, method, attr):
    import inspect

    assert re.search(rf"\.{attr}\b", inspect.getsource(getattr(_resolve(module, cls), method)))


def test_a_lost_hook_fails_with_the_one_message(monkeypatch):
    from deepspeed.runtime.pipe.module import PipelineModule

    monkeypatch.delattr(PipelineModule, "_is_checkpointable")
    with pytest.raises(ConfigError, match=r"cannot be used: it lacks deepspeed\.runtime\.pipe\.module\."
                                          r"PipelineModule\._is_checkpointable; megatron_ds is tested with"):
        ds_compat.check_deepspeed()

    def _is_checkpointable(self, funcs):
        return True
    with pytest.raises(ConfigError, match="PipelineModule._is_checkpointable"):
        ds_compat.overrides_deepspeed_hook(_is_checkpointable)


def test_pipeline_override_is_registered():
    from deepspeed.runtime.pipe.module import PipelineModule

    from megatron_ds.model.pipeline_model import PipelineModel

    hook = "_is_checkpointable"  # DeepSpeed's PipelineModule hook PipelineModel overrides
    assert hook in {h[2] for h in ds_compat._HOOKS}
    assert getattr(PipelineModel, hook) is not getattr(PipelineModule, hook)


def test_an_unlisted_override_is_refused():
    def _some_new_hook(self):
        return None
    with pytest.raises(AssertionError, match="ds_compat._HOOKS"):
        ds_compat.overrides_deepspeed_hook(_some_new_hook)


def test_importing_it_does_not_import_deepspeed():
    code = "import sys, megatron_ds.ds_compat; sys.exit('deepspeed' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=120).returncode == 0


def test_no_other_module_imports_deepspeed_runtime():
    """Everything under deepspeed.runtime is reached through ds_compat only."""
    offenders = []
    for top in ("megatron_ds", "tools"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                path = os.path.join(dirpath, name)
                if not name.endswith(".py") or path.endswith(os.path.join("megatron_ds", "ds_compat.py")):
                    continue
                with open(path) as f:
                    for i, line in enumerate(f, 1):
                        if re.match(r"\s*(from|import)\s+deepspeed\.runtime\b", line):
                            offenders.append(f"{os.path.relpath(path, ROOT)}:{i}")
    assert offenders == []


@pytest.mark.skipif(sys.platform != "linux", reason="DeepSpeed builds its shared-memory op on Linux only")
def test_cpu_runs_do_not_build_deepspeeds_shared_memory_op(monkeypatch):
    """DeepSpeed's TorchBackend asks build_shm_op() for its CPU collective when it joins a job; after
    skip_shm_comm_op it gets None, with nothing compiled (the op serves only inference_all_reduce)."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    ds_torch_comm = importlib.import_module("deepspeed.comm.torch")  # (deepspeed.comm's own ``torch`` is torch)
    if get_accelerator().device_name() != "cpu":
        pytest.skip("DeepSpeed's accelerator here is not the CPU")
    compatible = deepspeed.ops.__compatible_ops__
    monkeypatch.setitem(compatible, ds_compat._SHM_COMM_OP, True)  # what DeepSpeed probes on Linux
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    monkeypatch.setattr(type(builder), "load", lambda self, verbose=False: pytest.fail("the op was built"))
    ds_compat.skip_shm_comm_op()
    assert ds_torch_comm.build_shm_op() is None
