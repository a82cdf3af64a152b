"""The layout's parallel dimensions (dp, pp, tp, cp), declared once as data.

Each dimension is one :class:`Dimension` in :data:`DIMENSIONS`: its config key, mesh
axis, rank order, roles, random streams, home package and planner keys. Being pure data,
it is imported by ``config``, ``parallel``, ``train`` and ``plan`` alike; what each entry
does is attached in :mod:`disttrain.parallel.dimensions`. Every field, and how context
parallelism fills them: ``docs/architecture.md``, "A parallel dimension is data".
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Iterable
from dataclasses import dataclass


class Role(enum.Enum):
    """What a dimension does to a training step: all that the code above reads of it."""

    SAMPLES = "samples"  # each global batch's samples split over its ranks
    # its ranks hold the same parameters; gradients summed (and ZeRO sharded) over the
    # flattened group of every such dimension, where the data-parallel strategy runs
    REPLICAS = "replicas"
    TENSORS = "tensors"  # parameter tensors cut into boxes, one per rank
    LAYERS = "layers"  # the model's layers cut into stages, one per rank
    TOKENS = "tokens"  # each sample's tokens split over its ranks, each runs the whole model


@dataclass(frozen=True, kw_only=True)
class PlanOption:
    """A search key of the planner that belongs to one dimension (the pipeline's chunks
    per rank ``v``). ``position``: its place in a planned layout's label among every
    key (dimensions' degrees, these, and the planner's own ``mbs``, ``zero``,
    ``recompute``); ``always_shown``: in the label even at ``default``; ``flag``: a
    yes / no choice (written 0 / 1)."""

    name: str
    default: int
    position: int
    always_shown: bool = True
    flag: bool = False


@dataclass(frozen=True, kw_only=True)
class Dimension:
    """One parallel dimension of the layout: ``key`` its ``[parallel]`` field and degree
    (``derived``: 0 there means the ranks the others leave); ``axis`` its mesh axis,
    ``rank_order`` that axis's place, outermost (0) first, global ranks row-major over
    the mesh; ``own_streams``: its ranks draw distinct random streams; ``home`` the
    package holding its behaviour; ``plan_position`` / ``plan_options`` its place and its
    search keys in a planned layout's label."""

    key: str
    axis: str
    rank_order: int
    plan_position: int
    roles: frozenset[Role]
    own_streams: bool
    home: str
    derived: bool = False
    plan_options: tuple[PlanOption, ...] = ()

    @property
    def config_key(self) -> str:
        """Its field as the user writes it: ``parallel.<key>``."""
        return f"parallel.{self.key}"

    def has(self, role: Role) -> bool:
        return role in self.roles

    @property
    def changes_model(self) -> bool:
        """Whether it changes the model a replica runs (a role beyond splitting the
        samples and holding replicas: it shards, cuts, ...)."""
        return bool(self.roles - {Role.SAMPLES, Role.REPLICAS})


DIMENSIONS: tuple[Dimension, ...] = (
    Dimension(key="dp", axis="dp", rank_order=1, plan_position=30, derived=True,
              roles=frozenset({Role.SAMPLES, Role.REPLICAS}), own_streams=True,
              home="disttrain.parallel.data"),
    # v: model chunks per pipeline rank (> 1: the interleaved schedule); gpipe: GPipe's;
    # zb: a zero-bubble schedule (1: zb1, 2: zbv with v = 2)
    Dimension(key="pp", axis="pp", rank_order=0, plan_position=20,
              roles=frozenset({Role.LAYERS}), own_streams=True,
              home="disttrain.parallel.pipeline",
              plan_options=(PlanOption(name="v", default=1, position=40),
                            PlanOption(name="gpipe", default=0, position=90,
                                       always_shown=False, flag=True),
                            PlanOption(name="zb", default=0, position=91,
                                       always_shown=False))),
    # sp: sequence parallelism
    Dimension(key="tp", axis="tp", rank_order=3, plan_position=10,
              roles=frozenset({Role.TENSORS}), own_streams=False,
              home="disttrain.parallel.tensor",
              plan_options=(PlanOption(name="sp", default=0, position=80, flag=True),)),
    Dimension(key="cp", axis="cp", rank_order=2, plan_position=25,
              roles=frozenset({Role.REPLICAS, Role.TOKENS}), own_streams=True,
              home="disttrain.parallel.context"),
)


def dimension(key: str) -> Dimension:
    """The entry whose config key is ``key`` (a dimension's own code finds itself so)."""
    for d in DIMENSIONS:
        if d.key == key:
            return d
    raise KeyError(f"no parallel dimension {key!r}; the dimensions are "
                   f"{', '.join(d.key for d in DIMENSIONS)}")


@functools.cache
def mesh_order() -> tuple[Dimension, ...]:
    """The entries in rank order, outermost first: the mesh's axes."""
    return tuple(sorted(DIMENSIONS, key=lambda d: d.rank_order))


@functools.cache
def plan_order() -> tuple[Dimension, ...]:
    """The entries in the order of a planned layout's label."""
    return tuple(sorted(DIMENSIONS, key=lambda d: d.plan_position))


@functools.cache
def with_role(role: Role) -> tuple[Dimension, ...]:
    """The entries that take ``role``, in rank order."""
    return tuple(d for d in mesh_order() if d.has(role))


def derived_dimension() -> Dimension:
    """The entry whose degree the others' leave (exactly one is declared so)."""
    found = [d for d in DIMENSIONS if d.derived]
    if len(found) != 1:
        raise RuntimeError(f"exactly one dimension must be derived, found {len(found)}")
    return found[0]


def joined(dims: Iterable[Dimension], sep: str = " x ") -> str:
    """Their keys joined, for a message: ``pp x tp``."""
    return sep.join(d.key for d in dims)


def spoken(dims: Iterable[Dimension]) -> str:
    """Their keys as a list in words: ``pp``, ``pp and tp``, ``pp, cp and tp``."""
    keys = [d.key for d in dims]
    return keys[0] if len(keys) == 1 else f"{', '.join(keys[:-1])} and {keys[-1]}"
