"""The one device decision: every CPU/GPU branch of the package asks megatron_ds.accelerator, so
simulating CUDA there (the fake-CUDA tests, bench/kernel_budget.py) reaches all of them."""
import ast
from pathlib import Path

import pytest

from megatron_ds import accelerator

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_ds"


def _calls_cuda_is_available(path: Path) -> list[int]:
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.cuda.is_available":
            lines.append(node.lineno)
    return lines


def test_only_the_decision_asks_torch_whether_cuda_exists():
    found = {str(p.relative_to(PACKAGE)): lines for p in sorted(PACKAGE.rglob("*.py"))
             if (lines := _calls_cuda_is_available(p))}
    assert set(found) == {"accelerator.py"}, found


def test_simulation_sets_and_restores_the_decision(monkeypatch):
    monkeypatch.setenv(accelerator.CPU_SWITCH, "cpu")
    assert accelerator.device_type() == "cpu"
    with accelerator.simulate("cuda"):
        assert accelerator.device_type() == "cuda" and accelerator.on_cuda()
        assert not accelerator.cuda_runtime()  # a simulation has no generator states to read
        with accelerator.simulate("cpu"):
            assert accelerator.device_type() == "cpu"
        assert accelerator.device_type() == "cuda"
    assert accelerator.device_type() == "cpu"
    with pytest.raises(ValueError, match="'cuda' or 'cpu'"):
        with accelerator.simulate("tpu"):
            pass
