"""ZeRO's compatibility check (run by validation before any process group exists)."""

from __future__ import annotations

from ...config.layout import Layout
from ...config.schema import Config, ParallelConfig
from ...errors import ConfigError
from ...names import CAST_CODECS, CODEC_NONE

DEFAULT_PREFETCH = ParallelConfig().zero_prefetch


def check_zero(config: Config, layout: Layout) -> None:
    """ZeRO shards flat buffers: codecs other than casts need whole per-parameter
    gradients; a stage must be chosen (the layer-wise optimizers refuse ZeRO in their
    own check)."""
    codec, p = config.comm.codec, config.parallel
    if not p.zero:
        raise ConfigError("parallel.strategy", "zero", "needs a ZeRO stage",
                          "set parallel.zero=1, 2 or 3")
    if p.zero != 3 and p.zero_prefetch != DEFAULT_PREFETCH:
        raise ConfigError("parallel.zero_prefetch", p.zero_prefetch, "applies to ZeRO-3 "
                          f"only (parallel.zero={p.zero} keeps every parameter gathered)",
                          "set parallel.zero=3, or leave parallel.zero_prefetch at "
                          f"{DEFAULT_PREFETCH}")
    if codec != CODEC_NONE and codec not in CAST_CODECS:
        raise ConfigError("comm.codec", codec, f"is not supported with parallel.zero="
                          f"{p.zero} (ZeRO reduce-scatters flat shards; only the fp16/bf16 "
                          "casts apply to a reduce-scatter)",
                          "use comm.codec=fp16 or bf16 with ZeRO, or parallel.zero=0 for "
                          f"{codec}")
