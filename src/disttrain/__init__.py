"""disttrain: distributed training for PyTorch.

    import disttrain
    trainer = disttrain.Trainer(model, dataset, loss_fn, {"train": {"steps": 100}})
    summary = trainer.fit()

Launch on N local processes with ``disttrain run --nproc N script.py`` (or torchrun).
"""

from .config import Config, load_config
from .errors import ConfigError, UserError
from .monitor.callbacks import Callback
from .spec import ModelSpec
from .train import Trainer, train_default

__version__ = "0.1.0"

__all__ = ["Callback", "Config", "ConfigError", "ModelSpec", "Trainer", "UserError", "load_config",
           "train_default", "__version__"]
