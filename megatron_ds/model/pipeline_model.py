"""A model given as DeepSpeed layer specs, built either into a ``PipelineModule`` (``PipelineModel``)
or into one plain module (``SequentialModel``: pipeline parallel size 1, ``--no-pipeline-parallel``, a
pipeline stage on the meta device, inference, reference tests), with the same weights and state-dict
names either way. Every model family lists its layers as specs (``ModelFamily.layer_specs``: the
GPT's in ``families/gpt/gpt_model.py``) and builds them here, with its own loss function.

Tied layers (``TiedLayerSpec``, e.g. the word embedding the output layer reuses) are built once per
key: DeepSpeed keeps a copy on each stage that uses one, broadcasts the first stage's weights to the
others at start-up and all-reduces the copies' gradients every step.

Initialization: layer ``i`` of the spec list is built right after seeding the generators with
``seed + i`` (DeepSpeed's ``seed_layers``), so its weights depend only on its index, not on which
stage builds it: PP=1 and PP=N models start identical. DeepSpeed would also reseed before every
layer's *forward* (``base_seed * micro_batch + layer``), which gives correlated or repeated dropout
masks for small seeds; our seed function therefore acts only while the layers are built, and the
caller's generator state is restored afterwards, so dropout draws from the streams the training
loop seeded (``megatron_ds.parallel.random.set_parallel_seeds``).

With tensor and pipeline parallelism together, DeepSpeed by default splits each activation over
the tensor parallel ranks before sending it ("pipe_partitioned"). That assumes every TP rank holds
the same activation, which is false under sequence parallelism: ``megatron_ds.config.deepspeed_json``
turns it off in the DeepSpeed JSON then.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Callable

import deepspeed
import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from torch import nn

from megatron_ds import ds_compat
from megatron_ds.accelerator import cuda_runtime
from megatron_ds.model.transformer import ParallelTransformerLayer
from megatron_ds.parallel.partition import EXPLICIT, TRANSFORMER_LAYER, partition_stages
from megatron_ds.parallel.random import checkpoint

TRANSFORMER_LAYER_CLASS = ParallelTransformerLayer.__name__
assert TRANSFORMER_LAYER_CLASS == TRANSFORMER_LAYER  # what parallel/partition.py's "layers:" counts
PARTITION_METHOD = f"type:{TRANSFORMER_LAYER_CLASS}"
"""DeepSpeed partition method that balances stages by transformer layers (the config default)."""
TIED_EMBEDDING_KEY = "embed"


class _LayerInitSeeder:
    """``seed_fn`` for PipelineModule: seed torch with ``base_seed + layer index`` while layers are
    being built; a no-op afterwards (DeepSpeed also calls it before each layer's forward)."""

    __name__ = "seed_layer_init"

    def __init__(self):
        self.building = True

    def __call__(self, seed: int) -> None:
        if self.building:
            torch.manual_seed(seed)


@contextlib.contextmanager
def _restore_default_rng():
    """Building seeds the default generators per layer; give the caller's state back afterwards."""
    # Only a CUDA generator already in use: asking for the current device would create a CUDA
    # context on GPU 0 in a CPU run (DS_ACCELERATOR=cpu) on a GPU machine.
    devices = [torch.cuda.current_device()] if cuda_runtime() else []
    with torch.random.fork_rng(devices=devices):
        yield


class PipelineModel(PipelineModule):
    """A ``PipelineModule`` over a model family's layer specs (not named GPTModelPipe on purpose:
    DeepSpeed special-cases that name's checkpointing and attention-mask handling)."""

    def __init__(self, specs: list, *, topology, loss_fn: Callable, seed: int,
                 partition_method: str = PARTITION_METHOD, activation_checkpoint_interval: int = 0):
        """``loss_fn(output, labels)``: the family's loss (e.g. ``language_model.language_model_loss_fn``)."""
        # read by _partition_layers, inside super().__init__
        object.__setattr__(self, "spec_names", [_spec_name(spec) for spec in specs])
        seeder = _LayerInitSeeder()
        # no_grad: DeepSpeed broadcasts the tied weights in place at the end of __init__; with
        # grad mode on, autograd records that collective on the parameter and warns in backward.
        with _restore_default_rng(), torch.no_grad():
            super().__init__(
                layers=specs, topology=topology,
                loss_fn=loss_fn,
                seed_layers=True, seed_fn=seeder,
                base_seed=seed, partition_method=partition_method,
                activation_checkpoint_interval=activation_checkpoint_interval,
                # Ours replays the tensor parallel RNG stream too, so recomputed dropout is exact.
                activation_checkpoint_func=checkpoint)
        seeder.building = False

    @ds_compat.overrides_deepspeed_hook
    def _partition_layers(self, method: str = "uniform") -> None:
        """DeepSpeed's partition, and ours of "layers:N1,...,Np" (parallel/partition.py), which it lacks."""
        if not method.lower().startswith(EXPLICIT):
            return super()._partition_layers(method)
        ds_compat.set_pipeline_partition(self, partition_stages(self.num_stages, method, self.spec_names, None))

    @ds_compat.overrides_deepspeed_hook
    def _is_checkpointable(self, funcs) -> bool:
        """Recompute every chunk that holds a transformer layer. DeepSpeed's rule wants every
        member of a chunk checkpointable, so with --recompute-num-layers > 1 the chunks that also
        hold the embedding or the head would silently keep all their activations. Our checkpoint
        is non-reentrant, so integer inputs and parameter-free members inside a chunk are fine."""
        return any(isinstance(f, ParallelTransformerLayer) for f in funcs)


class SequentialModel(nn.Module):
    """The same layer specs built into one module, seeded exactly as ``PipelineModel`` seeds them.

    Submodule names match the PipelineModule's (``"<layer index>.<...>"``, tied modules under
    ``tied_modules.embed``), so state dicts line up key for key. ``forward(inputs)`` runs the layers in
    order (a GPT: ``(tokens, position_ids)`` -> vocab-parallel logits ``[b, s, V/tp]``); ``loss_fn`` is
    the family's loss (None: a model that is only run forward, e.g. for inference).

    ``activation_checkpoint_interval > 0`` recomputes runs of that many consecutive transformer
    layers in backward (full recompute). ``layer_indices`` builds only those specs (a chunk of the
    interleaved schedule, ``megatron_ds.pipeline.chunks``), seeded and named by their index.
    """

    def __init__(self, specs: list, *, seed: int, loss_fn: Callable | None = None,
                 activation_checkpoint_interval: int = 0, layer_indices=None):
        super().__init__()
        self.tied_modules = nn.ModuleDict()
        self.loss_fn = loss_fn
        self.activation_checkpoint_interval = activation_checkpoint_interval
        # the built layers in order, public under the name DeepSpeed's PipelineModule gives its list
        self.forward_funcs: list = []
        # Per spec: (class name, tied key or None, parameters a stage building this spec first holds).
        self._layer_info: list[tuple[str, str | None, int]] = []
        with _restore_default_rng():
            # layer_indices: build only those specs (a model chunk of the interleaved schedule)
            for idx in range(len(specs)) if layer_indices is None else layer_indices:
                torch.manual_seed(seed + idx)  # as _LayerInitSeeder does for layer idx
                self.forward_funcs.append(self._build(idx, specs[idx]))

    def _build(self, idx: int, spec):
        if isinstance(spec, TiedLayerSpec):
            new = spec.key not in self.tied_modules
            if new:
                self.tied_modules[spec.key] = spec.build()
            module = self.tied_modules[spec.key]
            tied_weights = [_getattr_path(module, attr) for attr in spec.tied_weight_attr]
            # A later spec of the key (the output layer) is built on its own only on a stage
            # without the embedding, and that copy holds just the tied weights.
            count = sum(p.numel() for p in (module.parameters() if new else tied_weights))
            self._layer_info.append((spec.typename.__name__, spec.key, count))
            if spec.forward_fn is None:
                return module
            # The output layer reads the word embedding outside the embedding's own forward;
            # ZeRO-3 (--no-pipeline-parallel) must keep it gathered for this module's forward.
            for weight in tied_weights:
                deepspeed.zero.register_external_parameter(self, weight)
            return functools.partial(spec.forward_fn, module)
        module = spec.build() if isinstance(spec, LayerSpec) else spec
        if isinstance(module, nn.Module):
            self.add_module(str(idx), module)
            self._layer_info.append((type(module).__name__, None, sum(p.numel() for p in module.parameters())))
        else:
            self._layer_info.append((getattr(module, "__name__", ""), None, 0))
        return module

    def forward(self, inputs):
        x = inputs
        funcs, i = self.forward_funcs, 0
        recompute = self.activation_checkpoint_interval > 0 and torch.is_grad_enabled()
        while i < len(funcs):
            if recompute and isinstance(funcs[i], ParallelTransformerLayer):
                j = i
                while (j < len(funcs) and j - i < self.activation_checkpoint_interval
                       and isinstance(funcs[j], ParallelTransformerLayer)):
                    j += 1
                x = checkpoint(_run_layers(funcs[i:j]), *(x if isinstance(x, tuple) else (x,)))
                i = j
            else:
                x = funcs[i](x)
                i += 1
        return x

    def stage_parameter_counts(self, num_stages: int, partition_method: str = PARTITION_METHOD) -> list[int]:
        """Parameters each stage of a ``num_stages`` pipeline of this model holds (on one tensor
        parallel rank), partitioned as DeepSpeed partitions it, tied copies included (DeepSpeed's
        "STAGE_PARAMS"). For checking the analytic count of ``megatron_ds.config.layout``."""
        parts = partition_stages(num_stages, partition_method, [name for name, _, _ in self._layer_info],
                                 lambda: [count for _, _, count in self._layer_info])
        counts = []
        for stage in range(num_stages):
            built, total = set(), 0
            for _, key, count in self._layer_info[parts[stage]:parts[stage + 1]]:
                if key is None or key not in built:  # a stage builds each tied module once
                    total += count
                    built.add(key)
            counts.append(total)
        return counts


def _spec_name(spec) -> str | None:
    """The name DeepSpeed matches a "type:" method against (``PipelineModule._find_layer_type``)."""
    if isinstance(spec, LayerSpec):
        return spec.typename.__name__
    if isinstance(spec, nn.Module):
        return type(spec).__name__
    return getattr(spec, "__name__", None)


def _trainable_parameters(spec) -> int:
    """What DeepSpeed's "parameters" method weighs a spec by (``PipelineModule._count_layer_params``:
    each spec built on its own, a tied output layer included)."""
    module = spec.build() if isinstance(spec, LayerSpec) else spec
    if not isinstance(module, nn.Module):
        return 0
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def _getattr_path(obj, path: str):
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _run_layers(layers):
    def run(*args):
        x = args[0] if len(args) == 1 else args
        for layer in layers:
            x = layer(x)
        return x
    return run


def stage_of_specs(specs: list, *, num_stages: int, stage: int, seed: int, partition_method: str = PARTITION_METHOD,
                   activation_checkpoint_interval: int = 0, loss_fn: Callable | None = None) -> SequentialModel:
    """The modules pipeline stage ``stage`` of a ``PipelineModel`` of ``specs`` holds (tied copy
    included), from the same specs, seeds and partition, as one ``SequentialModel`` that needs no
    topology, DeepSpeed communication backend or accelerator: ``PipelineModule`` moves itself to
    the accelerator, so it cannot stay on the meta device, where --dry-run builds each stage.
    The "parameters" method builds every spec once more to weigh it, as DeepSpeed does."""
    parts = partition_stages(num_stages, partition_method, [_spec_name(spec) for spec in specs],
                             lambda: [_trainable_parameters(spec) for spec in specs])
    return SequentialModel(specs, seed=seed, layer_indices=range(parts[stage], parts[stage + 1]),
                           activation_checkpoint_interval=activation_checkpoint_interval, loss_fn=loss_fn)
