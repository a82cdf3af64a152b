"""Each declared dimension's behaviour, attached to its entry: what it applies to a
model, its check, and how the planner prices it.

:data:`disttrain.dimensions.DIMENSIONS` declares the dimensions as pure data, low enough
for ``config`` to read. Their behaviour lives in each one's home package
(``Dimension.home``) and is attached here, in one place: a :class:`Behaviour` per entry,
:data:`BEHAVIOURS` in the declaration's order. Importing this module checks that every
entry has exactly one, from its own home.

- ``apply``: what the dimension does to a model replica (:mod:`.applied`); None for
  one that applies nothing itself (dp: the data-parallel strategy runs over the replica
  group). The composition (:mod:`.model_parallel`) applies the in-place ones innermost axis
  first (tp), then activation checkpointing, then the one that cuts the layers (pp).
- ``check``: its compatibility check against the config, the model's spec and the
  resolved layout (before any process group exists; ``micro_batches`` per step and
  replica; ``model()``: the model, or one built on the meta device from the config,
  for a check that reads its modules); validation runs them in the same order.
- ``pricing``: what the planner asks it (:mod:`.pricing`: candidates, rules, search
  keys; the holder of the tensor-sharding role its communication, the holder of the
  layer-cutting role its stages, the holder of the token-splitting role its
  attention's messages), pure Python, importing nothing of the planner.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from torch import nn

from ..config.layout import Layout
from ..config.schema import Config
from ..dimensions import DIMENSIONS, Dimension, Role
from ..spec import ModelSpec
from .applied import AppliedDimension, ApplyContext
from .context.check import check_context
from .context.dimension import ENTRY as CONTEXT
from .context.dimension import apply_context_dimension
from .context.pricing import PRICING as CONTEXT_PRICING
from .data.dimension import ENTRY as DATA
from .data.pricing import PRICING as DATA_PRICING
from .pipeline.check import check_pipeline
from .pipeline.dimension import ENTRY as PIPELINE
from .pipeline.dimension import apply_pipeline_dimension
from .pipeline.pricing import PRICING as PIPELINE_PRICING
from .pricing import DimensionPricing, StagePricing, TensorPricing, TokenPricing
from .tensor.check import check_tensor
from .tensor.dimension import ENTRY as TENSOR
from .tensor.dimension import apply_tensor_dimension
from .tensor.pricing import PRICING as TENSOR_PRICING

Apply = Callable[[nn.Module, ApplyContext], AppliedDimension]
# the model (or one built on the meta device from the config), built when a check asks
ModelOf = Callable[[], nn.Module]
Check = Callable[[Config, Layout, ModelSpec, int, ModelOf], None]


@dataclass(frozen=True)
class Behaviour:
    """One entry's behaviour (see the module docstring)."""

    dimension: Dimension
    apply: Apply | None
    check: Check | None
    pricing: DimensionPricing


BEHAVIOURS: tuple[Behaviour, ...] = (
    Behaviour(DATA, apply=None, check=None, pricing=DATA_PRICING),
    Behaviour(PIPELINE, apply=apply_pipeline_dimension, check=check_pipeline,
              pricing=PIPELINE_PRICING),
    Behaviour(TENSOR, apply=apply_tensor_dimension, check=check_tensor,
              pricing=TENSOR_PRICING),
    Behaviour(CONTEXT, apply=apply_context_dimension, check=check_context,
              pricing=CONTEXT_PRICING),
)


def _attached() -> None:
    """Every declared entry has exactly one behaviour, defined in its own home."""
    declared = [d.key for d in DIMENSIONS]
    attached = [b.dimension.key for b in BEHAVIOURS]
    if sorted(declared) != sorted(attached):
        raise RuntimeError(f"dimensions declared {declared} but behaviours attached to "
                           f"{attached}: attach one per entry in {__name__}")
    for b in BEHAVIOURS:
        for fn in (b.apply, b.check, type(b.pricing)):
            if fn is not None and not fn.__module__.startswith(b.dimension.home):
                raise RuntimeError(f"{b.dimension.key}'s {fn.__name__} lives in "
                                   f"{fn.__module__}, outside its home {b.dimension.home}")


_attached()


def in_apply_order() -> tuple[Behaviour, ...]:
    """The behaviours in the order the composition applies and validation checks them:
    innermost axis first, the one that cuts the layers last."""
    return tuple(sorted(BEHAVIOURS, key=lambda b: (b.dimension.has(Role.LAYERS),
                                                   -b.dimension.rank_order)))


def check_dimensions(config: Config, layout: Layout, spec: ModelSpec,
                     micro_batches: int, model: ModelOf) -> None:
    """Every dimension's own check (see the module docstring)."""
    for b in in_apply_order():
        if b.check is not None:
            b.check(config, layout, spec, micro_batches, model)


_BY_KEY = {b.dimension.key: b for b in BEHAVIOURS}


def behaviour(dimension: Dimension) -> Behaviour:
    """The behaviour attached to ``dimension``."""
    return _BY_KEY[dimension.key]


def _role_pricing(role: Role) -> DimensionPricing:
    found = [b.pricing for b in BEHAVIOURS if b.dimension.has(role)]
    if len(found) != 1:
        raise RuntimeError(f"the planner prices one dimension of role {role.name}, "
                           f"{len(found)} are declared")
    return found[0]


@functools.cache
def shard_pricing() -> TensorPricing:
    """The pricing of the dimension that shards tensors (its communication)."""
    return cast(TensorPricing, _role_pricing(Role.TENSORS))


@functools.cache
def stage_pricing() -> StagePricing:
    """The pricing of the dimension that cuts the layers (its stages)."""
    return cast(StagePricing, _role_pricing(Role.LAYERS))


@functools.cache
def token_pricing() -> TokenPricing:
    """The pricing of the dimension that splits each sample's tokens (its messages)."""
    return cast(TokenPricing, _role_pricing(Role.TOKENS))
