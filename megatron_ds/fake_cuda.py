"""Run the CUDA code paths on a CPU-only torch: fake tensors on device ``cuda``.

``torch._subclasses.fake_tensor.FakeTensorMode`` creates tensors on ``cuda`` without a GPU and runs
their shapes, dtypes and devices through every op (a CPU tensor mixed into a CUDA computation
raises ``FakeTensorDeviceMismatchError``: a device-placement check for free). A CPU build of torch
lacks two things that stop it at the first autograd-recorded op and at the first pinned copy:
a CUDA device guard and CUDA hooks. ``preload()`` compiles a small C++ library that registers
both with c10 (a guard that is always on device 0; hooks that report CUDA while ``activate()`` is
in force, and hand out CPU memory as pinned memory, so the DataLoader's pin-memory thread runs
its real copy). torch reads its CUDA hooks once, on first use, so the
library must be loaded before ``import torch``: the test session's conftest and
``bench/kernel_budget.py`` call ``preload()`` first thing. A CUDA build of torch needs none of it.

What stays different from a GPU (correct for it where it matters): with no CUDA kernels
registered, ops that have a CUDA kernel and a composite fallback decompose (``_fused_rms_norm``,
``silu_backward``...), SDPA takes the math path, and ``torch.autocast("cuda")`` is off unless enabled
explicitly, and ``torch.cuda.is_available()`` stays False (``megatron_ds.accelerator``, which the
package asks, says "cuda" while ``cuda_present()`` is in force). The other device queries
(``device_count``, capability...) are answered as one H100 would then.
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import gc
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

SHIM_SOURCE = r"""
#include <mutex>
#include <unordered_set>
#include <c10/core/Allocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <ATen/detail/CUDAHooksInterface.h>

static bool fake_cuda_on = false;
extern "C" void megatron_ds_fake_cuda(int on) { fake_cuda_on = on != 0; }

namespace {
// Every "CUDA" tensor lives on device 0 of one default stream: enough for autograd's engine,
// which sets the device and records streams around each backward function.
struct FakeCudaGuard final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return c10::DeviceType::CUDA; }
  c10::Device exchangeDevice(c10::Device) const override { return c10::Device(c10::DeviceType::CUDA, 0); }
  c10::Device getDevice() const override { return c10::Device(c10::DeviceType::CUDA, 0); }
  void setDevice(c10::Device) const override {}
  void uncheckedSetDevice(c10::Device) const noexcept override {}
  c10::Stream getStream(c10::Device d) const noexcept override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream exchangeStream(c10::Stream s) const noexcept override { return s; }
  c10::DeviceIndex deviceCount() const noexcept override { return 1; }
};
C10_REGISTER_GUARD_IMPL(CUDA, FakeCudaGuard);

// "Pinned" host memory: plain CPU memory whose pointers are remembered, so is_pinned() is true for
// exactly what pin_memory() returned and pin_memory() makes its real copy (the path a GPU run takes).
std::mutex pinned_mutex;
std::unordered_set<const void*> pinned;
void free_pinned(void* p) {
  { std::lock_guard<std::mutex> lock(pinned_mutex); pinned.erase(p); }
  c10::free_cpu(p);
}
struct FakePinnedAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    void* p = c10::alloc_cpu(n);
    { std::lock_guard<std::mutex> lock(pinned_mutex); pinned.insert(p); }
    return {p, p, &free_pinned, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &free_pinned; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};
FakePinnedAllocator pinned_allocator;
}  // namespace

namespace at {
// Present only while activated: outside, the process behaves as a plain CPU build.
struct FakeCudaHooks final : CUDAHooksInterface {
  FakeCudaHooks(CUDAHooksArgs) {}
  void init() const override {}
  bool isBuilt() const override { return fake_cuda_on; }
  bool isAvailable() const override { return fake_cuda_on; }
  bool hasCUDA() const override { return fake_cuda_on; }
  int getNumGPUs() const override { return fake_cuda_on ? 1 : 0; }
  bool hasPrimaryContext(DeviceIndex) const override { return fake_cuda_on; }
  DeviceIndex current_device() const override { return 0; }
  Allocator* getPinnedMemoryAllocator() const override { return &pinned_allocator; }
  bool isPinnedPtr(const void* p) const override {
    std::lock_guard<std::mutex> lock(pinned_mutex);
    return pinned.count(p) > 0;
  }
};
C10_REGISTER_TYPED_CLASS(CUDAHooksRegistry, "CUDAHooks", FakeCudaHooks);
}  // namespace at
"""

_state: dict[str, object] = {}  # "lib": the loaded library, or "why": why there is none


def _torch_dir() -> Path:
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        raise RuntimeError("torch is not installed")
    return Path(spec.origin).parent


def cuda_build(torch_dir: Path | None = None) -> bool:
    """Whether the installed torch is a CUDA build (it has a real guard and hooks of its own)."""
    return any((torch_dir or _torch_dir()).glob("lib/libtorch_cuda*.so"))


def _build(torch_dir: Path) -> Path:
    """The shim compiled against this torch, cached by torch's library and the source."""
    digest = hashlib.sha256(SHIM_SOURCE.encode())
    lib_dir = torch_dir / "lib"
    digest.update(str((lib_dir / "libtorch_cpu.so").stat().st_mtime_ns).encode())
    cache = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
    out = cache / "megatron_ds_fake_cuda" / f"shim-{digest.hexdigest()[:16]}.so"
    if out.exists():
        return out
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++) on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    src = out.with_suffix(".cpp")
    src.write_text(SHIM_SOURCE)
    include = torch_dir / "include"
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    cmd = [compiler, "-O1", "-std=c++17", "-shared", "-fPIC", "-w", f"-I{include}",
           f"-I{include / 'torch' / 'csrc' / 'api' / 'include'}", str(src), f"-L{lib_dir}", "-lc10",
           "-ltorch_cpu", f"-Wl,-rpath,{lib_dir}", "-o", str(tmp)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"compiling the shim failed: {done.stderr.strip()[-400:]}")
    os.replace(tmp, out)  # atomic: a parallel session sees the whole library or none
    return out


