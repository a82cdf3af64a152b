"""The sync modes' compatibility check (run by validation before launch)."""

from __future__ import annotations

from ...config.schema import Config
from ...errors import ConfigError
from ...names import CODEC_NONE, CODEC_SYNC_MODES, SYNC_ASYNC, SYNC_EVERY_STEP
from ...config.layout import Layout


def check_sync(config: Config, layout: Layout) -> None:
    """Modes other than every_step keep whole replicas; async needs workers and writes
    no checkpoints; codecs compress only gradients and local updates."""
    mode = config.train.sync
    codec = config.comm.codec
    if mode == SYNC_EVERY_STEP:
        return
    p = config.parallel
    for key, value, off in (("zero", p.zero, 0), ("pp", p.pp, 1), ("tp", p.tp, 1)):
        if value != off:
            raise ConfigError(f"parallel.{key}", value,
                              f"is not supported with train.sync={mode} (replicas keep "
                              "whole, unsharded models)",
                              f"set parallel.{key}={off}, or train.sync=every_step")
    if codec != CODEC_NONE and mode not in CODEC_SYNC_MODES:
        raise ConfigError("comm.codec", codec,
                          f"compresses the every_step gradients and the local_sgd / "
                          f"diloco updates; train.sync={mode} sends parameters, "
                          "uncompressed", "set comm.codec=none, or train.sync=every_step, "
                          "local_sgd or diloco")
    if mode == SYNC_ASYNC:
        _check_async(config, layout)


def _check_async(config: Config, layout: Layout) -> None:
    t = config.train
    if layout.dp <= t.ps_servers:
        raise ConfigError("train.ps_servers", t.ps_servers,
                          f"leaves no worker among {layout.dp} rank(s)",
                          f"use at least {t.ps_servers + 1} ranks, or fewer servers")
    every = config.checkpoint.every
    if every and "checkpoint.every" in config.explicit:
        raise ConfigError("checkpoint.every", every,
                          "async training writes no checkpoints (the servers' optimizer "
                          "state and the workers' progress are not captured)",
                          "set checkpoint.every=0, or use another train.sync mode")
