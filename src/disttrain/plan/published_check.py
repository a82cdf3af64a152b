"""The planner against a published table (:mod:`.published`, :mod:`.published_layouts`):
for each row, its figure predicted for the published layout (error = predicted /
published - 1), the rank of the published layout among every layout the search
considers, and whether the planner makes the row's recomputation choice.

- Prediction: the row's layout as published; where the source gives the degrees only
  (``degrees_only``), the planner's fastest layout of those degrees (it picks the
  micro-batch, schedule, ZeRO stage and recomputation, except a published "full").
- Rank: the search's layouts that fit (of the ZeRO stages the row's framework offers,
  ``zero_choices``, and of the dimensions and options it has, ``held``) are grouped by
  their degrees (tp, pp, cp, dp), each group timed by its fastest member; the published
  degrees' rank is one more than the groups strictly faster. None when no layout of
  those degrees fits.
- Recomputation: at the published layout, the planner's pick is the fastest of the
  framework's modes (``recompute_choices``) that fits; right when it is the published
  mode.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from .cluster import parse_cluster
from .estimate import Estimate, estimate
from .layout import PlannedLayout
from .published import PublishedTable, TableRow
from .search import search


@dataclass(frozen=True)
class RowCheck:
    """One row's outcome (see the module docstring)."""

    row: TableRow
    predicted: float
    rank: int | None
    candidates: int  # groups of degrees that fit
    recompute_pick: str | None  # None: not checked
    fits: bool

    @property
    def error(self) -> float:
        return self.predicted / self.row.published - 1

    @property
    def recompute_right(self) -> bool | None:
        if self.recompute_pick is None:
            return None
        return self.recompute_pick == self.row.layout.recompute

    def to_json(self) -> dict[str, Any]:
        return {"row": self.row.label, "published": self.row.published,
                "predicted": round(self.predicted, 1), "rel_error": round(self.error, 4),
                "rank": self.rank, "of": self.candidates, "fits": self.fits,
                "recompute": self.row.layout.recompute if self.row.recompute_choices
                else None, "recompute_pick": self.recompute_pick}


def figure_of(row: TableRow, est: Estimate) -> float:
    """The row's metric from an estimate: tokens/s per GPU, or TFLOP/s per GPU (model
    FLOPs, or with ``hardware`` the recomputation's too)."""
    if row.metric == "tokens_per_s_per_gpu":
        return est.tokens_per_s / est.n_devices
    flops = est.hardware_flops if row.hardware else est.model_flops
    return flops / est.step_time_s / est.n_devices / 1e12


def check_row(row: TableRow, *, rank: bool = True) -> RowCheck:
    """The row's prediction, rank (unless ``rank`` is off: None) and recomputation
    pick."""
    cluster = parse_cluster(row.cluster)
    groups: dict[tuple[int, ...], Estimate] = {}
    published = None
    if rank or row.degrees_only:
        for est in search(row.shape, cluster, row.global_batch, row.options, top=0,
                          zero=row.zero_choices, held=row.held).rows:
            groups.setdefault(est.layout.degrees, est)  # rows come fastest first
            if published is None and _is_published(row, est):
                published = est
    if not row.degrees_only:
        published = estimate(row.shape, cluster, row.layout, row.global_batch, row.options)
    if published is None:  # no layout of the published degrees fits
        published = estimate(row.shape, cluster, row.layout, row.global_batch, row.options)
    place = None
    own = groups.get(row.layout.degrees)
    if rank and own is not None:
        place = 1 + sum(e.step_time_s < own.step_time_s for e in groups.values())
    return RowCheck(row=row, predicted=figure_of(row, published), rank=place,
                    candidates=len(groups), recompute_pick=_recompute_pick(row, cluster),
                    fits=published.fits)


def _is_published(row: TableRow, est: Estimate) -> bool:
    planned = est.layout
    if planned.degrees != row.layout.degrees:
        return False
    return row.layout.recompute != "full" or planned.recompute == "full"


def _recompute_pick(row: TableRow, cluster: Any) -> str | None:
    if not row.recompute_choices:
        return None
    timed = []
    for mode in row.recompute_choices:
        base = row.layout
        planned = PlannedLayout.of(base.degrees, base.options, base.mbs, base.zero, mode)
        est = estimate(row.shape, cluster, planned, row.global_batch, row.options)
        if est.fits:
            timed.append((est.step_time_s, mode))
    return min(timed)[1] if timed else "none fits"


def check_table(table: PublishedTable, *, rank_up_to: int | None = None) -> dict[str, Any]:
    """The table's JSON line for ``bench/plan.py``: every row, the median and worst
    |error|, the ranks (of the rows on at most ``rank_up_to`` GPUs; None: every row),
    the rows in the top three, the recomputation choices."""
    checks = [check_row(r, rank=rank_up_to is None or r.layout.ranks <= rank_up_to)
              for r in table.rows]
    ranked = [c for c in checks if c.candidates or c.rank is not None]
    errors = [abs(c.error) for c in checks]
    ranks = [c.rank for c in checks]
    picks = [c.recompute_right for c in checks if c.recompute_right is not None]
    return {"bench": "plan-published", "table": table.name, "source": table.source,
            "left_out": table.left_out, "rows": [c.to_json() for c in checks],
            "rel_error_median": round(statistics.median(errors), 4),
            "rel_error_worst": round(max(errors), 4),
            "ranks": ranks, "rank_up_to_gpus": rank_up_to, "ranked": len(ranked),
            "top3": sum(r is not None and r <= 3 for r in ranks),
            "not_expressible": sum(c.rank is None for c in ranked),
            "recompute_right": sum(picks), "recompute_checked": len(picks)}
