"""Configuration: the flags (schema, arguments), their resolution into one ``Run`` (run, layout,
schedule, validation, megatron_overrides, deepspeed_json), and the memory estimate (memory).

    argv --parse_args--> Config (frozen flags) --resolve--> Run (layout + runtime sections)
"""
from megatron_ds.config.arguments import build_parser, parse_args
from megatron_ds.config.layout import Layout, count_parameters, resolve_model_config
from megatron_ds.config.run import Run, resolve
from megatron_ds.config.schema import (CheckpointConfig, Config, DataConfig, DeepSpeedConfig, LoggingConfig,
                                       ModelConfig, OptimizerConfig, ParallelConfig, TrainingConfig)

__all__ = [
    "build_parser", "parse_args", "Layout", "count_parameters", "resolve_model_config", "Run", "resolve",
    "CheckpointConfig", "Config", "DataConfig", "DeepSpeedConfig", "LoggingConfig", "ModelConfig",
    "OptimizerConfig", "ParallelConfig", "TrainingConfig",
]
