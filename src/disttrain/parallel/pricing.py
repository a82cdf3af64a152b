"""How the planner prices a dimension: the roles' protocols each entry's pricing plays.

The planner (:mod:`disttrain.plan`) is pure Python and sits above this package; each
dimension's home holds its pricing (``pricing.py``, attached to its entry in
:mod:`.dimensions`), which imports nothing of the planner: it reads a layout and a model
shape through the small protocols below, and prices its messages with the function the
planner hands it. What every entry prices (:class:`DimensionPricing`): its candidate
degrees, the values of its own search keys, its rules (before and after the
micro-batches are known), its part of a config. What a role's holder adds: the
dimension that shards tensors, its communication per layer and sequence parallelism
(:class:`TensorPricing`); the one that cuts the layers, the stages and their schedule
(:class:`StagePricing`, a :class:`StageCut` per layout); the one that splits each
sample's tokens, the messages of its attention (:class:`TokenPricing`). The rest of a
step (a layer's compute and memory divided as the roles say, the replica group's
reduction, the optimizer) is the planner's own, over the roles' degrees.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from ..config.schema import ParallelConfig

# (collective, bytes, ranks of consecutive devices) -> seconds, as the planner prices it
PriceCollective = Callable[[str, float, int], float]
# bytes of one point-to-point message -> its seconds, between the ranks a role pairs
PriceMessage = Callable[[float], float]


@dataclass(frozen=True)
class SearchLimits:
    """What bounds a dimension's candidates: the cluster's ``devices`` and
    ``gpus_per_node``, and the search's ``max_v`` (chunks per pipeline rank)."""

    devices: int
    gpus_per_node: int
    max_v: int = 8


class ShapeFacts(Protocol):
    """A model's shape, as a dimension's rules read it (the planner's ModelShape)."""

    @property
    def layers(self) -> int: ...

    @property
    def heads(self) -> int: ...

    @property
    def seq(self) -> int: ...

    @property
    def vocab(self) -> int: ...

    @property
    def kv(self) -> int: ...

    @property
    def ffn_width(self) -> int: ...


class LayoutFacts(Protocol):
    """A planned layout, as a dimension's pricing reads it."""

    @property
    def mbs(self) -> int: ...

    @property
    def zero(self) -> int: ...

    @property
    def recompute(self) -> str: ...

    @property
    def ranks(self) -> int: ...

    def degree(self, key: str) -> int: ...

    def option(self, name: str) -> int: ...


class DimensionPricing(Protocol):
    """What the planner asks every dimension."""

    def candidates(self, ranks: int, limits: SearchLimits) -> Iterable[int]:
        """The degrees to try when ``ranks`` devices are left for it and the dimensions
        searched after it (the derived dimension is never asked: it takes the rest)."""
        ...

    def option_values(self, name: str, degree: int, limits: SearchLimits) -> Sequence[int]:
        """The values of its search key ``name`` to try at ``degree``."""
        ...

    def options_problem(self, layout: LayoutFacts) -> str | None:
        """The first of its rules on its degree and search keys alone, whatever the model
        (a combination no schedule takes), or None. :meth:`problem` asks it, and the
        search does not generate the layouts it rejects."""
        ...

    def problem(self, shape: ShapeFacts, layout: LayoutFacts, limits: SearchLimits
                ) -> str | None:
        """The first of its rules ``layout`` breaks for this model and cluster (a short
        reason: rejections are counted by it), or None. It reads the layout's degrees
        and options only (the micro-batches: :meth:`batch_problem`): the search asks it
        once for every micro-batch, ZeRO stage and recomputation."""
        ...

    def batch_problem(self, layout: LayoutFacts, micro_batches: int) -> str | None:
        """Its rules on the micro-batches per step and replica, once they are known."""
        ...

    def options_from_config(self, parallel: ParallelConfig, degree: int) -> dict[str, int]:
        """Its search keys as a run's ``[parallel]`` section sets them."""
        ...

    def config_values(self, layout: LayoutFacts) -> dict[str, object]:
        """Its part of the ``[parallel]`` section that trains ``layout``."""
        ...


@dataclass(frozen=True)
class ShardComm:
    """Seconds of the communication of a tensor-sharded micro-batch, by where it runs:
    per layer forward and backward (recomputation's included), and at the ends (the
    first chunk's forward; the last chunk's forward and backward)."""

    layer_forward: float = 0.0
    layer_backward: float = 0.0
    first_forward: float = 0.0
    last_forward: float = 0.0
    last_backward: float = 0.0


class TensorPricing(DimensionPricing, Protocol):
    """The dimension that shards tensors (:data:`~disttrain.dimensions.Role.TENSORS`)."""

    def sequence_parallel(self, layout: LayoutFacts) -> bool:
        """Whether the activations between blocks are split over its ranks too."""
        ...

    def communication(self, layout: LayoutFacts, activation_bytes: float, loss_bytes: float,
                      price: PriceCollective) -> ShardComm:
        """Its messages for one micro-batch (``activation_bytes``: one activation
        [b, s, h] whole; ``loss_bytes``: one fp32 figure per token), priced by
        ``price``."""
        ...


