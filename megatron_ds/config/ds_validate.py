"""The merged DeepSpeed JSON checked by DeepSpeed's own config parser, before the queue.

``deepspeed.runtime.config.DeepSpeedConfig`` is what ``deepspeed.initialize`` builds; it refuses unknown
keys (pydantic), removed blocks and inconsistent batch settings. Running it in ``--dry-run`` and at
start-up means whatever DeepSpeed will refuse is refused before hours in the queue, with its message.
It needs no process group: its batch check multiplies by the world size of the current process (1
without distributed), so the data parallel batch is checked by derive() and left out here.
"""
from __future__ import annotations

import copy
import logging

from megatron_ds.config.derive import ConfigError

# Features DeepSpeed accepts in the JSON but that need the training loop's cooperation, which
# megatron_ds does not give: (predicate on the JSON, why, what to do instead).
_NOT_IMPLEMENTED = (
    (lambda ds: (((ds.get("data_efficiency") or {}).get("data_sampling") or {})
                 .get("curriculum_learning") or {}).get("enabled"),
     "data_efficiency.data_sampling.curriculum_learning needs Megatron-DeepSpeed's data-efficiency data "
     "loader, which megatron_ds does not have; remove the block"),
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
    # deepspeed/runtime/engine.py refuses ZeRO-Offload with a client optimizer (megatron_ds passes its
    # own AdamW) unless told otherwise -- at start-up, after the queue, so it is checked here
    (lambda ds: (((ds.get("zero_optimization") or {}).get("offload_optimizer") or {}).get("device")
                 in ("cpu", "nvme") and ds.get("zero_force_ds_cpu_optimizer", True) is not False),
     "zero_optimization.offload_optimizer needs \"zero_force_ds_cpu_optimizer\": false (megatron_ds "
     "passes its own AdamW to DeepSpeed, which otherwise refuses ZeRO-Offload at start-up)"),
)

_LEGACY_CURRICULUM = ("megatron_ds does not implement the legacy sequence-length warmup either (Megatron-"
                      "DeepSpeed's --curriculum-learning-legacy); remove the \"curriculum_learning\" block")


def validate_with_deepspeed(ds_config: dict, source: str = "the DeepSpeed JSON") -> None:
    """Raise ConfigError with DeepSpeed's own message if it would refuse ``ds_config``."""
    for refused, why in _NOT_IMPLEMENTED:
        if refused(ds_config):
            raise ConfigError(f"{source}: {why}")
    from megatron_ds.ds_compat import DeepSpeedConfig  # noqa: PLC0415 - heavy; only when validating

    probe = copy.deepcopy(ds_config)
    probe.pop("train_batch_size", None)  # checked by derive() against the real DP size
    quiet = logging.getLogger("DeepSpeed")
    level = quiet.level
    quiet.setLevel(logging.WARNING)  # DeepSpeedConfig logs its whole content at INFO
    try:
        DeepSpeedConfig(probe)
    except Exception as exc:  # noqa: BLE001 - pydantic / DeepSpeedConfigError / assertions: all are refusals
        message = " ".join(str(exc).split()).rstrip(".") or type(exc).__name__
        hint = f"; {_LEGACY_CURRICULUM}" if "curriculum_learning" in message and "Legacy" in message else ""
        raise ConfigError(f"DeepSpeed refuses {source}: {message}{hint}") from None
    finally:
        quiet.setLevel(level)
