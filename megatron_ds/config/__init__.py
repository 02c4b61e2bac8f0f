"""Configuration: the flags (schema, arguments), their resolution into one ``Run`` (run, layout,
run_length, curriculum, moe_params, moe_selection (which MoE layer), validation, megatron_overrides,
deepspeed_json), and the per-GPU memory estimate (memory) that refuses a layout before it reaches the queue.

    argv --parse_args--> Config (frozen flags) --resolve--> Run (layout + runtime sections)

Everything here is a pure function of the flags and the world size: no process group, no device.
"""
from megatron_ds.config.arguments import build_parser, parse_args
from megatron_ds.config.layout import Layout, resolve_model_config
from megatron_ds.config.run import Run, resolve
from megatron_ds.config.schema import (CheckpointConfig, Config, DataConfig, DeepSpeedConfig, LoggingConfig,
                                       ModelConfig, OptimizerConfig, ParallelConfig, TrainingConfig)

__all__ = [
    "build_parser", "parse_args", "Layout", "resolve_model_config", "Run", "resolve",
    "CheckpointConfig", "Config", "DataConfig", "DeepSpeedConfig", "LoggingConfig", "ModelConfig",
    "OptimizerConfig", "ParallelConfig", "TrainingConfig",
]
