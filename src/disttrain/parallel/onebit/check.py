"""1-bit Adam's compatibility check (run by validation before any process group)."""

from __future__ import annotations

from ...config.layout import Layout
from ...config.schema import Config
from ...errors import ConfigError
from ...names import CODEC_NONE, STRATEGY_DDP, STRATEGY_ZERO, SYNC_EVERY_STEP
from ..strategy import selected_strategy


def check_onebit(config: Config, layout: Layout) -> None:
    """onebit_adam runs over the ddp strategy's whole replicas or ZeRO-1's shards (any
    pp / tp), every step, and compresses its own exchange (no gradient codec on top)."""
    t = config.train
    if layout.zero > 1:
        raise ConfigError("train.optimizer", t.optimizer,
                          f"is not built for parallel.zero={layout.zero} (each worker "
                          "compresses its whole local gradient; ZeRO-2/3 keep only a "
                          "shard of it)", "set parallel.zero=1 (or 0) with onebit_adam")
    if t.sync != SYNC_EVERY_STEP:
        raise ConfigError("train.optimizer", t.optimizer,
                          f"exchanges its momentum every step; train.sync={t.sync} does not",
                          "set train.sync=every_step, or train.optimizer=adamw")
    if config.comm.codec != CODEC_NONE:
        raise ConfigError("comm.codec", config.comm.codec,
                          "would compress 1-bit Adam's warmup gradients, which must be "
                          "exact (the variance is frozen from them); the optimizer "
                          "compresses its own exchange afterwards",
                          "set comm.codec=none with train.optimizer=onebit_adam")
    strategy = selected_strategy(config)
    if strategy not in (STRATEGY_DDP, STRATEGY_ZERO):
        raise ConfigError("parallel.strategy", strategy,
                          "is not the ddp or zero strategy 1-bit Adam runs on",
                          "set parallel.strategy=auto")
