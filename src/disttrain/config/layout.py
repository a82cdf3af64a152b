"""The layout of ranks as pure data: a degree per declared dimension, and ``zero``.

The dimensions are :data:`disttrain.dimensions.DIMENSIONS`; a :class:`Layout` holds one
degree for each (their product is the world size) and the ZeRO stage, which shards over
the replica group. Checked against a world size before any process group exists;
:mod:`disttrain.parallel.topology` makes it live as a DeviceMesh.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from ..dimensions import DIMENSIONS, Role, derived_dimension, joined, mesh_order, spoken
from ..errors import ConfigError
from .schema import ParallelConfig


@dataclass(frozen=True)
class Layout:
    """How the world is split: ``degrees`` holds one degree per entry of
    :data:`~disttrain.dimensions.DIMENSIONS` (in its order), whose product is the world
    size; ``zero``: the ZeRO stage over the replica group. Build one with :meth:`of`."""

    degrees: tuple[int, ...]
    zero: int = 0

    def __post_init__(self) -> None:
        if len(self.degrees) != len(DIMENSIONS) or min(self.degrees) < 1:
            raise ValueError(f"a layout needs a degree >= 1 for each of "
                             f"{joined(DIMENSIONS, ', ')}, got {self.degrees}")

    @classmethod
    def of(cls, *, zero: int = 0, **degrees: int) -> Layout:
        """A layout from degrees by config key (a key left out: 1)."""
        unknown = set(degrees) - {d.key for d in DIMENSIONS}
        if unknown:
            raise ValueError(f"no parallel dimension {sorted(unknown)}; the dimensions are "
                             f"{joined(DIMENSIONS, ', ')}")
        return cls(tuple(degrees.get(d.key, 1) for d in DIMENSIONS), zero)

    def degree(self, key: str) -> int:
        """The degree of the dimension whose config key is ``key``."""
        return self.by_key()[key]

    def by_key(self) -> dict[str, int]:
        """Config key -> degree, in declaration order."""
        return {d.key: n for d, n in zip(DIMENSIONS, self.degrees, strict=True)}

    def role(self, role: Role) -> int:
        """The product of the degrees of the dimensions that take ``role`` (the replica
        group's size, the ranks a global batch is split over, ...)."""
        by_key = self.by_key()
        return math.prod(by_key[d.key] for d in DIMENSIONS if d.has(role))

    @property
    def world_size(self) -> int:
        return math.prod(self.degrees)

    def shape(self) -> tuple[int, ...]:
        """The mesh's shape: the degrees in rank order, outermost first."""
        by_key = self.by_key()
        return tuple(by_key[d.key] for d in mesh_order())

    def as_dict(self) -> dict[str, int]:
        """As checkpoints and summaries record it."""
        return {**self.by_key(), "zero": self.zero}

    def coordinates(self, rank: int) -> dict[str, int]:
        """Config key -> coordinate of global ``rank`` on that axis: the mesh of
        :meth:`shape` numbers ranks row-major, the last axis innermost."""
        out: dict[str, int] = {}
        for d, n in reversed(list(zip(mesh_order(), self.shape(), strict=True))):
            rank, out[d.key] = divmod(rank, n)
        return out


def config_degrees(parallel: ParallelConfig) -> dict[str, int]:
    """Config key -> degree as a ``[parallel]`` section gives them (the derived one may be
    0: derive it)."""
    return {d.key: int(getattr(parallel, d.key)) for d in DIMENSIONS}


def resolve_layout(parallel: ParallelConfig, world_size: int) -> Layout:
    """The ``[parallel]`` section's layout on ``world_size`` ranks: the derived
    dimension's degree derived when it is 0, the product checked against the world."""
    return layout_from(config_degrees(parallel), zero=parallel.zero, world_size=world_size)


def layout_from(degrees: Mapping[str, int], *, zero: int, world_size: int) -> Layout:
    """:func:`resolve_layout` of ``degrees`` (config key -> degree)."""
    rest = derived_dimension()
    fixed = [d for d in DIMENSIONS if not d.derived]
    others = math.prod(degrees[d.key] for d in fixed)
    if world_size % others:
        raise ConfigError(" x ".join(d.config_key for d in fixed), others,
                          f"does not divide the world size {world_size}",
                          f"choose {spoken(fixed)} whose product divides the number of ranks")
    given = dict(degrees)
    if given[rest.key] == 0:
        given[rest.key] = world_size // others
    total = math.prod(given[d.key] for d in DIMENSIONS)
    if total != world_size:
        spelled = "x".join(str(given[d.key]) for d in DIMENSIONS)
        raise ConfigError(rest.config_key, given[rest.key],
                          f"{joined(DIMENSIONS)} = {spelled} = {total} but there are "
                          f"{world_size} ranks",
                          f"set {rest.config_key}={world_size // others} or 0 to derive it")
    return Layout(tuple(given[d.key] for d in DIMENSIONS), zero)
