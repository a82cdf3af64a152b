"""How the planner prices tensor parallelism (``tp``): its candidates (divisors of the
devices, within a node), its rules (it must divide the heads, the key/value heads, the
MLP's width, the vocabulary, and under sequence parallelism the sequence), its search
key ``sp`` (sequence parallelism), and its messages per micro-batch: two all-reduces of
an activation per layer forward and two backward (two more when a full recomputation
reruns the forward), the vocabulary-parallel embedding's all-reduce (forward, first
chunk), the loss's max and sum over the vocabulary shards (forward, last chunk) and the
head input's gradient (backward, last chunk)."""

from __future__ import annotations

from collections.abc import Sequence

from ...config.schema import ParallelConfig
from ...dimensions import dimension
from ..pricing import LayoutFacts, PriceCollective, SearchLimits, ShapeFacts, ShardComm

ENTRY = dimension("tp")


class TensorPricing:
    """tp's pricing (:class:`~..pricing.TensorPricing`)."""

    def candidates(self, ranks: int, limits: SearchLimits) -> list[int]:
        return [d for d in range(1, ranks + 1) if ranks % d == 0 and d <= limits.gpus_per_node]

    def option_values(self, name: str, degree: int, limits: SearchLimits) -> Sequence[int]:
        return (0, 1) if degree > 1 else (0,)  # sp

    def options_problem(self, layout: LayoutFacts) -> str | None:
        if layout.option("sp") and layout.degree(ENTRY.key) == 1:
            return "sp needs tp > 1"
        return None

    def problem(self, shape: ShapeFacts, layout: LayoutFacts, limits: SearchLimits
                ) -> str | None:
        tp, sp = layout.degree(ENTRY.key), layout.option("sp")
        if shape.heads % tp:
            return "tp does not divide the heads"
        if shape.kv % tp:
            return "tp does not divide the kv heads"
        if shape.ffn_width % tp:
            return "tp does not divide the MLP width"
        if shape.vocab % tp:
            return "tp does not divide the vocabulary"
        if tp > limits.gpus_per_node:
            return "tp spans nodes"
        problem = self.options_problem(layout)
        if problem:
            return problem
        if sp and shape.seq % tp:
            return "tp does not divide the sequence (sp)"
        return None

    def batch_problem(self, layout: LayoutFacts, micro_batches: int) -> str | None:
        return None

    def options_from_config(self, parallel: ParallelConfig, degree: int) -> dict[str, int]:
        return {"sp": int(parallel.sequence_parallel and degree > 1)}

    def config_values(self, layout: LayoutFacts) -> dict[str, object]:
        return {"tp": layout.degree(ENTRY.key), "sequence_parallel": bool(layout.option("sp"))}

    def sequence_parallel(self, layout: LayoutFacts) -> bool:
        return bool(layout.option("sp"))

    def communication(self, layout: LayoutFacts, activation_bytes: float, loss_bytes: float,
                      price: PriceCollective) -> ShardComm:
        tp = layout.degree(ENTRY.key)
        one = price("all_reduce", activation_bytes, tp)
        small = price("all_reduce", loss_bytes, tp)
        per_layer = (4 + (2 if layout.recompute == "full" else 0)) * one
        return ShardComm(layer_forward=2 * one, layer_backward=per_layer - 2 * one,
                         first_forward=one, last_forward=2 * small, last_backward=one)


PRICING = TensorPricing()
