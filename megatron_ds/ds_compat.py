"""Every DeepSpeed (and torch) internal megatron_ds relies on, behind one version check.

DeepSpeed's public API (``deepspeed.initialize``, ``deepspeed.pipe``, ``deepspeed.zero``,
``safe_set_full_*``, ``deepspeed.comm``, the accelerator) is used where it is needed. What is not
public -- engine and optimizer attributes, underscore methods, classes under ``deepspeed.runtime``,
hooks our subclasses override -- is reached only through the names below, each commented with the
DeepSpeed attribute it relies on and the releases it was checked against. ``check_deepspeed()``
runs once at start-up (training, dry runs, the universal-checkpoint converter): a DeepSpeed outside
``TESTED`` or one that lost a hook listed here fails there, with one message, instead of at the
first use or -- for an overridden hook that was renamed -- silently never.

Import cost: ``deepspeed`` is imported only when a function here is called or a name of
``_INTERNAL_NAMES`` is first looked up, so importing this module stays cheap.
"""
from __future__ import annotations

import contextlib
import importlib
import inspect

import torch
import torch.distributed as dist

from megatron_ds.errors import ConfigError

# setup.py's "deepspeed>=0.16,<0.20"; CI and the test suite run 0.19.x.
TESTED = ("0.16", "0.20")
# The interleaved pipeline schedule mirrors where 0.19 applies the fp16 loss scale (loss_scale
# below); older releases scale in FP16_Optimizer.backward, so it is refused there.
INTERLEAVED_MINIMUM = "0.19"
# DeepSpeed 0.18.3 (its PyTorch-compatible backward, PR #7665) made engine.backward apply a loss scale only
# through a ZeRO optimizer's scale_if_loss: the fp16 optimizers of ZeRO 0 (FP16_Optimizer,
# FP16_UnfusedOptimizer), which the plain and the pipeline engine build for --fp16 without ZeRO, get the
# loss unscaled, yet their step() still divides the gradients by the scale. Open through 0.19.8 (PR #8393);
# should a release apply it itself, tests/training/test_fp16.py fails (the gradients would carry it twice).
FP16_ZERO0_UNSCALED_SINCE = "0.18.3"

# Names under deepspeed.runtime (not exported publicly) that megatron_ds imports, all present in
# 0.16-0.19: looked up lazily through this module (``from megatron_ds.ds_compat import X``).
_INTERNAL_NAMES = {
    "TorchCheckpointEngine": "deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine",  # subclassed
    "partition_balanced": "deepspeed.runtime.utils",  # PipelineModule's stage partitioning
    "partition_uniform": "deepspeed.runtime.utils",  # ... with partition_method="uniform"
    "get_global_norm_of_tensors": "deepspeed.runtime.utils",  # returns -1 for a non-finite norm
    "PipeModelDataParallelTopology": "deepspeed.runtime.pipe.topology",  # axes pipe, data, model
    "ProcessTopology": "deepspeed.runtime.pipe.topology",  # its base: any axes (+ "sequence" for Ulysses)
    "DeepSpeedConfig": "deepspeed.runtime.config",  # validates a JSON as deepspeed.initialize would
    "ZeROOptimizer": "deepspeed.runtime.base_optimizer",  # base of the ZeRO and bf16 optimizers
    "BF16_Optimizer": "deepspeed.runtime.bf16_optimizer",  # keeps the accumulated grad in _hp_grad
    # mixture of experts (model/moe_layer.py, parallel/groups.py): DeepSpeed's own expert group set-up, called
    # up front on every rank (see create_expert_groups), and its norm of expert gradients
    "_create_expert_and_data_parallel": "deepspeed.utils.groups",
    "_create_expert_data_and_model_parallel": "deepspeed.utils.groups",
    "_get_expert_parallel_group_dict": "deepspeed.utils.groups",
    "_release_process_group_references": "deepspeed.utils.groups",
    "_get_expert_parallel_group_ranks": "deepspeed.utils.groups",
    "_get_expert_data_parallel_group_ranks": "deepspeed.utils.groups",
    "_get_expert_parallel_group": "deepspeed.utils.groups",
    "_get_expert_parallel_rank": "deepspeed.utils.groups",
    "_get_expert_data_parallel_rank": "deepspeed.utils.groups",
    "get_norm_with_moe_layers": "deepspeed.runtime.utils",
    # the dicts of expert groups by name that register_expert_groups fills with Megatron-LM's expert grid, and the
    # expert tensor parallel size its norm helpers read
    "_EXPERT_PARALLEL_GROUP": "deepspeed.utils.groups",
    "_EXPERT_PARALLEL_GROUP_RANKS": "deepspeed.utils.groups",
    "_EXPERT_DATA_PARALLEL_GROUP": "deepspeed.utils.groups",
    "_EXPERT_DATA_PARALLEL_GROUP_RANKS": "deepspeed.utils.groups",
    "expert_tensor_parallel_world_size": "deepspeed.utils.groups",
}

# Methods megatron_ds calls, replaces on an instance or overrides in a subclass:
# (module, class, attribute, who relies on it).
_HOOKS = (
    ("deepspeed.runtime.pipe.module", "PipelineModule", "_is_checkpointable",
     "overridden by megatron_ds.model.pipeline_model.PipelineModel"),
    ("deepspeed.runtime.pipe.module", "PipelineModule", "_partition_layers",
     "overridden by megatron_ds.model.pipeline_model.PipelineModel (layers:N1,...,Np) and "
     "megatron_ds.families.t5.t5_model.T5PipelineModel (the split rank's partition)"),
    ("deepspeed.runtime.pipe.module", "PipelineModule", "_set_bounds", "set_pipeline_partition"),
    ("deepspeed.runtime.pipe.module", "PipelineModule", "get_tied_weights_and_groups",
     "overridden by megatron_ds.families.t5.t5_model.T5PipelineModel (tied weights a stage does not read)"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine", "_load_zero_checkpoint", "bf16 ZeRO-0 checkpoint loading"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine", "module_state_dict", "interleaved schedule's layer files"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine", "load_module_state_dict", "interleaved schedule's layer files"),
    ("deepspeed.runtime.bf16_optimizer", "BF16_Optimizer", "_lazy_init_hp_params_optimizer_state",
     "optimizer-state resharding"),
    ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer", "_lazy_init_hp_params_optimizer_state",
     "optimizer-state resharding"),
)

