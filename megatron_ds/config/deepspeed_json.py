"""The DeepSpeed JSON: the user's file, merged with what the command line owns, checked by DeepSpeed.

Users pass ``--deepspeed_config ds.json``. The command line owns batch sizes, precision, the ZeRO
stage's flag and clipping; the JSON owns ZeRO details, buckets and loss-scale knobs.
``build_ds_config`` merges the two (a stale batch size in the JSON loses with a note, a real
contradiction is a ConfigError naming both values).

The merged JSON is then checked by DeepSpeed's own config parser, before the queue:
``deepspeed.runtime.config.DeepSpeedConfig`` is what ``deepspeed.initialize`` builds; it refuses unknown
keys (pydantic), removed blocks and inconsistent batch settings. Running it in ``--dry-run`` and at
start-up means whatever DeepSpeed will refuse is refused before hours in the queue, with its message.
It needs no process group: its batch check multiplies by the world size of the current process (1
without distributed), so the data parallel batch is checked by the layout and left out here. DeepSpeed
ignores top-level keys it does not know (only its sub-blocks refuse them); those are refused here,
with the closest key it reads.
"""
from __future__ import annotations

import copy
import json
import logging
import os

from megatron_ds.errors import ConfigError, closest


def load_ds_template(path: str | None) -> dict | None:
    """The DeepSpeed JSON as a dict, or None when no --deepspeed_config was given."""
    if not path:
        return None
    if not os.path.isfile(path):
        raise ConfigError(f"--deepspeed_config {path}: no such file")
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--deepspeed_config {path}: invalid JSON at line {exc.lineno} column {exc.colno}: "
                          f"{exc.msg}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--deepspeed_config {path}: expected a JSON object, got {type(data).__name__}")
    return data


def _json_conflict(name: str, json_value, flag: str, cli_value) -> ConfigError:
    return ConfigError(f"DeepSpeed JSON {name} = {json_value} contradicts {flag}: {cli_value}; "
                       f"remove it from the JSON (the command line owns it) or change the flag")


def guards_optimizer(precision: str, zero_stage: int) -> bool:
    """DeepSpeed's plain fp32 path (no ZeRO, no bf16/fp16 optimizer) neither skips non-finite steps
    nor reports the pre-clip norm; there megatron_ds.training.optimizer.GuardedOptimizer clips and
    skips, and DeepSpeed must not clip too."""
    return precision == "fp32" and zero_stage == 0


def grad_accum_bytes(ds: dict, precision: str) -> int:
    """Bytes per element of DeepSpeed's gradient accumulation ("data_types": {"grad_accum_dtype"}; default:
    the weights' dtype)."""
    lp = 4 if precision == "fp32" else 2
    name = (ds.get("data_types") or {}).get("grad_accum_dtype")
    return lp if name is None else {"fp32": 4, "float32": 4, "float": 4, "fp16": 2, "float16": 2, "half": 2,
                                    "bf16": 2, "bfloat16": 2}.get(str(name).lower(), lp)


def uses_bf16_optimizer(ds: dict, precision: str, zero_stage: int, use_pipeline: bool) -> bool:
    """Whether DeepSpeed wraps the optimizer in BF16_Optimizer: deepspeed/runtime/engine.py
    _do_optimizer_sanity_check (0.19) picks it for bf16 weights with ZeRO 1 and fp32 gradient accumulation
    (without CPU offload), or without ZeRO in the pipeline engine with bf16 accumulation."""
    if precision != "bf16":
        return False
    acc = grad_accum_bytes(ds, precision)
    offload = ((ds.get("zero_optimization") or {}).get("offload_optimizer") or {}).get("device") in ("cpu", "nvme")
    return (zero_stage == 1 and acc == 4 and not offload) or (zero_stage == 0 and use_pipeline and acc == 2)


