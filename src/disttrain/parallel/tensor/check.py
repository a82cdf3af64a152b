"""Tensor parallelism's compatibility check (run by validation before launch)."""

from __future__ import annotations

from ...config.layout import Layout
from ...config.schema import Config
from ...errors import ConfigError
from ...spec import ModelSpec
from .apply import check_divisible


def check_tensor(config: Config, layout: Layout, spec: ModelSpec) -> None:
    """Refuse a tp degree the model has no plan for, or one that does not divide its
    heads, widths or vocabulary (sequence length too under sequence parallelism)."""
    if layout.tp == 1:
        return
    if spec.tp_plan is None:
        raise ConfigError("parallel.tp", layout.tp, "this model has no tensor-parallel "
                          "plan", "pass a plan (module-name pattern -> style) in its "
                          "ModelSpec, or set parallel.tp=1")
    if config.parallel.sequence_parallel and spec.sequence_divisor is None:
        raise ConfigError("parallel.sequence_parallel", True, "this model's plan has no "
                          "sequence-parallel region (its forward reshapes activations "
                          "by the full sequence length)", "set "
                          "parallel.sequence_parallel=false; tp still applies")
    if spec.tp_refusal is not None:
        raise ConfigError("parallel.tp", layout.tp, spec.tp_refusal)
    check_divisible(spec, layout.tp, sequence_parallel=config.parallel.sequence_parallel)