# Attributes DeepSpeed reads from the client optimizer it is given (GuardedOptimizer sets them):
# (module, class, method whose source reads it, attribute). DeepSpeedEngine._take_model_step, 0.16-0.19.
_READ_BY_DEEPSPEED = (
    ("deepspeed.runtime.engine", "DeepSpeedEngine", "_take_model_step", "_global_grad_norm"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine", "_take_model_step", "overflow"),
)

# Parameter attributes DeepSpeed's norm helpers read to count a gradient once (0.16-0.19).
_NORM_ATTRIBUTES = ("ds_pipe_replicated", "tensor_model_parallel", "model_parallel")


def _internal(name: str):
    return getattr(importlib.import_module(_INTERNAL_NAMES[name]), name)


def __getattr__(name: str):  # PEP 562: ``from megatron_ds.ds_compat import X`` for X in _INTERNAL_NAMES
    if name not in _INTERNAL_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return _internal(name)


# --- the check ------------------------------------------------------------------------------------
def _version(text: str):
    from packaging.version import Version  # noqa: PLC0415

    return Version(text.split("+")[0])


def incompatible(problem: str) -> ConfigError:
    """The one message for a DeepSpeed megatron_ds was not written for."""
    import deepspeed  # noqa: PLC0415

    return ConfigError(f"DeepSpeed {deepspeed.__version__} cannot be used: {problem}; megatron_ds is tested with "
                       f"DeepSpeed >= {TESTED[0]}, < {TESTED[1]}: install one (pip install 'deepspeed>={TESTED[0]},"
                       f"<{TESTED[1]}'); megatron_ds/ds_compat.py lists the DeepSpeed internals it relies on")


def missing_hooks() -> list[str]:
    """``module.Class.attribute`` of every internal listed above that this DeepSpeed lacks."""
    missing = []
    for name, module in _INTERNAL_NAMES.items():
        if not hasattr(_import(module), name):
            missing.append(f"{module}.{name}")
    for module, cls, attr, _ in _HOOKS:
        if not hasattr(getattr(_import(module), cls, None), attr):
            missing.append(f"{module}.{cls}.{attr}")
    for module, cls, method, attr in _READ_BY_DEEPSPEED:
        fn = getattr(getattr(_import(module), cls, None), method, None)
        if fn is None or attr not in _source(fn):
            missing.append(f"{module}.{cls}.{method} reading .{attr}")
    return missing


def _source(fn) -> str:
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):  # installed without sources: nothing to check against
        return "".join(a for *_, a in _READ_BY_DEEPSPEED)