def keeps_fp32_grads(ds: dict, precision: str, zero_stage: int, use_pipeline: bool) -> bool:
    """Whether DeepSpeed keeps an fp32 gradient per parameter that bf16 micro-batch gradients are added
    into: BF16_Optimizer with fp32 accumulation (``fp32_groups_gradients``). ZeRO 2/3 reduce bf16
    buckets during backward, the fp16 optimizers keep fp16 ``.grad``s until the step, and bf16
    accumulation keeps bf16 buffers: none has an fp32 buffer to accumulate into."""
    return uses_bf16_optimizer(ds, precision, zero_stage, use_pipeline) and grad_accum_bytes(ds, precision) == 4


def describe_gradients(ds: dict, precision: str, zero_stage: int, use_pipeline: bool) -> str:
    """--dry-run's line on the gradients' accumulation and reduction dtype (DeepSpeed's "data_types":
    {"grad_accum_dtype"} and "communication_data_type"; both default to the weights' dtype) and the optimizer
    wrapper DeepSpeed picks for them (runtime/engine.py _do_optimizer_sanity_check)."""
    acc = "fp32" if grad_accum_bytes(ds, precision) == 4 else precision
    comm = str(ds.get("communication_data_type") or precision)
    if uses_bf16_optimizer(ds, precision, zero_stage, use_pipeline):
        wrapper = "DeepSpeed's BF16_Optimizer"
    elif zero_stage:
        wrapper = f"DeepSpeed's ZeRO stage {zero_stage} optimizer"
    else:
        wrapper = f"DeepSpeed's {precision} optimizer"
    return f"gradients: accumulated in {acc}, reduced in {comm} ({wrapper}; fp32 main weights)"


def build_ds_config(template: dict | None, *, micro: int, global_batch: int, gas: int, precision: str,
                    zero_stage: int, clip_grad: float, sequence_parallel: bool, notes: list | None = None,
                    moe: bool = False, partition_activations: bool = True) -> dict:
    """Merge the user's DeepSpeed JSON with what the command line owns, rejecting contradictions.
    A stale batch size / accumulation count in the JSON loses to the command line with a note, as in
    Megatron-DeepSpeed, whose train loop calls engine.set_train_batch_size(DP x micro x micro-batches)
    before every step (megatron/training.py train); a different micro-batch size would really break."""
    ds = copy.deepcopy(template or {})
    for key, value, flag in (("train_batch_size", global_batch, "--global-batch-size"),
                             ("train_micro_batch_size_per_gpu", micro, "--micro-batch-size"),
                             ("gradient_accumulation_steps", gas, "global/(micro x DP)")):
        if ds.get(key, "auto") not in ("auto", value):
            if key == "train_micro_batch_size_per_gpu" or notes is None:
                raise _json_conflict(key, ds[key], flag, value)
            notes.append(f"DeepSpeed JSON {key} = {ds[key]} is overridden by {flag}: {value} "
                         f"(the command line sets the engine's batch, as in Megatron-DeepSpeed)")
        ds[key] = value
    for name in ("fp16", "bf16"):
        block = ds.get(name) or {}
        enabled = block.get("enabled", "auto")
        want = precision == name
        if enabled != "auto" and bool(enabled) != want:
            cli = {"fp16": "--fp16", "bf16": "--bf16", "fp32": "fp32 (neither --fp16 nor --bf16)"}[precision]
            raise _json_conflict(f'"{name}.enabled"', enabled, "the precision flag", cli)
        block["enabled"] = want
        ds[name] = block
    zero = ds.setdefault("zero_optimization", {})
    if zero.get("stage", zero_stage) != zero_stage:
        raise _json_conflict('"zero_optimization.stage"', zero["stage"], "--zero-stage", zero_stage)
    zero["stage"] = zero_stage
    if "optimizer" in ds or "scheduler" in ds:
        raise ConfigError('the DeepSpeed JSON has an "optimizer"/"scheduler" block, but the command line '
                          'owns them (--lr, --lr-decay-style, --adam-beta1 ...); remove the block')
    if ds.get("gradient_clipping", clip_grad) != clip_grad:
        raise _json_conflict("gradient_clipping", ds["gradient_clipping"], "--clip-grad", clip_grad)
    ds["gradient_clipping"] = clip_grad
    if guards_optimizer(precision, zero_stage):
        ds["gradient_clipping"] = 0.0  # our optimizer guard clips instead (see guards_optimizer)
    # DeepSpeed's pipeline partitions activations over TP ranks assuming they are replicated; under
    # sequence parallelism they are already split (and differ per rank), so that must be off.
    # An MoE model sends two tensors between stages (the hidden state and the MoE layers' auxiliary loss),
    # which DeepSpeed's partitioned pipeline messages do not handle: Megatron-DeepSpeed asserts both off for
    # MoE at PP > 1 and TP > 1 (megatron/model/gpt_model.py GPTModelPipe). partition_activations=False:
    # the model sends several tensors that need gradients (T5), and the partitioned path sends back only
    # the first one's (runtime/pipe/engine.py _exec_send_grads)
    split = partition_activations and not sequence_parallel and not moe
    ds.setdefault("pipeline", {}).update(pipe_partitioned=split, grad_partitioned=split)
    ds.setdefault("steps_per_print", 10 ** 9)  # we print Megatron's iteration line ourselves
    ds.setdefault("wall_clock_breakdown", False)
    return ds


