"""Configuration: typed sections, TOML + ``--set`` loading, whole-config validation."""

from .consistency import BatchPlan, RunPlan, resolve_batch
from .layout import Layout, resolve_layout
from .load import load_config
from .schema import SECTIONS, Config, DataConfig, ModelConfig, ParallelConfig, TrainConfig

__all__ = ["SECTIONS", "BatchPlan", "Config", "DataConfig", "ModelConfig", "ParallelConfig",
           "Layout", "RunPlan", "TrainConfig", "load_config", "resolve_batch",
           "resolve_layout"]