def _import(module: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


def check_deepspeed(*, interleaved: bool = False) -> None:
    """Raise the one ConfigError unless the installed DeepSpeed is in ``TESTED`` (and, with
    ``interleaved``, at least ``INTERLEAVED_MINIMUM``) and has every internal listed here."""
    import deepspeed  # noqa: PLC0415

    found = _version(deepspeed.__version__)
    if not _version(TESTED[0]) <= found < _version(TESTED[1]):
        raise incompatible("it is outside the tested range")
    if interleaved and found < _version(INTERLEAVED_MINIMUM):
        raise incompatible(f"the interleaved pipeline schedule needs DeepSpeed >= {INTERLEAVED_MINIMUM}")
    missing = missing_hooks()
    if missing:
        raise incompatible(f"it lacks {', '.join(missing)}")


def overrides_deepspeed_hook(fn):
    """Decorator for a subclass method that overrides a DeepSpeed hook listed in ``_HOOKS``: fails
    at import, with the one message, if the base class no longer has it (it would never be called)."""
    entry = next((h for h in _HOOKS if h[2] == fn.__name__), None)
    if entry is None:
        raise AssertionError(f"{fn.__qualname__}: add the DeepSpeed hook {fn.__name__} to ds_compat._HOOKS")
    if not hasattr(getattr(_import(entry[0]), entry[1], None), entry[2]):
        raise incompatible(f"it lacks {entry[0]}.{entry[1]}.{entry[2]}")
    return fn


# --- the DeepSpeed JSON ---------------------------------------------------------------------------
class _KeysSeen:
    """``dict.keys()`` whose ``in`` is recorded (``X in d.keys()`` bypasses the dict's __contains__)."""

    def __init__(self, d: dict, seen: set):
        self._d, self._seen = d, seen

    def __contains__(self, key):
        self._seen.add(key)
        return key in self._d

    def __iter__(self):
        return iter(self._d)

    def __len__(self):
        return len(self._d)


class _RecordingDict(dict):
    """The JSON's top level, recording every key DeepSpeed's config parser looks up."""

    def __init__(self, data: dict, seen: set):
        super().__init__(data)
        self._seen = seen

    def __getitem__(self, key):
        self._seen.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self._seen.add(key)
        return super().get(key, default)

    def __contains__(self, key):
        self._seen.add(key)
        return super().__contains__(key)

    def keys(self):
        return _KeysSeen(dict(self), self._seen)


def parse_deepspeed_config(ds_config: dict) -> set[str]:
    """Build ``deepspeed.runtime.config.DeepSpeedConfig`` (what ``deepspeed.initialize`` builds) from
    ``ds_config``; return the top-level keys it looked up. A key it never looked up is one DeepSpeed
    ignores (0.16-0.19 read the top level through get / [] / in / keys(); sub-blocks are pydantic
    models that refuse unknown keys themselves). Raises whatever DeepSpeed raises for a bad JSON."""
    seen: set[str] = set()
    _internal("DeepSpeedConfig")(_RecordingDict(ds_config, seen))
    return seen


# --- engine ---------------------------------------------------------------------------------------
def engine_config(engine):
    """The engine's parsed DeepSpeedConfig (``engine._config``, 0.16-0.19), as checkpoint engines take it."""
    return engine._config


def checkpoint_engine(engine):
    """The object the engine reads and writes checkpoint files with (``engine.checkpoint_engine``, 0.16-0.19)."""
    return engine.checkpoint_engine


def set_checkpoint_engine(engine, replacement) -> None:
    """Make ``engine.save_checkpoint`` / ``load_checkpoint`` use ``replacement`` (``engine.checkpoint_engine``)."""
    engine.checkpoint_engine = replacement


def is_default_checkpoint_engine(engine) -> bool:
    """Whether the engine's checkpoint engine is DeepSpeed's plain torch one (not one from the JSON)."""
    return type(checkpoint_engine(engine)) is _internal("TorchCheckpointEngine")


def load_bf16_optimizer_files(engine, load_dir: str, tag: str) -> bool:
    """The bf16 optimizer's ``bf16_zero_*`` files under ZeRO-0, which DeepSpeed 0.19's
    ``load_checkpoint`` does not read there (``engine._load_zero_checkpoint``, 0.16-0.19)."""
    return bool(engine._load_zero_checkpoint(load_dir, tag))


def set_engine_counters(engine, state: dict) -> None:
    """The engine's step counters (``global_steps``, ``global_samples``, ``skipped_steps``
    attributes, 0.16-0.19) from a checkpoint's state, as ``load_checkpoint`` restores them."""
    for attr in ("global_steps", "global_samples", "skipped_steps"):
        if attr in state:
            setattr(engine, attr, state[attr])


def use_layer_file_checkpoints(engine, load_module) -> None:
    """Make ``engine.save_checkpoint`` write no module weights into its ``mp_rank_*`` file (None,
    as ``PipelineEngine.module_state_dict`` returns after writing its per-layer files) and make
    ``engine.load_checkpoint`` read the module through ``load_module(strict)`` instead (instance
    overrides of ``module_state_dict`` / ``load_module_state_dict``, 0.16-0.19)."""
    engine.module_state_dict = lambda *args, **kwargs: None

    def load_module_state_dict(checkpoint=None, strict=True, *args, **kwargs):
        load_module(strict)

    engine.load_module_state_dict = load_module_state_dict


def is_bf16_optimizer(optimizer) -> bool:
    """DeepSpeed's BF16_Optimizer (``deepspeed.runtime.bf16_optimizer``, 0.16-0.19)."""
    return isinstance(optimizer, _internal("BF16_Optimizer"))


def accumulates_grads_in_fp32(engine) -> bool:
    """Whether the engine's optimizer sums micro-batch gradients in fp32 (the bf16 optimizer's ``_hp_grad``)."""
    return is_bf16_optimizer(engine.optimizer)


@contextlib.contextmanager
def outside_backward_gradients(engine):
    """Around gradients accumulated outside ``engine.backward`` (a zero-bubble weight pass): DeepSpeed's
    bf16 optimizer clears its bf16 gradients before each backward and adds them into its fp32 ones
    after (``backward_prologue`` / ``backward_epilogue``), which Megatron-DeepSpeed's ``_exec_weight_pass``
    repeats by hand (``clear_lp_grads`` / ``update_hp_grads``); other optimizers read ``.grad`` itself."""
    opt = engine.optimizer
    if is_bf16_optimizer(opt):
        opt.clear_lp_grads()
    yield
    if is_bf16_optimizer(opt):
        opt.update_hp_grads(clear_lp_grads=False)


def backward_loss_scale(engine) -> float:
    """The factor ``engine.backward`` multiplies a loss by: DeepSpeed 0.19 scales only through a
    ZeRO-family optimizer's ``scale_if_loss`` (``custom_loss_scaler`` / ``external_loss_scale`` /
    ``loss_scaler.loss_scale``; the bf16 optimizer has none) or the engine's
    ``torch_autocast_z0_gradscaler`` under ZeRO 0 with torch autocast; else the loss goes in unscaled."""
    opt = engine.optimizer
    if isinstance(opt, _internal("ZeROOptimizer")):
        if getattr(opt, "custom_loss_scaler", False):
            return float(opt.external_loss_scale)
        scaler = getattr(opt, "loss_scaler", None)
        return float(scaler.loss_scale) if scaler is not None else 1.0
    gradscaler = getattr(engine, "torch_autocast_z0_gradscaler", None)
    return float(gradscaler.get_scale()) if gradscaler is not None else 1.0


def loss_scale(opt) -> float:
    """The optimizer's current fp16 loss scale: its ``loss_scale`` property (the external scale where
    one was set, else the scaler's), present on FP16_Optimizer, FP16_UnfusedOptimizer and the ZeRO
    optimizers, 0.16-0.19 (the fp16 ZeRO-0 optimizers lost their ``cur_scale`` attribute in 0.18.x,
    so the log read 1.0 there); 1.0 for an optimizer without one (bf16, fp32)."""
    scale = getattr(opt, "loss_scale", None)
    return float(scale) if scale else 1.0


def reported_loss_scale(engine) -> float:
    """The fp16 loss scale for the log: ``loss_scale`` of the engine's optimizer."""
    return loss_scale(getattr(engine, "optimizer", None))


def reported_grad_norm(engine, backward_scale: float) -> float | None:
    """The last step's global grad norm for the log, ``engine.get_global_grad_norm()``, unscaled:
    FP16_UnfusedOptimizer (fp16 ZeRO 0 with a torch optimizer, 0.16-0.19) keeps the norm of the
    gradients still multiplied by ``backward_scale``, the loss scale of the step's backward (its step
    may have changed the scale since), where FP16_Optimizer and the ZeRO optimizers keep it divided."""
    norm = engine.get_global_grad_norm()
    if norm is None:
        return None
    return float(norm) / backward_scale if is_unfused_fp16_optimizer(engine.optimizer) else float(norm)


def unscaled_fp16_optimizer(engine):
    """The engine's fp16 ZeRO-0 optimizer where this DeepSpeed's ``engine.backward`` leaves its loss
    scale unapplied (``FP16_ZERO0_UNSCALED_SINCE``), else None: the caller must then multiply the
    loss's gradient by ``loss_scale`` of it, as ``FP16_Optimizer.backward`` did before 0.18.3."""
    import deepspeed  # noqa: PLC0415

    opt = engine.optimizer
    # fp16_enabled: under --bf16 the plain engine wraps its optimizer in FP16_UnfusedOptimizer too (scale 1)
    if (engine.fp16_enabled() and is_fp16_optimizer(opt)
            and _version(deepspeed.__version__) >= _version(FP16_ZERO0_UNSCALED_SINCE)):
        return opt
    return None


def count_fp16_grads_once(opt) -> None:
    """Make FP16_UnfusedOptimizer (ZeRO 0 with a torch optimizer: fp16, and bf16 on the plain engine)
    count each gradient once in its clipping norm: its step measures the gradient tensors (``p.grad``, via
    ``split_params_grads_into_shared_and_expert_params``) with ``get_weight_norm``, which decides what
    to count by attributes of the tensors it is given, attributes only the parameters carry: the last
    stage's copy of the tied embedding (``ds_pipe_replicated``) is counted twice, and on tensor parallel
    ranks > 0 no gradient at all (``tensor_model_parallel`` / ``model_parallel``), 0.16-0.19. The step
    (replaced on this instance) first copies them onto the gradients."""
    if not is_unfused_fp16_optimizer(opt):
        return
    step = opt.step

    def step_counting_once(*args, **kwargs):
        for p in (p for group in opt.fp16_groups for p in group if p.grad is not None):
            for attr in _NORM_ATTRIBUTES:
                if hasattr(p, attr):
                    setattr(p.grad, attr, getattr(p, attr))
        return step(*args, **kwargs)

    opt.step = step_counting_once


def set_pipeline_partition(module, parts: list[int]) -> None:
    """What ``PipelineModule._partition_layers`` leaves behind, for a partition computed elsewhere:
    ``parts`` (first layer of each stage, then the number of layers) and this stage's bounds."""
    module.parts = list(parts)
    stage = module._topo.get_coord(module.global_rank).pipe
    module._set_bounds(start=parts[stage], stop=parts[stage + 1])


def zero_grad_where_missing(param) -> None:
    """A zero ``.grad`` for a parameter backward did not reach, unless DeepSpeed's bf16 optimizer
    keeps its gradient itself (``_hp_grad``, what ``_exec_reduce_tied_grads`` reads then)."""
    if param.grad is None and not hasattr(param, "_hp_grad"):
        param.grad = torch.zeros_like(param)


def replace_loss_fn(module, loss_fn) -> None:
    """Replace the loss a module computes on the last stage: ``PipelineModule.loss_fn``, which
    ``PipelineEngine._exec_forward_pass`` reads at every micro-batch (0.16-0.19); megatron_ds's own
    modules (``SequentialModel``, ``ModelChunks``) keep theirs under the same name."""
    module.loss_fn = loss_fn


def link_main_grads(opt, params) -> int:
    """Give each of ``params`` that DeepSpeed's bf16 optimizer (fp32 accumulation) steps a ``main_grad``:
    its fp32 gradient in the optimizer (``fp32_groups_gradients[i][j]``, a view of the flat buffer the
    data parallel reduction, the clipping norm and the step read, zeroed in place after each step).
    The norm counts only gradients marked as written (``fp32_groups_has_gradients``, which
    ``_update_hp_grad`` sets, 0.19); a linked weight is marked once and again after every
    ``clear_hp_grads``, as a backward writes it every step (a step that did not would count its zeros:
    the same norm). Marking here rather than in backward keeps backward free of Python side effects, so
    a layer compiled by torch.compile keeps the fused GEMM in its graph. Returns how many were linked."""
    wanted = {id(p) for p in params}
    linked = []
    for i, group in enumerate(opt.bf16_groups):
        for j, param in enumerate(group):
            if id(param) in wanted:
                param.main_grad = opt.fp32_groups_gradients[i][j].view(param.shape)
                linked.append((i, j))
    if linked:
        clear = opt.clear_hp_grads

        def clear_and_mark():
            clear()
            _mark_hp_grads(opt, linked)

        opt.clear_hp_grads = clear_and_mark
        _mark_hp_grads(opt, linked)
    return len(linked)


def _mark_hp_grads(opt, linked) -> None:
    for i, j in linked:
        opt.fp32_groups_has_gradients[i][j] = True


def accumulated_grad(engine, param):
    """The step's accumulated gradient of ``param`` before the data parallel reduction, as
    ``PipelineEngine._exec_reduce_tied_grads`` (0.19) finds it: ``param._hp_grad`` under the bf16
    optimizer, else ``param.grad``; None if it has none."""
    return getattr(param, "_hp_grad", None) if is_bf16_optimizer(engine.optimizer) else param.grad


# --- optimizer internals (resharding writes optimizer state) ------------------------------------
def flat_partitions(opt) -> list[torch.Tensor] | None:
    """This rank's flat fp32 partitions: ``single_partition_of_fp32_groups`` (ZeRO 1-2),
    ``fp32_groups_flat_partition`` (bf16), ``fp32_partitioned_groups_flat`` (ZeRO-3), 0.16-0.19."""
    for attr in ("single_partition_of_fp32_groups", "fp32_groups_flat_partition", "fp32_partitioned_groups_flat"):
        if hasattr(opt, attr):
            return getattr(opt, attr)
    return None


def base_optimizer(opt):
    """The torch optimizer a DeepSpeed optimizer wraps (its ``optimizer`` attribute, 0.16-0.19)."""
    return opt.optimizer


def names_its_parameters_in_files(opt) -> bool:
    """Whether the optimizer's checkpoint files name their parameters: ZeRO 1-2 and bf16
    (``param_slice_mappings``) and ZeRO-3 (``fp32_partitioned_groups_flat``), 0.16-0.19."""
    return any(hasattr(opt, a) for a in ("param_slice_mappings", "fp32_partitioned_groups_flat"))


def create_optimizer_state(opt) -> None:
    """Adam's state for each flat partition, as its first step would create it (zeros)."""
    for flat in flat_partitions(opt):
        state = base_optimizer(opt).state[flat]
        if not state:
            state.update(step=torch.zeros((), dtype=torch.float32), exp_avg=torch.zeros_like(flat.detach()),
                         exp_avg_sq=torch.zeros_like(flat.detach()))


def link_hp_optimizer_state(opt) -> None:
    """Link each parameter to its optimizer-state fragments before the first step (DeepSpeed makes
    the links lazily there: ``_hp_optimizer_states_linked`` / ``_lazy_init_hp_params_optimizer_state``
    of the ZeRO 1-2 and bf16 optimizers, 0.16-0.19), creating the state they link to first."""
    if getattr(opt, "_hp_optimizer_states_linked", True):
        return
    create_optimizer_state(opt)
    opt._lazy_init_hp_params_optimizer_state()


def mark_pipe_replicated(param) -> None:
    """Count this copy of a tied weight once in the global grad norm, as PipelineModule marks its
    tied copies (``param.ds_pipe_replicated``, read by DeepSpeed's norm helpers, 0.16-0.19)."""
    param.ds_pipe_replicated = True


def is_pipe_replicated(param) -> bool:
    """Whether ``param`` is such a copy (``ds_pipe_replicated``)."""
    return bool(getattr(param, "ds_pipe_replicated", False))


def refresh_masters(opt) -> None:
    """The optimizer's fp32 master weights from the module's weights, where it keeps its own
    (``refresh_fp32_params``: ZeRO 1-3, the bf16 and fp16 optimizers, 0.16-0.19). DeepSpeed's
    load_checkpoint does this for ZeRO 1-3 when it loads no optimizer state, not for its ZeRO-0
    bf16/fp16 optimizers, whose first step would then write the initial weights back."""
    refresh = getattr(opt, "refresh_fp32_params", None)
    if refresh is not None:
        refresh()


def is_zero3_param(param) -> bool:
    """Whether ZeRO-3 partitioned ``param`` (it gets a ``ds_id``, 0.16-0.19)."""
    return hasattr(param, "ds_id")


def zero3_param_group(param):
    """The data parallel group a ZeRO-3 parameter is partitioned over (``ds_process_group``, 0.16-0.19)."""
    return param.ds_process_group


def has_fragment_mapping(param) -> bool:
    """Whether ZeRO 1-2 / bf16 mapped ``param`` to optimizer-state fragments (``param._hp_mapping``, 0.16-0.19)."""
    return hasattr(param, "_hp_mapping")


def is_fp16_optimizer(opt) -> bool:
    """DeepSpeed's FP16_Optimizer (``fp32_groups_flat``) or FP16_UnfusedOptimizer (``fp32_groups``),
    both with ``fp16_groups`` (ZeRO-0, 0.16-0.19)."""
    return hasattr(opt, "fp16_groups") and (hasattr(opt, "fp32_groups_flat") or hasattr(opt, "fp32_groups"))


def is_unfused_fp16_optimizer(opt) -> bool:
    """DeepSpeed's FP16_UnfusedOptimizer: an fp32 copy per parameter (``fp32_groups``), no flat one."""
    return is_fp16_optimizer(opt) and not hasattr(opt, "fp32_groups_flat")


def fp16_optimizer_groups(opt) -> list:
    """A ZeRO-0 fp16 optimizer's groups of the module's parameters (``fp16_groups``, 0.16-0.19)."""
    return opt.fp16_groups


def fp16_optimizer_master(opt, g: int, j: int) -> tuple[torch.Tensor, int | None]:
    """The fp32 master holding parameter ``j`` of group ``g`` of a ZeRO-0 fp16 optimizer and its
    offset in it: FP16_Optimizer's flat group master (``fp32_groups_flat[g]``, the group's
    parameters concatenated in order), or FP16_UnfusedOptimizer's own copy (``fp32_groups[g][j]``,
    offset None), 0.16-0.19."""
    if hasattr(opt, "fp32_groups_flat"):
        return opt.fp32_groups_flat[g], sum(p.numel() for p in opt.fp16_groups[g][:j])
    return opt.fp32_groups[g][j], None


def fp16_loss_scale_config(opt):
    """A ZeRO-0 fp16 optimizer's loss scaler settings/state (``loss_scale_config``, 0.19); None elsewhere."""
    config = getattr(opt, "loss_scale_config", None)
    return config if config is not None and is_fp16_optimizer(opt) else None


# --- torch internals ------------------------------------------------------------------------------
def scale_grads_(grads: list[torch.Tensor], factor: float) -> None:
    """Multiply gradients in place, one fused kernel per device (``torch._foreach_mul_``, torch 2.x)."""
    torch._foreach_mul_(grads, factor)


def floats_as_compile_constants():
    """A context in which ``torch.compile`` makes each Python float a compiled function is called
    with a constant of its graph (one graph per value, guarded) rather than a symbolic input.
    Symbolic floats are not safe in torch 2.13: a dropout probability passed on to ``bernoulli_`` kept
    the value of the first call, within the process and through inductor's on-disk cache. Through
    ``torch._dynamo.config.specialize_float``; a torch without the option does not make floats
    symbolic in the first place."""
    import torch._dynamo  # noqa: PLC0415  (only where something is compiled)

    config = torch._dynamo.config
    if not hasattr(config, "specialize_float"):
        return contextlib.nullcontext()
    return config.patch(specialize_float=True)


def set_default_group_timeout(timeout) -> bool:
    """Make later ``new_group()`` calls without a timeout use ``timeout``: torch 2.x reads the module
    globals ``distributed_c10d.default_pg_timeout`` / ``default_pg_nccl_timeout`` through
    ``_get_default_timeout`` at each new_group. False (nothing changed) where this torch lacks them."""
    from torch.distributed import distributed_c10d as c10d  # noqa: PLC0415

    if not (hasattr(c10d, "default_pg_timeout") and hasattr(c10d, "_get_default_timeout")):
        return False
    c10d.default_pg_timeout = timeout
    if hasattr(c10d, "default_pg_nccl_timeout"):
        c10d.default_pg_nccl_timeout = timeout
    return True


# c10's log threshold (0 info, 1 warning, 2 error): what TORCH_CPP_LOG_LEVEL sets when torch loads. torch has
# no call to change it later; the flag is a global of libc10, found through torch._C's library handle.
_CPP_LOG_LEVEL = "FLAGS_caffe2_log_level"
_CPP_ERRORS_ONLY = 2


def _cpp_log_level():
    import ctypes  # noqa: PLC0415

    try:
        return ctypes.c_int.in_dll(ctypes.CDLL(torch._C.__file__), _CPP_LOG_LEVEL)
    except (OSError, ValueError, AttributeError):  # a torch without the flag: its warnings stay
        return None


def quiet_cpp_warnings() -> None:
    """From now on torch's C++ code logs errors only, no warnings. For a process ending on purpose whose
    c10d store is gone (its launcher was killed): each store call -- NCCL's heartbeat monitor polls it --
    would print a warning with a 20-frame C++ stack."""
    level = _cpp_log_level()
    if level is not None:
        level.value = max(level.value, _CPP_ERRORS_ONLY)


@contextlib.contextmanager
def cpp_warnings_quiet():
    """``quiet_cpp_warnings`` for a block whose store calls may fail as expected; the level is restored."""
    level = _cpp_log_level()
    before = None if level is None else level.value
    quiet_cpp_warnings()
    try:
        yield
    finally:
        if before is not None:
            level.value = before


# DeepSpeed's CPU shared-memory collective op: TorchBackend.__init__ (deepspeed.comm.torch.build_shm_op,
# 0.16-0.19) JIT-compiles it on the CPU accelerator whenever ``deepspeed.ops.__compatible_ops__`` says it can.
_SHM_COMM_OP = "deepspeed_shm_comm"


def skip_shm_comm_op() -> None:
    """Keep DeepSpeed from building its shared-memory CPU collective when it joins the job. The op serves
    only ``deepspeed.comm.inference_all_reduce`` (DeepSpeed's AutoTP inference), which megatron_ds never
    calls: every collective of a CPU run goes through torch.distributed on gloo with or without it. Its
    first build kept a fresh machine's first CPU run ~40 s from its first iteration (compiling on two
    cores; then cached per torch build, in TORCH_EXTENSIONS_DIR). Marking it incompatible is what
    DeepSpeed itself does on a platform without it (``ShareMemCommBuilder.is_compatible``)."""
    import deepspeed.ops  # noqa: PLC0415

    compatible = getattr(deepspeed.ops, "__compatible_ops__", None)  # probed lazily on first access in 0.19
    if isinstance(compatible, dict):
        compatible[_SHM_COMM_OP] = False


# Loggers of what importing torchao says (torchao 0.18, torch 2.13): torchao logs one warning per optional
# C++ kernel library it cannot load ("Failed to load .../_C_mxfp8...so", CUTLASS), CUDA builds of kernels
# megatron_ds never calls, and torch's pytree warns that torchao's enums need no register_constant() any more.
_TORCHAO_IMPORT_LOGGERS = ("torchao", "torch.utils._pytree")


@contextlib.contextmanager
def torchao_import_quiet():
    """A block that may import torchao (our FP8 GEMMs; transformers' model classes import it whenever it
    is installed) with those import-time warnings held back, errors still shown; the levels are restored."""
    import logging  # noqa: PLC0415

    logs = [logging.getLogger(name) for name in _TORCHAO_IMPORT_LOGGERS]
    levels = [log.level for log in logs]
    for log in logs:
        log.setLevel(max(log.level, logging.ERROR))
    try:
        yield
    finally:
        for log, level in zip(logs, levels):
            log.setLevel(level)


def act_as_torch_optimizer(opt, profile_name: str) -> None:
    """The attributes torch.optim.Optimizer.__init__ would set (its step hooks and zero_grad's
    profiling name, torch 2.x) on a wrapper that shares another optimizer's state instead."""
    opt._optimizer_step_pre_hooks, opt._optimizer_step_post_hooks = {}, {}
    opt._zero_grad_profile_name = profile_name


def checkpoint_safe_globals() -> list:
    """DeepSpeed objects found inside its optimizer/engine states (plain data classes and enums),
    for ``torch.load(weights_only=True)``: loss scalers, ZeroStageEnum, fragment_address (0.16-0.19;
    each skipped where a release lacks it)."""
    allowed = []
    for module, names in (("deepspeed.runtime.fp16.loss_scaler", ("LossScaler", "DynamicLossScaler")),
                          ("deepspeed.runtime.zero.config", ("ZeroStageEnum",)),
                          ("deepspeed.utils.tensor_fragment", ("fragment_address",))):
        try:
            mod = importlib.import_module(module)
            allowed += [getattr(mod, name) for name in names]
        except (ImportError, AttributeError):
            pass
    return allowed


def expert_parallel_group(ep_size: int):
    """The expert parallel group ``create_expert_groups`` made for ``ep_size`` (Megatron-LM's MoE layer's
    token dispatch, model/mlm_moe.py)."""
    return _internal("_get_expert_parallel_group")(moe_group_name(ep_size))


def expert_ranks(group_name: str) -> tuple[int, int]:
    """(expert parallel rank, expert data parallel rank) of this rank in DeepSpeed's groups named ``group_name``."""
    return (_internal("_get_expert_parallel_rank")(group_name),
            _internal("_get_expert_data_parallel_rank")(group_name))


def checkpoint_mp_rank(engine) -> int:
    """The model parallel rank in the names of the engine's checkpoint files (``mp_rank_{m:02d}_...``)."""
    return engine.checkpoint_mp_rank


def mark_expert_parameters(params, ep_size: int) -> None:
    """Mark parameters that differ across an expert parallel group as DeepSpeed marks its experts'
    (deepspeed/moe/experts.py Experts.__init__: ``allreduce = False``, ``group_name``): its engine then averages
    their gradients over the expert data parallel group only, broadcasts them from that group's first rank, and
    its optimizers keep them in their expert groups."""
    for p in params:
        p.allreduce = False
        p.group_name = moe_group_name(ep_size)
        # counted in the norm on every rank, whole or a tensor parallel shard alike: ZeRO 1/2 sum each rank's
        # partition over the data parallel then the TP x PP ranks (stage_1_and_2.py get_grad_norm_direct), which
        # counts each expert shard once; without it a TP rank > 0's whole experts would not count
        p.model_parallel = True


def moe_engine_marker(num_experts: int, ep_size: int) -> torch.nn.Module:
    """A parameter-free ``deepspeed.moe.layer.MoE`` for a model whose MoE layer is not DeepSpeed's: DeepSpeed's
    engine looks for instances of that class to set ``has_moe_layers`` (runtime/engine.py
    _configure_distributed_model), without which it reduces no gradient marked by ``mark_expert_parameters``.
    The expert groups exist already (``create_expert_groups``, before the engine); it never runs."""
    from deepspeed.moe.layer import MoE  # noqa: PLC0415

    class _EngineMarker(MoE):
        def __init__(self):
            torch.nn.Module.__init__(self)  # no gate, no experts: nothing of MoE.__init__ but its names
            self.num_experts, self.ep_size = num_experts, ep_size
            self.num_local_experts, self.expert_group_name = num_experts // ep_size, moe_group_name(ep_size)
            self.enable_expert_tensor_parallelism, self.use_residual = False, False

        def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
            pass

        def forward(self, *args, **kwargs):
            raise RuntimeError("DeepSpeed's MoE marker does not run")

    return _EngineMarker()


def moe_group_name(ep_size: int) -> str:
    """The name DeepSpeed's MoE layer gives its expert groups (deepspeed/moe/layer.py MoE.__init__) and
    stores on each expert parameter as ``group_name``."""
    return f"ep_size_{ep_size}"


def create_expert_groups(ep_size: int, expert_tensor_parallel: bool, mpu) -> tuple[list[int], list[int]]:
    """Create DeepSpeed's expert parallel and expert data parallel groups for ``ep_size`` now, on every
    rank, exactly as ``MoE._create_process_groups`` would when the engine calls
    ``set_deepspeed_parallelism`` (which then finds them and creates nothing). Group creation is
    collective, and the engine only calls it on ranks whose stage holds an MoE layer. Returns this
    rank's (expert parallel ranks, expert data parallel ranks)."""
    from deepspeed.utils import groups  # noqa: PLC0415

    name = moe_group_name(ep_size)
    cached = _internal("_get_expert_parallel_group_dict")().get(name)
    if cached is not None:
        try:  # groups of an earlier process group in this process (torch's destroy_process_group does
            dist.get_process_group_ranks(cached)  # not tell DeepSpeed, deepspeed.comm's would): forget them
        except (KeyError, ValueError, RuntimeError):
            _internal("_release_process_group_references")(None)
    groups.mpu = mpu  # what the engine sets too (DeepSpeedEngine._configure_distributed_model)
    if name not in _internal("_get_expert_parallel_group_dict")():
        if expert_tensor_parallel:
            _internal("_create_expert_data_and_model_parallel")(ep_size, mpu=mpu)
        else:
            _internal("_create_expert_and_data_parallel")(ep_size)
    return (list(_internal("_get_expert_parallel_group_ranks")(name)),
            list(_internal("_get_expert_data_parallel_group_ranks")(name)))


def register_expert_groups(ep_size: int, etp: int, *, ep_group: tuple, edp_group: tuple, mpu) -> None:
    """Make ``(group, ranks)`` of Megatron-LM's expert grid (parallel/groups.py) DeepSpeed's expert parallel and
    expert data parallel groups of ``ep_size`` (its dicts deepspeed/utils/groups.py ``_EXPERT_PARALLEL_GROUP`` /
    ``_EXPERT_DATA_PARALLEL_GROUP`` and their ``_RANKS``, what ``_create_expert_and_data_parallel`` fills): its engine
    then reduces the marked experts' gradients over the EDP group and ZeRO partitions them over it. DeepSpeed's
    ``expert_tensor_parallel_world_size`` is set to ETP, as its ``_create_expert_data_and_model_parallel`` sets it
    to TP (its norm helpers read it)."""
    from deepspeed.utils import groups  # noqa: PLC0415

    name = moe_group_name(ep_size)
    cached = _internal("_get_expert_parallel_group_dict")().get(name)
    if cached is not None:
        try:  # groups of an earlier process group in this process: forget them (as create_expert_groups)
            dist.get_process_group_ranks(cached)
        except (KeyError, ValueError, RuntimeError):
            _internal("_release_process_group_references")(None)
    groups.mpu = mpu
    for (group, ranks), table in ((ep_group, "_EXPERT_PARALLEL_GROUP"), (edp_group, "_EXPERT_DATA_PARALLEL_GROUP")):
        _internal(table)[name] = group
        _internal(table + "_RANKS")[name] = list(ranks)
    groups.expert_tensor_parallel_world_size = etp


@contextlib.contextmanager
def module_files_on_data_parallel_rank_0(data_parallel_rank: int):
    """DeepSpeed's engine writes an MoE model's module file (``mp_rank_..._model_states.pt``) only on expert data
    parallel rank 0 (runtime/engine.py ``_save_moe_checkpoint`` returns early on the others), which is data parallel
    rank 0 where that group runs along data parallel ranks. On Megatron-LM's expert grid with ETP below TP it
    crosses tensor parallel ranks, whose module files would be missing: within this context data parallel rank 0
    counts as an expert data parallel rank 0 too (under ZeRO-0 it then also writes its expert parallel rank's
    optimizer file under its own mp rank: a copy, not a conflicting file)."""
    from deepspeed.utils import groups  # noqa: PLC0415

    original = groups._get_expert_data_parallel_rank
    groups._get_expert_data_parallel_rank = lambda name: 0 if data_parallel_rank == 0 else original(name)
    try:
        yield
    finally:
        groups._get_expert_data_parallel_rank = original


def moe_gate_kept_routes(gate_output) -> torch.Tensor:
    """How many (token, expert) routes DeepSpeed's ``TopKGate.forward`` kept within the experts'
    capacity, from what it returned: 0.19's sparse dispatch (MOELayer asks for sparse routes) returns
    ``(l_aux, capacity, num_experts, indices [k, tokens] (-1: dropped), locations, gates, exp_counts)``;
    earlier releases ``(l_aux, combine_weights, dispatch_mask [tokens, experts, capacity], exp_counts)``
    with one True per kept route."""
    if len(gate_output) == 7:
        return (gate_output[3] >= 0).sum()
    if len(gate_output) == 4:
        return gate_output[2].sum()
    raise incompatible(f"its TopKGate returns {len(gate_output)} values (expected 7 or 4)")


def gather_flat_on_gloo(group) -> None:
    """DeepSpeed's MoE gathers tokens over the tensor parallel ranks into a flat buffer
    (deepspeed/moe/mappings.py ``_gather_tokens``: ``all_gather_into_tensor`` of a [world * numel]
    output from a [e, c, m] input), which NCCL accepts and gloo refuses (it wants the output shaped
    [world * e, c, m]). Where ``group`` is gloo, wrap ``deepspeed.comm.all_gather_into_tensor`` once
    so that such a flat output is viewed in that shape (the same memory, the same numbers); every
    other call passes through unchanged."""
    import functools  # noqa: PLC0415

    import deepspeed.comm as ds_comm  # noqa: PLC0415

    original = ds_comm.all_gather_into_tensor
    if getattr(original, "megatron_ds_flat_gather", False) or str(dist.get_backend(group)) != "gloo":
        return

    @functools.wraps(original)
    def all_gather_into_tensor(output_tensor, tensor, *args, **kwargs):
        if output_tensor.dim() == 1 and tensor.dim() > 1 and output_tensor.numel() % tensor.numel() == 0:
            ranks = output_tensor.numel() // tensor.numel()
            output_tensor = output_tensor.view(ranks * tensor.shape[0], *tensor.shape[1:])
        return original(output_tensor, tensor, *args, **kwargs)

    all_gather_into_tensor.megatron_ds_flat_gather = True
    ds_comm.all_gather_into_tensor = all_gather_into_tensor


def norm_with_expert_grads(dense_norm: float, mpu, expert_grads: dict) -> float:
    """The global gradient norm with expert gradients (``{group name: [grads]}``) counted over their
    expert parallel groups, as DeepSpeed's bf16 optimizer does (runtime/utils.py
    ``get_norm_with_moe_layers``; -1 when not finite)."""
    return float(_internal("get_norm_with_moe_layers")(dense_norm, mpu=mpu, expert_tensors=expert_grads))


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int):
    """A default process group of ``world_size`` ranks in which this process is ``rank`` and no
    collective communicates (torch's "fake" backend, registered by importing
    ``torch.testing._internal.distributed.fake_pg``, torch >= 2.1): layers that ask their group for
    its size and their rank build as that rank would. Yields the group; destroyed on exit, so
    nothing initialised is left behind."""
    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised in this process; a fake one cannot be added")
    from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: PLC0415 - registers "fake"

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
