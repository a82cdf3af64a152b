"""How the planner prices data parallelism (``dp``): nothing of its own. Its degree is
what the others leave; the planner prices the roles it takes (the global batch split
over its ranks, the replica group's gradient reduction and ZeRO's sharding) over the
roles' degrees, so they cover every dimension that takes them."""

from __future__ import annotations

from collections.abc import Sequence

from ...config.schema import ParallelConfig
from ...dimensions import dimension
from ..pricing import LayoutFacts, SearchLimits, ShapeFacts

ENTRY = dimension("dp")


class DataPricing:
    """dp's pricing (:class:`~..pricing.DimensionPricing`): the rest of the devices."""

    def candidates(self, ranks: int, limits: SearchLimits) -> list[int]:
        return [ranks]

    def option_values(self, name: str, degree: int, limits: SearchLimits) -> Sequence[int]:
        raise KeyError(f"dp has no search key {name!r}")

    def options_problem(self, layout: LayoutFacts) -> str | None:
        return None  # no search keys

    def problem(self, shape: ShapeFacts, layout: LayoutFacts, limits: SearchLimits
                ) -> str | None:
        return None

    def batch_problem(self, layout: LayoutFacts, micro_batches: int) -> str | None:
        return None

    def options_from_config(self, parallel: ParallelConfig, degree: int) -> dict[str, int]:
        return {}

    def config_values(self, layout: LayoutFacts) -> dict[str, object]:
        return {"dp": layout.degree(ENTRY.key)}


PRICING = DataPricing()
