"""Local SGD: each dp rank steps on its own gradient; parameters are averaged over dp
every ``sync_every`` steps and after the last step.

With plain SGD (no momentum) and H = 1 this is exactly every_step: the average of
``x - lr g_r`` over ranks is ``x - lr mean_r g_r``. Each rank keeps its own optimizer
state (momentum, Adam moments); only parameters are averaged, in one all-reduce of the
flat fp32 parameter vector [numel + 1] per round.
"""

from __future__ import annotations

from .base import PeriodicSync, weighted_average


class LocalSGD(PeriodicSync):
    """Parameter averaging every ``every`` steps over ``comm`` (the dp group)."""

    name = "local_sgd"
    def _round(self) -> None:
        weighted_average(self.comm, self.params, 1.0)
