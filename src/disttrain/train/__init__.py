"""The training loop and the default job."""

from .job import build_default_job, train_default
from .trainer import Trainer

__all__ = ["Trainer", "build_default_job", "train_default"]