def check_cpu_optimizer(ds: dict, *, cpu_optimizer: bool, torch_adam: bool, optimizer: str) -> list[str]:
    """--cpu-optimizer / --cpu_torch_adam against the JSON's ZeRO-Offload: one-line errors where they disagree
    or DeepSpeed would refuse the pair at start-up; the notes of flags without effect.
    Megatron-DeepSpeed (megatron/optimizer/__init__.py) builds DeepSpeedCPUAdam for --cpu-optimizer,
    torch.optim.AdamW with --cpu_torch_adam, else its GPU Adam; deepspeed/runtime/engine.py refuses
    ZeRO-Offload with any client optimizer but DeepSpeedCPUAdam unless "zero_force_ds_cpu_optimizer" is
    false, and ZeRO-3's partial offload ("ratio" < 1) takes DeepSpeedCPUAdam only (runtime/zero/stage3.py)."""
    offload = (ds.get("zero_optimization") or {}).get("offload_optimizer") or {}
    offloaded = offload.get("device") in ("cpu", "nvme")
    cpu_adam = cpu_optimizer and not torch_adam
    if cpu_optimizer and optimizer != "adam":
        raise ConfigError(f"--cpu-optimizer builds an Adam optimizer (Megatron-DeepSpeed: \"CPU offloading is for "
                          f"Adam\"); drop --optimizer {optimizer} or --cpu-optimizer")
    if cpu_optimizer and not offloaded:
        raise ConfigError("--cpu-optimizer steps the optimizer on the CPU, but the DeepSpeed JSON does not offload it; "
                          "add \"offload_optimizer\": {\"device\": \"cpu\"} under \"zero_optimization\" "
                          "(ZeRO stage >= 1) or drop --cpu-optimizer")
    if offloaded and offload.get("ratio", 1.0) < 1.0 and not cpu_adam:
        raise ConfigError(f"offload_optimizer \"ratio\" {offload['ratio']} (ZeRO-3 partial offload) runs only "
                          f"DeepSpeedCPUAdam: pass --cpu-optimizer (without --cpu_torch_adam)")
    if offloaded and not cpu_adam and ds.get("zero_force_ds_cpu_optimizer", True) is not False:
        given = "--cpu_torch_adam builds torch.optim.AdamW" if cpu_optimizer else "without --cpu-optimizer the " \
            "optimizer is torch.optim.AdamW"
        raise ConfigError(f"zero_optimization.offload_optimizer: {given}, which DeepSpeed refuses with ZeRO-Offload "
                          f"unless the JSON says \"zero_force_ds_cpu_optimizer\": false; add that, or pass "
                          f"--cpu-optimizer for DeepSpeedCPUAdam")
    if torch_adam and not cpu_optimizer:
        return ["--cpu_torch_adam has no effect without --cpu-optimizer (as in Megatron-DeepSpeed)"]
    return []


