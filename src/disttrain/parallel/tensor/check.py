"""Tensor parallelism's compatibility check (run by validation before launch)."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from ...config.layout import Layout
from ...config.schema import Config
from ...dimensions import dimension
from ...errors import ConfigError
from ...spec import ModelSpec
from .apply import check_divisible

ENTRY = dimension("tp")


def check_tensor(config: Config, layout: Layout, spec: ModelSpec, micro_batches: int,
                 model: Callable[[], nn.Module]) -> None:
    """Refuse a tp degree the model has no plan for, or one that does not divide its
    heads, widths or vocabulary (sequence length too under sequence parallelism), and
    ``train.compile`` beside it (``micro_batches``, ``model``: unused, every
    dimension's check takes them)."""
    tp = layout.degree(ENTRY.key)
    if tp == 1:
        return
    if spec.tp_plan is None:
        raise ConfigError("parallel.tp", tp, "this model has no tensor-parallel "
                          "plan", "pass a plan (module-name pattern -> style) in its "
                          "ModelSpec, or set parallel.tp=1")
    if config.parallel.sequence_parallel and spec.sequence_divisor is None:
        raise ConfigError("parallel.sequence_parallel", True, "this model's plan has no "
                          "sequence-parallel region (its forward reshapes activations "
                          "by the full sequence length)", "set "
                          "parallel.sequence_parallel=false; tp still applies")
    if spec.tp_refusal is not None:
        raise ConfigError("parallel.tp", tp, spec.tp_refusal)
    check_divisible(spec, tp, sequence_parallel=config.parallel.sequence_parallel)
    if config.train.compile:
        raise ConfigError("train.compile", True, f"does not apply with parallel.tp={tp} "
                          "(tensor-parallel layers run collectives through "
                          "disttrain's communicator inside every block: torch.compile "
                          "would split each block at each of them, or trace them past "
                          "the communicator's ledger and checks)",
                          "set train.compile=false, or parallel.tp=1")
