"""Local SGD: each dp rank steps on its own gradient; parameters are averaged over dp
every ``sync_every`` steps and after the last step.

With plain SGD (no momentum) and H = 1 this is exactly every_step: the average of
``x - lr g_r`` over ranks is ``x - lr mean_r g_r``. Each rank keeps its own optimizer
state (momentum, Adam moments); only parameters are averaged, in one all-reduce of the
flat fp32 parameter vector [numel + 1] per round.

With a ``codec`` (``comm.codec``) a round averages the *updates* instead: each rank's
delta since the round's start, ``theta - local`` [numel], goes through the codec (one
segment per parameter, error feedback for the biased codecs) and every rank sets its
parameters to ``theta - mean(delta)`` - the same average when nothing is lost. At H = 1
this is the way to compress communication under AdamW: each rank's AdamW update is
compressed and what is not sent waits in the residual, so every coordinate's moves
arrive in full, only later; compressing the gradient instead feeds AdamW a sparse or
distorted gradient whose normalisation shrinks the rarely sent coordinates' steps.
"""

from __future__ import annotations

from torch import nn

from ...comm.codecs import GradientCodec
from ...comm.collectives import Communicator
from ...names import SYNC_LOCAL_SGD
from .modes import PeriodicSync
from .vectors import flatten, unflatten_into, weighted_average


class LocalSGD(PeriodicSync):
    """Parameter averaging every ``every`` steps over ``comm`` (the dp group), of the
    parameters themselves or, with ``codec``, of compressed per-round updates."""

    name = SYNC_LOCAL_SGD

    def __init__(self, model: nn.Module, comm: Communicator, every: int,
                 codec: GradientCodec | None = None) -> None:
        super().__init__(model, comm, every)
        self.codec = codec
        self.theta = flatten(self.params) if codec is not None else None

    def restart(self) -> None:
        """Rounds of compressed updates start from the parameters now in the model (a
        checkpoint replaced them)."""
        if self.codec is not None:
            self.theta = flatten(self.params)

    def _round(self) -> None:
        if self.codec is None or self.theta is None:  # theta is kept iff there is a codec
            weighted_average(self.comm, self.params, 1.0)
            return
        delta = self.theta - flatten(self.params)
        self.codec.all_reduce(delta, self.comm, key=SYNC_LOCAL_SGD,
                              segments=[p.shape for p in self.params])
        self.theta -= delta.div_(self.comm.size)
        unflatten_into(self.theta, self.params)