# Features DeepSpeed accepts in the JSON but that need the training loop's cooperation, which
# megatron_ds does not give: (predicate on the JSON, why, what to do instead).
_NOT_IMPLEMENTED = (
    (lambda ds: (((ds.get("data_efficiency") or {}).get("data_sampling") or {})
                 .get("curriculum_learning") or {}).get("enabled"),
     "data_efficiency.data_sampling.curriculum_learning needs DeepSpeed's data-efficiency sampler (its own "
     "sample order), which megatron_ds does not have; for a sequence-length warm-up use the legacy top-level "
     "\"curriculum_learning\" block (seqlen, fixed_linear/fixed_root/fixed_discrete) instead"),
    (lambda ds: ((ds.get("data_efficiency") or {}).get("data_routing") or {}).get("enabled"),
     "data_efficiency.data_routing (random-LTD) is not supported; remove the block"),
    (lambda ds: "compression_training" in ds,
     "compression_training is not supported; remove the block"),
    # deepspeed/runtime/checkpoint_engine/utils.py (0.19) picks its Fast/Decoupled engines for
    # "checkpoint": {"writer": ...}; they read the DeepSpeed launcher's CROSS_SIZE (a KeyError under
    # mpirun), the decoupled one writes after save_checkpoint returns (the manifest would checksum
    # half-written files), and with bf16 it cannot send the optimizer's non-leaf tensors to its writer
    (lambda ds: (ds.get("checkpoint") or {}).get("writer") is not None,
     "checkpoint.writer (DeepSpeed's fast/decoupled checkpoint writers) is not supported: they need "
     "DeepSpeed's own launcher and finish writing after the save returns, before megatron_ds checks the "
     "files; remove the \"writer\" block"),
)

def validate_with_deepspeed(ds_config: dict, source: str = "the DeepSpeed JSON") -> None:
    """Raise ConfigError with DeepSpeed's own message if it would refuse ``ds_config``."""
    for refused, why in _NOT_IMPLEMENTED:
        if refused(ds_config):
            raise ConfigError(f"{source}: {why}")
    from megatron_ds.ds_compat import parse_deepspeed_config  # noqa: PLC0415 - heavy; only when validating

    probe = copy.deepcopy(ds_config)
    probe.pop("train_batch_size", None)  # checked by build_layout against the real DP size
    quiet = logging.getLogger("DeepSpeed")
    level = quiet.level
    quiet.setLevel(logging.WARNING)  # DeepSpeedConfig logs its whole content at INFO
    try:
        read = parse_deepspeed_config(probe)
    except Exception as exc:  # noqa: BLE001 - pydantic / DeepSpeedConfigError / assertions: all are refusals
        message = " ".join(str(exc).split()).rstrip(".") or type(exc).__name__
        raise ConfigError(f"DeepSpeed refuses {source}: {message}") from None
    finally:
        quiet.setLevel(level)
    _refuse_unread_keys(probe, read, source)


def _refuse_unread_keys(ds_config: dict, read: set[str], source: str) -> None:
    """A top-level key DeepSpeed never looks up is silently ignored by it: a misspelt
    "zero_optimisation" trains without ZeRO. Refused, naming the closest key DeepSpeed reads."""
    unread = sorted(k for k in ds_config if k not in read)
    if not unread:
        return
    key = unread[0]
    close = closest(key, sorted(read))
    hint = f"did you mean {close!r}?" if close else "no key DeepSpeed reads is close to it"
    others = f" (also unknown: {', '.join(map(repr, unread[1:]))})" if len(unread) > 1 else ""
    raise ConfigError(f"{source}: DeepSpeed ignores the key {key!r} ({hint}){others}; fix or remove it")
