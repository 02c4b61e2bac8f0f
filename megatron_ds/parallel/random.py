"""Random number streams for tensor parallelism, and activation checkpointing that replays them.

Two kinds of randomness live in a tensor-parallel model:
- outside the tensor-parallel regions activations are replicated, so dropout there must draw the
  *same* mask on every tensor-parallel rank: the default generators get the same seed everywhere;
- inside them (e.g. attention probabilities, split by head) each rank holds different data, and
  the masks must differ: `get_rng_tracker().fork()` switches to the "tensor-parallel-rng" stream,
  seeded differently per tensor-parallel rank.

The tracker keeps each named stream's CPU generator state and, once CUDA is in use, the current
device's CUDA generator state, so the same model code is right on CPU and on GPU.
"""
from __future__ import annotations

import contextlib
import random

import numpy as np
import torch
import torch.utils.checkpoint

# CUDA generator states only once something initialized CUDA (cuda_runtime): a CPU run on a GPU
# machine must not create CUDA contexts just to keep generator states nobody draws from.
from megatron_ds.accelerator import cuda_runtime

TENSOR_PARALLEL_RNG = "tensor-parallel-rng"
# Offset of the tensor-parallel stream's seed from the default seed (Megatron's value, kept so
# runs seeded alike draw alike).
_TENSOR_PARALLEL_SEED_OFFSET = 2718


def _cuda_state_from_seed(seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda")  # the current device, which is this rank's GPU
    gen.manual_seed(seed)
    return gen.get_state()


class RNGStatesTracker:
    """Named generator states. `fork(name)` runs a block on that stream and saves where it stopped,
    leaving the default generators as they were. A stream's CUDA state is created from its seed the
    first time it is forked with CUDA in use."""

    def __init__(self):
        self._states: dict[str, dict] = {}

    def reset(self) -> None:
        self._states.clear()

    def names(self) -> list[str]:
        return list(self._states)

    def add(self, name: str, seed: int) -> None:
        if name in self._states:
            raise ValueError(f"RNG stream {name!r} already exists (call reset() first to re-seed)")
        if any(state["seed"] == seed for state in self._states.values()):
            raise ValueError(f"seed {seed} is already used by another RNG stream; streams must differ")
        cpu = torch.Generator()  # a private generator: adding a stream must not disturb the default
        cpu.manual_seed(seed)
        cuda = _cuda_state_from_seed(seed) if cuda_runtime() else None
        self._states[name] = {"seed": seed, "cpu": cpu.get_state(), "cuda": cuda}

    def get_states(self) -> dict[str, dict]:
        """A copy of every stream ({name: {"seed", "cpu", "cuda"}}), for checkpoints and replays."""
        return _copy_states(self._states)

    def set_states(self, states: dict[str, dict]) -> None:
        """Replace all streams by `states` (as returned by get_states)."""
        self._states = _copy_states(states)

    @contextlib.contextmanager
    def rewound(self):
        """Run a block, then put every stream back where it was before it (a compiler's probe run:
        its dropout draws are not the model's). In place, so a ``fork`` open around the block still
        saves its stream into the tracker when it ends."""
        saved = self.get_states()
        try:
            yield
        finally:
            for name, state in saved.items():
                self._states[name].update(state)

    @contextlib.contextmanager
    def fork(self, name: str = TENSOR_PARALLEL_RNG):
        if name not in self._states:
            raise KeyError(f"RNG stream {name!r} was never added; call set_parallel_seeds() first")
        state = self._states[name]
        use_cuda = cuda_runtime()
        if use_cuda and state["cuda"] is None:
            state["cuda"] = _cuda_state_from_seed(state["seed"])
        saved_cpu = torch.get_rng_state()
        saved_cuda = torch.cuda.get_rng_state() if use_cuda else None
        torch.set_rng_state(state["cpu"])
        if use_cuda:
            torch.cuda.set_rng_state(state["cuda"])
        try:
            yield
        finally:
            state["cpu"] = torch.get_rng_state()
            torch.set_rng_state(saved_cpu)
            if use_cuda:
                state["cuda"] = torch.cuda.get_rng_state()
                torch.cuda.set_rng_state(saved_cuda)


def _copy_states(states: dict[str, dict]) -> dict[str, dict]:
    return {name: {key: _copy_state(key, value) for key, value in state.items()} for name, state in states.items()}


def _copy_state(key: str, value):
    if key == "cpu":
        # Copied by a generator rather than by clone(): no tensor op, so the copy stays a real host
        # tensor even under a fake-tensor mode (megatron_ds.fake_cuda), which would make clone()
        # return a fake tensor that no generator can be set from.
        gen = torch.Generator()
        gen.set_state(value)
        return gen.get_state()
    return value.clone() if isinstance(value, torch.Tensor) else value


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    """The process-wide tracker the model's dropout layers fork from."""
    return _TRACKER


def set_parallel_seeds(seed: int, tp_rank: int) -> None:
    """Seed Python, NumPy and torch (CPU and CUDA) with `seed` (identical on all tensor-parallel
    ranks) and the tracker's tensor-parallel stream with `seed + 2718 + tp_rank` (different per rank).
    Callers that want pipeline stages to differ add an offset per stage to `seed` themselves."""
    if seed < 0:
        raise ValueError(f"seed must be non-negative, got {seed}")
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device (lazily when CUDA is not initialized)
    _TRACKER.reset()
    _TRACKER.add(TENSOR_PARALLEL_RNG, seed + _TENSOR_PARALLEL_SEED_OFFSET + tp_rank)


def _replay_tracker_contexts():
    """Contexts for torch.utils.checkpoint: remember the tracker's streams when the forward starts,
    and run the recomputation from exactly there, so its dropout masks equal the forward's; after
    the recomputation the streams continue where they were."""
    tracker = get_rng_tracker()
    at_forward = tracker.get_states()

    @contextlib.contextmanager
    def recompute():
        current = tracker.get_states()
        tracker.set_states(at_forward)
        try:
            yield
        finally:
            tracker.set_states(current)

    return contextlib.nullcontext(), recompute()


def checkpoint(function, *args):
    """Activation checkpointing: run `function(*args)` without keeping its intermediate
    activations and recompute them in backward. torch replays the default CPU/CUDA generators
    (preserve_rng_state); the context replays the tracker's streams, so gradients are bit-identical
    to running without checkpointing. Non-tensor arguments and tensors that do not require grad are
    fine (non-reentrant checkpointing). Usable as a PipelineModule's `activation_checkpoint_func`."""
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, preserve_rng_state=True,
                                             context_fn=_replay_tracker_contexts)


def rng_state() -> dict:
    """Every random generator of this process (Python, NumPy, torch CPU, the tracker's streams, CUDA
    when in use): what a checkpoint saves per rank to resume exactly."""
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        # numpy's state as tensors so the checkpoint stays loadable with weights_only=True
        "numpy": (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]),
        "torch": torch.get_rng_state(),
        "tracker": get_rng_tracker().get_states(),
    }
    if cuda_runtime():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    """Restore ``rng_state()``'s generators."""
    random.setstate(_to_tuple(state["python"]))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    get_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and cuda_runtime():
        torch.cuda.set_rng_state(state["cuda"])


def _to_tuple(x):
    return tuple(_to_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x
