"""The sync modes' compatibility checks (run by validation before launch)."""

from __future__ import annotations

from ...config.layout import Layout
from ...config.schema import Config
from ...dimensions import DIMENSIONS, Role
from ...errors import ConfigError
from ...names import CODEC_NONE, CODEC_SYNC_MODES
from ..strategy import Check


def apart_check(then: Check | None = None) -> Check:
    """A mode whose replicas train apart: whole, unsharded replicas (no zero, and no
    dimension beyond the one splitting the samples: every other changes the model or
    ties ranks that must step together); a mode in ``names.CODEC_SYNC_MODES`` compresses
    its per-round updates with ``comm.codec``, any other sends parameters uncompressed
    and refuses one; ``then``: the mode's own check."""
    def check(config: Config, layout: Layout) -> None:
        mode, codec, p = config.train.sync, config.comm.codec, config.parallel
        takes_codec = mode in CODEC_SYNC_MODES
        others = [(d.key, getattr(p, d.key), 1) for d in DIMENSIONS
                  if not d.has(Role.SAMPLES)]
        for key, value, off in [("zero", p.zero, 0), *others]:
            if value != off:
                raise ConfigError(f"parallel.{key}", value,
                                  f"is not supported with train.sync={mode} (replicas keep "
                                  "whole, unsharded models)",
                                  f"set parallel.{key}={off}, or train.sync=every_step")
        if codec != CODEC_NONE and not takes_codec:
            raise ConfigError("comm.codec", codec,
                              f"compresses the every_step gradients and the "
                              f"{' / '.join(CODEC_SYNC_MODES)} updates; train.sync={mode} "
                              "sends parameters, uncompressed",
                              "set comm.codec=none, or train.sync=every_step, "
                              f"{', '.join(CODEC_SYNC_MODES[:-1])} or {CODEC_SYNC_MODES[-1]}")
        if then is not None:
            then(config, layout)
    return check


def check_async(config: Config, layout: Layout) -> None:
    """Parameter servers need workers beside them and write no checkpoints."""
    t = config.train
    ranks = layout.role(Role.SAMPLES)
    if ranks <= t.ps_servers:
        raise ConfigError("train.ps_servers", t.ps_servers,
                          f"leaves no worker among {ranks} rank(s)",
                          f"use at least {t.ps_servers + 1} ranks, or fewer servers")
    every = config.checkpoint.every
    if every and "checkpoint.every" in config.explicit:
        raise ConfigError("checkpoint.every", every,
                          "async training writes no checkpoints (the servers' optimizer "
                          "state and the workers' progress are not captured)",
                          "set checkpoint.every=0, or use another train.sync mode")
