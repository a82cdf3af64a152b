"""Configuration: typed sections, TOML + ``--set`` loading, whole-config validation."""

from .load import load_config
from .schema import (SECTIONS, Config, DataConfig, ModelConfig, ParallelConfig,
                     TrainConfig)
from .validate import BatchPlan, RunPlan, resolve, resolve_batch

__all__ = ["SECTIONS", "BatchPlan", "Config", "DataConfig", "ModelConfig", "ParallelConfig",
           "RunPlan", "TrainConfig", "load_config", "resolve", "resolve_batch"]
