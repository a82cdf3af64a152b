"""Sharded, atomic, reshardable checkpoints (safetensors + a JSON index)."""

from ..errors import CheckpointRejected
from .format import CheckpointIndex, ShardReader
from .manager import CheckpointManager, checkpoint_root, find_checkpoint, open_checkpoint

__all__ = ["CheckpointIndex", "CheckpointManager", "CheckpointRejected", "ShardReader",
           "checkpoint_root", "find_checkpoint", "open_checkpoint"]
