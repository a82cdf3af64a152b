"""Fitting the cost model's constants to timings (``plan calibrate``).

Both fits minimise the squared *relative* error of the predicted times, so a 4 KiB
message counts as much as a 64 MiB one and a thin matmul as much as a large one:

- :func:`fit_line`: ``time = latency + bytes * seconds_per_byte`` (a collective or a
  point-to-point message at several sizes), a linear least-squares problem;
- :func:`fit_matmul`: the ``matmul_efficiency`` and ``kernel_overhead_s`` with which
  :func:`~disttrain.plan.estimate.matmul_time` (roofline plus a per-kernel overhead)
  best matches measured matmuls: the overhead in closed form for each efficiency, the
  efficiency by a grid and then a golden-section search.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from .cluster import Cluster
from .costs import matmul_time
from .options import Options

_GOLDEN = (math.sqrt(5) - 1) / 2


@dataclass(frozen=True, kw_only=True)
class LineFit:
    """``time = latency_s + bytes * seconds_per_byte``; ``rel_errors``: predicted /
    measured - 1 at each point."""

    latency_s: float
    seconds_per_byte: float
    rel_errors: tuple[float, ...]

    @property
    def gbps(self) -> float:
        """The bandwidth (GB/s) of the slope."""
        return 1.0 / self.seconds_per_byte / 1e9


@dataclass(frozen=True, kw_only=True)
class MatmulPoint:
    """One timed ``[m, k] x [k, n]`` matmul."""

    precision: str
    m: int
    k: int
    n: int
    seconds: float

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k


@dataclass(frozen=True, kw_only=True)
class MatmulFit:
    efficiency: float
    overhead_s: float
    rel_errors: tuple[float, ...]  # per point, in the order given


def fit_line(sizes: Sequence[float], times: Sequence[float]) -> LineFit:
    """Least squares of relative error, latency >= 0; raises ValueError when the times
    do not grow with the size (no bandwidth to fit)."""
    if len(sizes) != len(times) or len(sizes) < 2 or min(times) <= 0:
        raise ValueError(f"fit_line needs two or more positive times, got {list(times)}")
    s, t = np.asarray(sizes, dtype=float), np.asarray(times, dtype=float)
    # columns scaled to order one: the unknowns are latency / t_min, slope * s_max
    cols = np.stack([t.min() / t, s / s.max() / t], axis=1)
    (a, b), *_ = np.linalg.lstsq(cols, np.ones_like(t), rcond=None)
    latency, slope = a * t.min(), b / s.max()
    if latency < 0:  # through the origin
        v = s / t
        latency, slope = 0.0, float(v.sum() / (v * v).sum())
    if slope <= 0:
        raise ValueError(f"times {list(times)} do not grow with sizes {list(sizes)}")
    rel = (latency + slope * s) / t - 1
    return LineFit(latency_s=float(latency), seconds_per_byte=float(slope),
                   rel_errors=tuple(float(x) for x in rel))


def fit_matmul(cluster: Cluster, points: Sequence[MatmulPoint]) -> MatmulFit:
    """``cluster``'s ``peak_tflops`` and ``memory_gbps`` fixed; the efficiency is
    searched in (0, 1], the overhead is >= 0."""
    if len(points) < 2:
        raise ValueError("fit_matmul needs two or more points")
    grid = np.logspace(-3, 0, 61)
    losses = [_profile(cluster, points, e)[0] for e in grid]
    j = int(np.argmin(losses))
    lo, hi = grid[max(j - 1, 0)], grid[min(j + 1, len(grid) - 1)]
    eff = _golden_min(lambda e: _profile(cluster, points, e)[0], lo, hi)
    loss, overhead, rel = _profile(cluster, points, eff)
    if losses[j] < loss:  # the search's bracket held no better point than the grid's
        eff = float(grid[j])
        loss, overhead, rel = _profile(cluster, points, eff)
    return MatmulFit(efficiency=eff, overhead_s=overhead, rel_errors=rel)


def _profile(cluster: Cluster, points: Sequence[MatmulPoint], efficiency: float
             ) -> tuple[float, float, tuple[float, ...]]:
    """(loss, overhead, relative errors) at ``efficiency``, with the overhead that
    minimises sum(((c_i + overhead) / t_i - 1)^2): sum((t_i - c_i) / t_i^2) /
    sum(1 / t_i^2), c_i being the time without overhead."""
    bare = replace(cluster, matmul_efficiency=float(efficiency), kernel_overhead_s=0.0)
    c = np.array([matmul_time(bare, p.m, p.n, p.k, p.precision,
                              Options(precision=p.precision).act_bytes) for p in points])
    t = np.array([p.seconds for p in points])
    overhead = max(0.0, float(((t - c) / t**2).sum() / (1 / t**2).sum()))
    rel = (c + overhead) / t - 1
    return float((rel * rel).sum()), overhead, tuple(float(x) for x in rel)


def _golden_min(f, lo: float, hi: float, tol: float = 1e-13) -> float:
    """The minimum of ``f`` on [lo, hi], ``f`` unimodal there."""
    x1, x2 = hi - _GOLDEN * (hi - lo), lo + _GOLDEN * (hi - lo)
    f1, f2 = f(x1), f(x2)
    while hi - lo > tol * max(1.0, abs(hi)):
        if f1 <= f2:
            hi, x2, f2 = x2, x1, f1
            x1 = hi - _GOLDEN * (hi - lo)
            f1 = f(x1)
        else:
            lo, x1, f1 = x1, x2, f2
            x2 = lo + _GOLDEN * (hi - lo)
            f2 = f(x2)
    return float((lo + hi) / 2)