@dataclass(frozen=True)
class TokenComm:
    """What a token split's messages add to one layer of one micro-batch: the seconds
    its attention's compute does not hide, forward and backward (recomputation's
    included)."""

    forward: float = 0.0
    backward: float = 0.0


class TokenPricing(DimensionPricing, Protocol):
    """The dimension that splits each sample's tokens
    (:data:`~disttrain.dimensions.Role.TOKENS`): every activation and the attention's
    work are divided by its degree (the planner's, over the role's degree); what it
    prices itself is its attention's messages."""

    def communication(self, layout: LayoutFacts, block_values: float, value_bytes: int,
                      attention: float, attention_backward: float, price: PriceMessage
                      ) -> TokenComm:
        """Its messages for one layer of one micro-batch: ``block_values``, the keys'
        and values' values one rank holds (its positions, its tensor shard), in the
        activations' dtype of ``value_bytes``; ``attention`` / ``attention_backward``:
        the seconds of the layer's attention on one rank that the messages can overlap
        (0 where compute does not progress beside a message); priced by ``price`` (one
        message to the next rank)."""
        ...

    def buffer_bytes(self, layout: LayoutFacts, block_values: float, value_bytes: int
                     ) -> float:
        """The most bytes its messages travel in at once (held while a layer's
        attention runs), for :meth:`communication`'s block."""
        ...


@dataclass(frozen=True)
class SimulatedAction:
    """One forward or backward of a simulated schedule: pp rank ``rank`` ran chunk
    ``chunk`` of micro-batch ``micro`` from ``start`` to ``end`` seconds; ``forward``:
    which; ``symbol``: the schedule's own letter for it."""

    rank: int
    forward: bool
    symbol: str
    chunk: int
    micro: int
    start: float
    end: float


class StageCut(Protocol):
    """The layers of a layout cut into ``stages`` of ``v`` chunks each, run by the
    schedule ``schedule``; chunk c runs on stage c mod stages (or in a V: ``zbv``)."""

    stages: int
    v: int
    schedule: str

    @property
    def n_chunks(self) -> int: ...

    def chunk_layers(self, layers: int) -> tuple[int, ...]:
        """Layers of each chunk, the ends lightest."""
        ...

    def stage_layers(self, sizes: tuple[int, ...]) -> tuple[int, ...]:
        """Layers on each stage, of chunks of ``sizes`` layers."""
        ...

    def local_chunks(self, stage: int) -> Sequence[int]:
        """The global chunks on ``stage``, in its local order."""
        ...

    def stages_to_estimate(self, sizes: tuple[int, ...], counts: Sequence[int]
                           ) -> list[int]:
        """The stages whose memory can be the largest."""
        ...

    def peak_held(self, micro_batches: int, stage: int, chunk_bytes: tuple[float, ...]
                  ) -> float:
        """The most bytes ``stage`` holds for backward, each micro-batch of its local
        chunk L keeping ``chunk_bytes[L]``."""
        ...

    def chunk_times(self, sizes: tuple[int, ...], layer_forward: float,
                    layer_backward: float, head: float, ends_forward: tuple[float, float],
                    ends_backward: tuple[float, float]
                    ) -> tuple[tuple[tuple[float, ...], ...], tuple[tuple[float, ...], ...]]:
        """(forward, backward) seconds of one micro-batch on each stage's chunks."""
        ...

    def messages_per_micro_batch(self) -> int:
        """Activation and gradient messages each stage sends per micro-batch."""
        ...

    def step(self, micro_batches: int, per_stage: Sequence[float], message: float
             ) -> tuple[float, float]:
        """(seconds of the pipelined micro-batches, of them the bubble), each stage
        taking ``per_stage`` per micro-batch plus ``message`` of messages."""
        ...

    def traced_micro_batches(self, micro_batches: int, max_actions: int) -> int:
        """How many micro-batches a trace of at most ``max_actions`` simulates."""
        ...

    def simulate(self, micro_batches: int, forward: Sequence[float],
                 backward: Sequence[float], message: float
                 ) -> tuple[str, list[list[SimulatedAction]], int]:
        """The schedule's name, each stage's actions timed (``forward`` / ``backward``:
        per global chunk), and the actions in all."""
        ...


class StagePricing(DimensionPricing, Protocol):
    """The dimension that cuts the layers (:data:`~disttrain.dimensions.Role.LAYERS`)."""

    def cut(self, layout: LayoutFacts) -> StageCut:
        """The stages of ``layout``."""
        ...

    def run_chunks(self, parallel: ParallelConfig, spec: object, stages: int
                   ) -> tuple[int, ...]:
        """Layers in each chunk as a run with ``parallel`` cut a model of ``spec``."""
        ...
