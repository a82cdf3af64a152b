"""Context parallelism as a dimension of the layout (entry ``cp`` of
:data:`disttrain.dimensions.DIMENSIONS`): what it applies to a model replica, and its
part of the composed model.

:func:`apply_context_dimension` switches the model's attention to ring attention over
the ``cp`` axis (:func:`.attention.apply_ring_attention`: the built-in GPT's attention
slots, or a recognised transformers family's attention function); the
:class:`ContextSplit` it returns gives each step pass this rank's part of every
micro-batch of its replica (:meth:`ContextSplit.local_batch`: chunks r and 2N-1-r of
each sequence, :mod:`.sequence`, with their global positions) and the activations'
length between pipeline stages (T / N). Nothing else changes: the parameters are
replicated over cp (the entry takes the replica role, so the data-parallel strategy
sums the gradients and ZeRO shards over dp x cp), and every cp rank counts the loss of
its own tokens, so the global token count is a sum over the world as without cp.
"""

from __future__ import annotations

from torch import nn

from ...comm import Communicator
from ..applied import AppliedDimension, ApplyContext
from ..interfaces import SequenceBatch
from .attention import apply_ring_attention
from .check import ENTRY
from .sequence import chunk_length, local_chunks, local_positions, split_sequence

__all__ = ["ENTRY", "ContextSplit", "apply_context_dimension"]


class ContextSplit(AppliedDimension):
    """This rank's share of every sequence over the cp group ``comm``: chunks r and
    2N-1-r of 2N (N = ``comm.size``, r = ``comm.rank``)."""

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm

    def describe(self) -> str:
        first, second = local_chunks(self.comm.size, self.comm.rank)
        return (f"chunks {first} and {second} of {2 * self.comm.size} of each sequence "
                f"(cp rank {self.comm.rank})")

    def activation_length(self, seq_len: int) -> int:
        """2c = T / N positions of each sequence (one sample's activations [2c, d])."""
        return 2 * chunk_length(seq_len, self.comm.size, field="a micro-batch's length")

    def local_batch(self, batch: SequenceBatch) -> SequenceBatch:
        """``batch`` ([B, T] tokens) as this rank holds it: every [B, T] tensor cut to
        [B, 2c] (chunks r and 2N-1-r), labels shifted over the whole sequence first,
        and ``position_ids`` [B, 2c] the global positions of the tokens held."""
        n, r = self.comm.size, self.comm.rank
        b, t = batch.tokens_shape()
        positions = local_positions(t, n, r, device=self.comm.device).expand(b, -1)
        return batch.split_sequence(lambda x: split_sequence(x, n, r), positions)


def apply_context_dimension(model: nn.Module, ctx: ApplyContext) -> ContextSplit:
    """Switch ``model``'s attention to ring attention over ``ctx.comm`` (the model's
    attention refused at validation, one line, when it cannot be)."""
    apply_ring_attention(model, ctx.comm, seq_len=ctx.seq_len)
    return ContextSplit(ctx.comm)
