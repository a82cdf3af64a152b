"""How the planner prices context parallelism (``cp``): its candidates, its rule, and
the ring's messages.

The planner divides every activation and each layer's attention work by the degree of
the role cp takes (:data:`~disttrain.dimensions.Role.TOKENS`: each rank holds T / N
positions of each sample, and the balanced split gives every rank 1/N of the causal
attention); what cp prices here is the ring (:mod:`.ring`), per layer and micro-batch,
with N ranks and one message m of a rank's keys and values:

- forward: N - 1 steps, each sending the held block on while computing the attention
  against it: exposed max(0, m - a / N) per step, a the layer's attention on one rank;
- backward: N - 1 steps sending the keys and values again, beside the gradient of the
  previous block (g, the same values in fp32), and one more gradient message home
  after the last block: (N - 1) max(0, m + g - a_b / N) + g;
  recomputation (selective or full) runs the forward's ring again.
- buffers: the block in flight forward; backward, the block in flight and two gradient
  buffers (the one travelling and the one arriving).
"""

from __future__ import annotations

from collections.abc import Sequence

from ...config.schema import ParallelConfig
from ..pricing import (
    LayoutFacts,
    PriceMessage,
    SearchLimits,
    ShapeFacts,
    TokenComm,
)
from .check import ENTRY

_GRAD_BYTES = 4  # the ring accumulates and carries dk, dv in fp32


class ContextPricing:
    """cp's pricing (:class:`~..pricing.TokenPricing`)."""

    def candidates(self, ranks: int, limits: SearchLimits) -> list[int]:
        """Every divisor of the ranks the dimensions searched before it leave."""
        return [n for n in range(1, ranks + 1) if ranks % n == 0]

    def option_values(self, name: str, degree: int, limits: SearchLimits) -> Sequence[int]:
        raise KeyError(f"cp has no search key {name!r}")

    def options_problem(self, layout: LayoutFacts) -> str | None:
        return None  # no search keys

    def problem(self, shape: ShapeFacts, layout: LayoutFacts, limits: SearchLimits
                ) -> str | None:
        cp = layout.degree(ENTRY.key)
        if cp > 1 and shape.seq % (2 * cp):
            return "2 x cp does not divide the sequence"
        if cp > 1 and layout.option("sp") and (shape.seq // cp) % layout.degree("tp"):
            return "tp does not divide a cp rank's positions (sp)"
        return None

    def batch_problem(self, layout: LayoutFacts, micro_batches: int) -> str | None:
        return None

    def options_from_config(self, parallel: ParallelConfig, degree: int) -> dict[str, int]:
        return {}

    def config_values(self, layout: LayoutFacts) -> dict[str, object]:
        return {ENTRY.key: layout.degree(ENTRY.key)}

    def communication(self, layout: LayoutFacts, block_values: float, value_bytes: int,
                      attention: float, attention_backward: float, price: PriceMessage
                      ) -> TokenComm:
        """The ring's messages for one layer of one micro-batch (module docstring)."""
        n = layout.degree(ENTRY.key)
        if n == 1:
            return TokenComm()
        kv, grads = price(block_values * value_bytes), price(block_values * _GRAD_BYTES)
        forward = (n - 1) * max(0.0, kv - attention / n)
        backward = (n - 1) * max(0.0, kv + grads - attention_backward / n) + grads
        if layout.recompute != "none":
            backward += forward
        return TokenComm(forward=forward, backward=backward)

    def buffer_bytes(self, layout: LayoutFacts, block_values: float, value_bytes: int
                     ) -> float:
        """Backward's: the block in flight and two gradient buffers (module docstring)."""
        if layout.degree(ENTRY.key) == 1:
            return 0.0
        return block_values * (value_bytes + 2 * _GRAD_BYTES)


PRICING = ContextPricing()