def preload() -> str | None:
    """Load the shim if this torch needs it; call before ``import torch``. None when fake CUDA
    works (now, or with a CUDA build of torch), else the reason it cannot."""
    if "why" in _state or "lib" in _state:
        return _state.get("why")
    try:
        torch_dir = _torch_dir()
        if cuda_build(torch_dir):
            _state["lib"] = None
            return None
        if "torch" in sys.modules:
            raise RuntimeError("torch was imported before the shim: torch reads its CUDA hooks once")
        for name in ("libc10.so", "libtorch_cpu.so"):  # what the shim links against, loaded globally first
            ctypes.CDLL(str(torch_dir / "lib" / name), mode=ctypes.RTLD_GLOBAL)
        _state["lib"] = ctypes.CDLL(str(_build(torch_dir)), mode=ctypes.RTLD_GLOBAL)
    except (OSError, RuntimeError) as exc:
        _state["why"] = f"fake CUDA unavailable: {exc}"
    return _state.get("why")


def unavailable() -> str | None:
    """Why fake-CUDA tensors cannot run here (None: they can)."""
    if "why" in _state:
        return str(_state["why"])
    if "lib" not in _state:
        return "fake CUDA unavailable: megatron_ds.fake_cuda.preload() was not called before import torch"
    return None


# What a CPU build of torch cannot answer about "its GPU", answered as one H100 would be.
# Not is_available: FakeTensorMode would then run ops on real CPU tensors for real, on "cuda".
_H100 = {"device_count": lambda: 1, "current_device": lambda: 0, "set_device": lambda device: None,
         "init": lambda: None,
         "synchronize": lambda device=None: None, "is_bf16_supported": lambda including_emulation=True: True,
         "get_device_capability": lambda device=None: (9, 0), "get_device_name": lambda device=None: "fake H100"}


@contextlib.contextmanager
def cuda_present() -> Iterator[None]:
    """One GPU, as far as this process can tell, without fake tensors: the shim's hooks report it
    (on a CPU build), ``torch.cuda``'s device queries answer as one H100 would, and the package's
    device decision is "cuda". Real CPU tensors then take the CUDA paths that need no CUDA tensor,
    such as ``Tensor.pin_memory()`` (a real copy into "pinned" memory)."""
    why = unavailable()
    if why is not None:
        raise RuntimeError(why)
    import torch  # noqa: PLC0415  (only after preload)

    from megatron_ds import accelerator  # noqa: PLC0415

    lib = _state["lib"]
    saved = {name: getattr(torch.cuda, name) for name in _H100}
    if lib is not None:
        lib.megatron_ds_fake_cuda(1)
        for name, answer in _H100.items():
            setattr(torch.cuda, name, answer)
    try:
        with accelerator.simulate("cuda"):
            yield
    finally:
        for name, original in saved.items():
            setattr(torch.cuda, name, original)
        if lib is not None:
            lib.megatron_ds_fake_cuda(0)


@contextlib.contextmanager
def activate(*, allow_non_fake_inputs: bool = True) -> Iterator[object]:
    """``cuda_present()`` plus fake tensors: ``torch.*(device="cuda")`` and every op on them run on
    fake tensors. Yields the ``FakeTensorMode``."""
    with cuda_present():
        import torch  # noqa: PLC0415
        from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: PLC0415

        # Fake tensors left in reference cycles must be freed before the interpreter finalizes: the
        # collection at exit races the autograd engine's "CUDA" device thread, which then aborts the
        # process (seen as rc 134 after all went well).
        atexit.unregister(gc.collect)  # registered once however often activated
        atexit.register(gc.collect)
        with FakeTensorMode(allow_non_fake_inputs=allow_non_fake_inputs) as mode:
            swap = torch.utils.swap_tensors
            torch.utils.swap_tensors = functools.partial(_swap_fake, swap, mode)
            # copy.deepcopy of a module with fake parameters (even an nn.Linear; DeepSpeed's MoE copies
            # its expert once per local expert) copies the mode too: the copies would belong to
            # another mode (which mixing refuses) whose memo holds weak references to every tensor
            # of this one (which Module.to's swap refuses). One mode, as one device.
            own = vars(FakeTensorMode).get("__deepcopy__")
            FakeTensorMode.__deepcopy__ = _same_mode
            try:
                yield mode
            finally:
                torch.utils.swap_tensors = swap
                if own is None:
                    del FakeTensorMode.__deepcopy__
                else:  # an enclosing activate()'s, or torch's own
                    FakeTensorMode.__deepcopy__ = own


def _same_mode(mode, memo):
    return mode


def _swap_fake(swap, mode, t1, t2) -> None:
    """``Module.to()`` swaps every fake parameter for its converted twin, and ``swap_tensors``
    refuses a tensor that something holds a weak reference to: the fake mode's own memo of the
    tensors it made (a ``detach``, which ``nn.Parameter`` calls, is memoised). Forgetting the two
    tensors first lets ``.to()`` of a fake module work, as it does for real tensors."""
    memo = mode.fake_tensor_converter.meta_converter.tensor_memo
    for key in [k for k, v in list(memo.items()) if v is t1 or v is t2]:
        del memo[key]
    swap(t1, t2)
