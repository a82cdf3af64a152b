"""The layout of ranks as pure data: a validated (dp, pp, tp, zero).

Checked against a world size before any process group exists;
:mod:`disttrain.parallel.topology` makes it live as a DeviceMesh.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError

# Strategies whose implementation has landed. Validation refuses a layout that needs
# one that has not, with the fix, instead of failing inside a collective.
AVAILABLE = {"pp": True, "tp": True, "zero": True}


@dataclass(frozen=True, kw_only=True)
class Layout:
    """How the world is split: ``dp * pp * tp == world_size``; ``zero`` shards over dp."""

    dp: int
    pp: int = 1
    tp: int = 1
    zero: int = 0

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    def shape(self) -> tuple[int, int, int]:
        return (self.pp, self.dp, self.tp)

    def as_dict(self) -> dict[str, int]:
        """As checkpoints and summaries record it."""
        return {"dp": self.dp, "pp": self.pp, "tp": self.tp, "zero": self.zero}

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """(pp, dp, tp) coordinates of global ``rank``: the mesh of :meth:`shape`
        numbers ranks row-major, tp innermost."""
        pp, rest = divmod(rank, self.dp * self.tp)
        return (pp, *divmod(rest, self.tp))


def resolve_layout(*, dp: int, pp: int, tp: int, zero: int, world_size: int) -> Layout:
    """Derive dp when it is 0 and check the product against the world size."""
    if world_size % (pp * tp):
        raise ConfigError("parallel.pp x parallel.tp", pp * tp,
                          f"does not divide the world size {world_size}",
                          "choose pp and tp whose product divides the number of ranks")
    if dp == 0:
        dp = world_size // (pp * tp)
    if dp * pp * tp != world_size:
        raise ConfigError("parallel.dp", dp,
                          f"dp x pp x tp = {dp}x{pp}x{tp} = {dp * pp * tp} but there are "
                          f"{world_size} ranks",
                          f"set parallel.dp={world_size // (pp * tp)} or 0 to derive it")
    for axis, value, off in (("pp", pp, 1), ("tp", tp, 1), ("zero", zero, 0)):
        if value != off and not AVAILABLE[axis]:
            raise ConfigError(f"parallel.{axis}", value,
                              "this strategy is not available in this version",
                              f"set parallel.{axis}={off}")
    return Layout(dp=dp, pp=pp, tp=tp, zero=zero)
