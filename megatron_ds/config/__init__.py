"""Configuration: dataclasses (schema), the generated parser (arguments), derived values (derive)."""
from megatron_ds.config.arguments import build_parser, parse_args
from megatron_ds.config.derive import (ConfigError, Layout, count_parameters, derive, pad_vocab_size,
                                       resolve_model_config)
from megatron_ds.config.schema import (CheckpointConfig, Config, DataConfig, DeepSpeedConfig, LoggingConfig,
                                       ModelConfig, OptimizerConfig, ParallelConfig, TrainingConfig)
from megatron_ds.config.io import load_ds_template

__all__ = [
    "build_parser", "parse_args", "ConfigError", "Layout", "count_parameters", "derive", "pad_vocab_size",
    "resolve_model_config", "CheckpointConfig", "Config", "DataConfig", "DeepSpeedConfig", "LoggingConfig",
    "ModelConfig", "OptimizerConfig", "ParallelConfig", "TrainingConfig", "load_ds_template",
]
