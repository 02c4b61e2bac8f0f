"""The GPT model as DeepSpeed pipeline layer specs, built either into a ``PipelineModule`` or into a
plain sequential module (pipeline parallel size 1, ``--no-pipeline-parallel``, reference tests).

Layers, in order: embedding, N transformer layers, final norm, output head. With tied embeddings
(the GPT-2 default) the embedding and the output head are two ``TiedLayerSpec`` s with one key:
DeepSpeed keeps a copy of the word embedding on the first and on the last stage, broadcasts the
first stage's weights to the last at start-up and all-reduces the two copies' gradients every step.

Between stages only the hidden state ``[s, b, h]`` travels (``[s/tp, b, h]`` under sequence
parallelism): causal attention needs no mask, rotary embeddings use positions 0..s-1 and learned
positions are added on the first stage. The one exception is ``reset_attention_mask``: then the
``[b, s]`` int64 document ids travel with it as ``(hidden, document_ids)``. DeepSpeed's pipeline
engine sends non-floating tensors of an activation tuple as they are and expects no gradient for
them, so this works at any pipeline size, at a cost of 8 bytes per token instead of a [b,1,s,s] mask.

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

import deepspeed
import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from torch import nn

from megatron_ds import ds_compat
from megatron_ds.accelerator import cuda_runtime
from megatron_ds.config.schema import ModelConfig
from megatron_ds.model.gpt import FinalNorm, GPTEmbedding, GPTOutputHead, gpt_loss_fn, tied_output_logits
from megatron_ds.model.moe_layer import experts_per_layer
from megatron_ds.model.transformer import ParallelTransformerLayer
from megatron_ds.parallel.random import checkpoint
from megatron_ds.parallel.partition import partition_stages
from megatron_ds.parallel.utils import tp_world_size

TRANSFORMER_LAYER_CLASS = ParallelTransformerLayer.__name__
PARTITION_METHOD = f"type:{TRANSFORMER_LAYER_CLASS}"
"""DeepSpeed partition method that balances stages by transformer layers (the config default)."""
TIED_EMBEDDING_KEY = "embed"
_TIED_WEIGHT_ATTR = "word_embeddings.weight"
_POSITION_TYPES = ("learned_absolute", "rope", "none")


def _check(model_cfg: ModelConfig, tp: int, padded_vocab_size: int, reset_attention_mask: bool,
           eod_token: int | None, recompute_granularity: str | None) -> None:
    """Reject what the layers cannot build, with one-line messages naming the values."""
    m = model_cfg
    unresolved = [name for name in ("num_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                                    "ffn_hidden_size", "kv_channels") if getattr(m, name) is None]
    if unresolved or m.position_embedding_type not in _POSITION_TYPES or m.normalization not in ("layernorm",
                                                                                                  "rmsnorm"):
        raise ValueError(f"model config is not resolved (missing {unresolved}, position type "
                         f"{m.position_embedding_type!r}, normalization {m.normalization!r}); pass it through "
                         f"megatron_ds.config.layout.resolve_model_config first")
    if m.position_embedding_type == "learned_absolute" and m.max_position_embeddings is None:
        raise ValueError("learned absolute positions need max_position_embeddings")
    if m.num_attention_heads % m.num_key_value_heads:
        raise ValueError(f"num_attention_heads {m.num_attention_heads} is not a multiple of "
                         f"num_key_value_heads {m.num_key_value_heads}")
    if reset_attention_mask and eod_token is None:
        raise ValueError("reset_attention_mask needs the tokenizer's end-of-document id (eod_token)")
    if recompute_granularity not in (None, "full", "selective"):
        raise ValueError(f"recompute_granularity must be None, 'full' or 'selective', got {recompute_granularity!r}")


def gpt_layer_specs(model_cfg: ModelConfig, *, padded_vocab_size: int, tp_group=None,
                    sequence_parallel: bool = False, params_dtype: torch.dtype = torch.float32, device=None,
                    reset_attention_mask: bool = False, eod_token: int | None = None,
                    recompute_granularity: str | None = None, vocab_size: int | None = None,
                    sp_group=None, ep_size: int = 1, ep_rank: int = 0, loss_report=None) -> list:
    """The GPT as a list of DeepSpeed layer specs (see the module docstring).

    ``model_cfg`` must be resolved (``resolve_model_config``). ``recompute_granularity="selective"``
    builds layers that recompute their attention core; ``"full"`` is a matter of the builder's
    ``activation_checkpoint_interval`` and changes nothing here. ``vocab_size`` (the real
    vocabulary, <= padded) makes the output layer mask the padding columns (``model/gpt.py``).
    ``sp_group``: DeepSpeed-Ulysses' sequence parallel group (the embedding and attention's; plain
    module only, ``build_sequential_gpt``). Mixture of experts (``model/moe_layer.py``): the layers
    ``experts_per_layer`` names hold this rank's share of their experts (``ep_size``, ``ep_rank``:
    ``ParallelState.expert_parallel_rank``); ``loss_report`` gets their dropped-route fractions.
    """
    m = model_cfg
    _check(m, tp_world_size(tp_group), padded_vocab_size, reset_attention_mask, eod_token, recompute_granularity)
    common = dict(tp_group=tp_group, sequence_parallel=sequence_parallel, params_dtype=params_dtype, device=device)
    embedding = dict(init_method_std=m.init_method_std, dropout=m.hidden_dropout,
                     fp32_residual=m.fp32_residual_connection, sp_group=sp_group,
                     async_grad_comm=m.async_tensor_model_parallel_allreduce, **common)
    fused_loss = m.liger_kernel  # liger's fused linear + cross entropy where it applies (model/liger.py)
    positions = m.max_position_embeddings if m.position_embedding_type == "learned_absolute" else None
    eod = eod_token if reset_attention_mask else None
    if vocab_size is not None and not 0 < vocab_size <= padded_vocab_size:
        raise ValueError(f"vocab_size {vocab_size} must be in (0, padded_vocab_size {padded_vocab_size}]")
    tied = not m.untie_embeddings_and_output_weights

    experts = experts_per_layer(m.num_experts, m.num_layers, m.expert_interval)
    moe = any(n > 1 for n in experts)
    if moe and tp_world_size(sp_group) > 1:
        raise ValueError("MoE layers do not combine with DeepSpeed-Ulysses sequence parallelism here")
    specs = []
    if tied:
        specs.append(TiedLayerSpec(TIED_EMBEDDING_KEY, GPTEmbedding, m.hidden_size, padded_vocab_size,
                                   max_position_embeddings=positions, eod_token=eod,
                                   tied_weight_attr=_TIED_WEIGHT_ATTR, vocab_size=vocab_size, fused_loss=fused_loss,
                                   **embedding))
    else:
        specs.append(LayerSpec(GPTEmbedding, m.hidden_size, padded_vocab_size, max_position_embeddings=positions,
                               eod_token=eod, **embedding))
    for i in range(m.num_layers):
        specs.append(LayerSpec(ParallelTransformerLayer, m, i + 1,
                               recompute_attention=recompute_granularity == "selective", sp_group=sp_group,
                               num_experts=experts[i], ep_size=ep_size, ep_rank=ep_rank, carry_moe_loss=moe,
                               loss_report=loss_report, **common))
    specs.append(LayerSpec(FinalNorm, m.normalization, m.hidden_size, m.layernorm_epsilon,
                           sequence_parallel=sequence_parallel, params_dtype=params_dtype, device=device,
                           one_plus=m.apply_layernorm_1p, fp32_input=m.fp32_residual_connection))
    if tied:
        # Built only on a last stage that does not also hold the embedding; that copy needs no
        # position table (its weights come from the first stage's broadcast anyway).
        specs.append(TiedLayerSpec(TIED_EMBEDDING_KEY, GPTEmbedding, m.hidden_size, padded_vocab_size,
                                   max_position_embeddings=None, forward_fn=tied_output_logits,
                                   tied_weight_attr=_TIED_WEIGHT_ATTR, vocab_size=vocab_size, fused_loss=fused_loss,
                                   **embedding))
    else:
        specs.append(LayerSpec(GPTOutputHead, m.hidden_size, padded_vocab_size, init_method_std=m.init_method_std,
                               vocab_size=vocab_size, fused_loss=fused_loss,
                               async_grad_comm=m.async_tensor_model_parallel_allreduce, **common))
    return specs


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


def _loss_fn(tp_group, sp_group=None, loss_report=None, moe_loss_coeff: float = 0.0):
    return functools.update_wrapper(functools.partial(gpt_loss_fn, tp_group=tp_group, sp_group=sp_group,
                                                      report=loss_report, moe_loss_coeff=moe_loss_coeff),
                                    gpt_loss_fn)


class GPTPipelineModel(PipelineModule):
    """A ``PipelineModule`` over GPT layer specs (not named GPTModelPipe on purpose: DeepSpeed
    special-cases that name's checkpointing and attention-mask handling)."""

    def __init__(self, specs: list, *, topology, tp_group, seed: int, partition_method: str = PARTITION_METHOD,
                 activation_checkpoint_interval: int = 0, loss_report=None, moe_loss_coeff: float = 0.0,
                 loss_fn=None):
        """``loss_fn``: another model family's loss (``families/bert/bert_model.py``); default the GPT's."""
        seeder = _LayerInitSeeder()
        # no_grad: DeepSpeed broadcasts the tied weights in place at the end of __init__; with
        # grad mode on, autograd records that collective on the parameter and warns in backward.
        with _restore_default_rng(), torch.no_grad():
            super().__init__(
                layers=specs, topology=topology,
                loss_fn=loss_fn or _loss_fn(tp_group, None, loss_report, moe_loss_coeff),
                seed_layers=True, seed_fn=seeder,
                base_seed=seed, partition_method=partition_method,
                activation_checkpoint_interval=activation_checkpoint_interval,
                # Ours replays the tensor parallel RNG stream too, so recomputed dropout is exact.
                activation_checkpoint_func=checkpoint)
        seeder.building = False

    @ds_compat.overrides_deepspeed_hook
    def _is_checkpointable(self, funcs) -> bool:
        """Recompute every chunk that holds a transformer layer. DeepSpeed's rule wants every
        member of a chunk checkpointable, so with --recompute-num-layers > 1 the chunks that also
        hold the embedding or the head would silently keep all their activations. Our checkpoint
        is non-reentrant, so integer inputs and parameter-free members inside a chunk are fine."""
        return any(isinstance(f, ParallelTransformerLayer) for f in funcs)


def build_pipeline_gpt(model_cfg: ModelConfig, topology, *, padded_vocab_size: int, tp_group, seed: int,
                       activation_checkpoint_interval: int = 0, partition_method: str = PARTITION_METHOD,
                       loss_report=None, **spec_kwargs) -> GPTPipelineModel:
    """The GPT as a DeepSpeed ``PipelineModule``. ``topology`` must be the same
    ``PipeModelDataParallelTopology`` the process groups (``tp_group``) were built from.
    ``spec_kwargs`` go to ``gpt_layer_specs`` (sequence_parallel, params_dtype, device,
    reset_attention_mask, eod_token, recompute_granularity). ``loss_report``: the
    ``megatron_ds.model.loss_report.LossReport`` the loss function reports to (None: none)."""
    specs = gpt_layer_specs(model_cfg, padded_vocab_size=padded_vocab_size, tp_group=tp_group,
                            loss_report=loss_report, **spec_kwargs)
    return GPTPipelineModel(specs, topology=topology, tp_group=tp_group, seed=seed,
                            partition_method=partition_method,
                            activation_checkpoint_interval=activation_checkpoint_interval, loss_report=loss_report,
                            moe_loss_coeff=model_cfg.moe_loss_coeff)


class GPTSequential(nn.Module):
    """The same layer specs built into one module, seeded exactly as ``GPTPipelineModel`` seeds them.

    Submodule names match the PipelineModule's (``"<layer index>.<...>"``, tied modules under
    ``tied_modules.embed``), so state dicts line up key for key. ``forward((tokens, position_ids))``
    returns the vocab-parallel logits ``[b, s, V/tp]``; ``loss_fn(logits, (labels, loss_mask))``.

    ``activation_checkpoint_interval > 0`` recomputes runs of that many consecutive transformer
    layers in backward (full recompute). ``layer_indices`` builds only those specs (a chunk of the
    interleaved schedule, ``megatron_ds.pipeline.chunks``), seeded and named by their index.
    """

    def __init__(self, specs: list, *, tp_group=None, seed: int, activation_checkpoint_interval: int = 0,
                 layer_indices=None, sp_group=None, loss_report=None, moe_loss_coeff: float = 0.0, loss_fn=None):
        super().__init__()
        self.tied_modules = nn.ModuleDict()
        # loss_fn: another family's loss (families/bert/bert_model.py), else the GPT's
        self.loss_fn = loss_fn or _loss_fn(tp_group, sp_group, loss_report, moe_loss_coeff)
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


def build_stage_gpt(model_cfg: ModelConfig, *, num_stages: int, stage: int, padded_vocab_size: int, tp_group=None,
                    seed: int, partition_method: str = PARTITION_METHOD, activation_checkpoint_interval: int = 0,
                    **spec_kwargs) -> GPTSequential:
    """The modules pipeline stage ``stage`` of ``build_pipeline_gpt``'s model holds (tied copy
    included), from the same specs, seeds and partition, as one ``GPTSequential`` that needs no
    topology, DeepSpeed communication backend or accelerator: ``PipelineModule`` moves itself to
    the accelerator, so it cannot stay on the meta device, where --dry-run builds each stage.
    The "parameters" method builds every spec once more to weigh it, as DeepSpeed does."""
    specs = gpt_layer_specs(model_cfg, padded_vocab_size=padded_vocab_size, tp_group=tp_group, **spec_kwargs)
    return stage_of_specs(specs, num_stages=num_stages, stage=stage, tp_group=tp_group, seed=seed,
                          partition_method=partition_method,
                          activation_checkpoint_interval=activation_checkpoint_interval,
                          moe_loss_coeff=model_cfg.moe_loss_coeff)


def stage_of_specs(specs: list, *, num_stages: int, stage: int, tp_group=None, seed: int,
                   partition_method: str = PARTITION_METHOD, activation_checkpoint_interval: int = 0,
                   loss_fn=None, moe_loss_coeff: float = 0.0) -> GPTSequential:
    """Pipeline stage ``stage`` of any model's layer specs, partitioned and seeded as DeepSpeed's
    ``PipelineModule`` would (``build_stage_gpt``; other model families, ``families/bert/bert_model.py``)."""
    parts = partition_stages(num_stages, partition_method, [_spec_name(spec) for spec in specs],
                             lambda: [_trainable_parameters(spec) for spec in specs])
    return GPTSequential(specs, tp_group=tp_group, seed=seed, layer_indices=range(parts[stage], parts[stage + 1]),
                         activation_checkpoint_interval=activation_checkpoint_interval, loss_fn=loss_fn,
                         moe_loss_coeff=moe_loss_coeff)


def build_sequential_gpt(model_cfg: ModelConfig, *, padded_vocab_size: int, tp_group=None, seed: int,
                         activation_checkpoint_interval: int = 0, sp_group=None, loss_report=None,
                         **spec_kwargs) -> GPTSequential:
    """The GPT as one plain module (PP = 1, ``--no-pipeline-parallel``, references); same weights
    as ``build_pipeline_gpt`` with the same seed (at any DeepSpeed-Ulysses ``sp_group``).
    ``spec_kwargs`` and ``loss_report`` as for ``build_pipeline_gpt``."""
    specs = gpt_layer_specs(model_cfg, padded_vocab_size=padded_vocab_size, tp_group=tp_group, sp_group=sp_group,
                            loss_report=loss_report, **spec_kwargs)
    return GPTSequential(specs, tp_group=tp_group, seed=seed, sp_group=sp_group,
                         activation_checkpoint_interval=activation_checkpoint_interval, loss_report=loss_report,
                         moe_loss_coeff=model_cfg.moe_loss_coeff)
