"""One layout's predicted memory and step time (the layout: :class:`~.layout.PlannedLayout`).

The layout's dimensions enter through their roles (:class:`~.layout.PlannedLayout`):
the tensor shards (the weight matrices cut this many ways; with sequence parallelism the
activations between blocks too), the stages (the cut of the layers, its chunks and
schedule: the stage pricing of the dimension that cuts them,
:func:`disttrain.parallel.dimensions.stage_pricing`), the replicas (ZeRO shards over
them, the gradients are reduced over them).

**Memory, per stage** (the largest is the layout's):

- model states of the stage's parameters on one shard (weight matrices split over the
  shards; norms, row-parallel biases and a learned position table replicated; the
  vocabulary-parallel embedding on the first stage, the head, and with more than one
  stage a tied copy of the embedding, on the last): with the ``disttrain`` accounting,
  fp32 parameters, gradients and AdamW state (4 + 4 + 8 bytes), sharded over the
  replicas from ZeRO stage 3, 2, 1 respectively; with ``mixed`` the ZeRO paper's
  2 + 2 + 12;
- activations per Korthikanti et al. 2022 (:func:`~.memory.layer_activation_bytes`) for the
  micro-batches the schedule keeps in flight on that stage (1F1B: stages - stage;
  interleaved: the warmup of that rank + 1, in chunks; GPipe: all), plus the
  embedding's for each first-chunk micro-batch in flight on the first stage and the
  head's and the loss's for each last-chunk one on the last, at the schedule's peak
  mix of chunks (the cut's ``peak_held``); autocast's cast weights once per layer of
  the stage (every micro-batch in flight shares them); with ``full`` recomputation,
  one layer rebuilt in full during its backward (``StageMemory.rebuilt``, part of
  ``activations``); with the fused loss (``Options.fused_loss``), on the last stage
  its chunk's transient during a forward (``StageMemory.loss_transient``, part of
  ``activations``; the larger of the two counts, as they never coexist);
- communication buffers (gradient buckets; ZeRO-3's gathered layer, twice for the
  prefetch; a token split's messages, its pricing's ``buffer_bytes``) and the
  cluster's reserved memory.

A token split (:data:`~disttrain.dimensions.Role.TOKENS`) divides every activation:
they are those of each sample's part a rank holds (:func:`~.shape.token_part`).

**Time**: :mod:`.steptime`. FLOPs executed include recomputation, as Megatron-LM
reports TFLOP/s; MFU counts model FLOPs only.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

from ..dimensions import Role
from ..parallel.dimensions import shard_pricing, stage_pricing, token_pricing
from ..shape import ModelShape, key_value_values, rank_params, token_part
from .cluster import Cluster
from .layout import PlannedLayout, figure
from .memory import (
    end_activations,
    layer_activation_bytes,
    layer_cast_bytes,
    loss_transient_bytes,
    model_state_bytes,
)
from .options import DEFAULT_OPTIONS, Options
from .steptime import holds_ends, step_time

_GIB = 2**30


@dataclass(frozen=True, kw_only=True)
class StageMemory:
    """Bytes on one tp rank of a pipeline stage. ``rebuilt``: the part of
    ``activations`` that exists only during a backward (the layer a full recomputation
    rebuilds), ``loss_transient``: what the fused loss holds only during its forward
    (:func:`~.memory.loss_transient_bytes`); a meter of what the forward saves sees
    neither, and ``activations`` holds the larger (:attr:`transient`)."""

    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    communication: float = 0.0
    other: float = 0.0
    rebuilt: float = 0.0
    loss_transient: float = 0.0

    @property
    def transient(self) -> float:
        """The part of ``activations`` that no saved tensor holds: a rebuilt layer
        (in a backward) or the fused loss's chunk (in a forward), whichever is larger."""
        return max(self.rebuilt, self.loss_transient)

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return (self.model_states + self.activations + self.communication + self.other)

    def gib(self) -> dict[str, float]:
        return {k: round(getattr(self, k) / _GIB, 3) for k in
                ("params", "grads", "optimizer", "activations", "communication", "other")}


@dataclass(frozen=True, kw_only=True)
class Estimate:
    """A layout's predicted memory and, unless only memory was estimated (then the
    time fields keep their defaults), its step time: :class:`~.steptime.StepTime`'s
    fields, and the FLOPs and tokens of a step."""

    layout: PlannedLayout
    stages: list[StageMemory | None]  # None: a stage not estimated (all_stages off)
    worst_stage: int
    step_time_s: float = 0.0
    times: dict[str, float] = field(default_factory=dict)
    split: dict[str, float] = field(default_factory=dict)  # StepTime.split
    model_flops: float = 0.0
    hardware_flops: float = 0.0
    tokens: int = 0
    n_devices: int = 1
    peak_flops: float = 1.0
    fits: bool = True
    # What a step is made of, for a trace (empty with memory_only): StepTime's
    chunk_forward_s: tuple[tuple[float, ...], ...] = ()
    chunk_backward_s: tuple[tuple[float, ...], ...] = ()
    p2p_message_s: float = 0.0

    def stage_memory(self, stage: int) -> StageMemory:
        """The memory of pipeline stage ``stage``, which was estimated (the largest
        always is; every stage with ``all_stages``)."""
        mem = self.stages[stage]
        if mem is None:
            raise ValueError(f"stage {stage} of {self.layout.label()} was not estimated "
                             "(estimate with all_stages=True)")
        return mem

    @property
    def memory_bytes(self) -> float:
        return self.stage_memory(self.worst_stage).total

    @property
    def tflops_per_gpu(self) -> float:
        return self.hardware_flops / self.step_time_s / self.n_devices / 1e12

    @property
    def mfu(self) -> float:
        return self.model_flops / self.step_time_s / self.n_devices / self.peak_flops

    @property
    def reduction_exposed_s(self) -> float:
        """The replica group's gradient reduction the backward does not hide, after the
        pipeline."""
        return self.times.get(figure(Role.REPLICAS, "comm_exposed"), 0.0)

    @property
    def step_sync_s(self) -> float:
        """Small per-step collectives and the tied embedding's gradient."""
        return self.times.get("step_sync", 0.0)

    @property
    def optimizer_s(self) -> float:
        return self.times.get("optimizer", 0.0)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_time_s

    @property
    def bottleneck(self) -> str:
        parts = {k: v for k, v in self.times.items() if k != "compute"}
        name = max(parts, key=lambda k: parts[k]) if parts else "compute"
        return "compute" if self.times.get("compute", 0) >= parts.get(name, 0) else name

    def row(self) -> dict:
        return {**layout_fields(self.layout),
                "step_time_s": round(self.step_time_s, 6),
                "tflops_per_gpu": round(self.tflops_per_gpu, 2),
                "mfu": round(self.mfu, 4), "tokens_per_s": round(self.tokens_per_s, 1),
                "memory_gib": round(self.memory_bytes / _GIB, 3),
                "memory_stage": self.worst_stage,
                "memory_breakdown_gib": self.stage_memory(self.worst_stage).gib(),
                "time_breakdown_s": {k: round(v, 6) for k, v in self.times.items()},
                "time_split_s": {k: round(v, 6) for k, v in self.split.items()},
                "bottleneck": self.bottleneck}


def layout_fields(planned: PlannedLayout) -> dict[str, int | str]:
    """A layout as rows and reports show it: every key always shown (label order), and
    the schedule its stages run."""
    return {**dict(planned.items(shown=True)), "schedule": stage_pricing().cut(planned).schedule}


def estimate(shape: ModelShape, cluster: Cluster, layout: PlannedLayout, global_batch: int,
             options: Options = DEFAULT_OPTIONS, *, memory_only: bool = False,
             all_stages: bool = False, chunk_sizes: tuple[int, ...] | None = None
             ) -> Estimate:
    """Predicted memory of the largest stage (of every stage with ``all_stages``; the
    others are left empty) and, unless ``memory_only``, the step time. ``chunk_sizes``:
    the layers of each chunk, where a run cut them otherwise than the cut's even split
    (``parallel.pp_split``, or balanced by cost)."""
    planned, o = layout, options
    cut, sp = stage_pricing().cut(planned), shard_pricing().sequence_parallel(planned)
    shards, replicas = planned.shards, planned.replicas
    whole, shape = shape, _held(shape, planned.token_split)
    m = planned.micro_batches(global_batch)
    sizes = chunk_sizes or cut.chunk_layers(shape.layers)
    if chunk_sizes and (len(sizes) != cut.n_chunks or sum(sizes) != shape.layers):
        raise ValueError(f"chunk_sizes {sizes} must give {cut.n_chunks} chunks of "
                         f"{shape.layers} layers in all")
    counts = list(cut.stage_layers(sizes))
    per_layer = layer_activation_bytes(shape, b=planned.mbs, shards=shards, sp=sp,
                                       recompute=planned.recompute, precision=o.precision,
                                       accounting=o.accounting)
    rebuilt = 0.0
    if planned.recompute == "full":  # one layer rebuilt in full during its backward
        rebuilt = layer_activation_bytes(shape, b=planned.mbs, shards=shards, sp=sp,
                                         precision=o.precision, accounting=o.accounting)
    # the cast weights are held once per layer of the stage, not per micro-batch
    cast = 0.0 if planned.recompute == "full" else \
        layer_cast_bytes(shape, o.precision, o.accounting) / shards
    layer_bytes = rank_params(shape, shards, 1, False, False, cut.stages) * o.act_bytes
    which = (list(range(cut.stages)) if all_stages
             else cut.stages_to_estimate(sizes, counts))
    embedding, head, head_once = end_activations(shape, planned, o, shards, sp)
    loss_transient = loss_transient_bytes(shape, planned, o, shards, sp)
    ring = token_pricing().buffer_bytes(planned, key_value_values(shape, planned.mbs, shards),
                                        o.act_bytes)
    n_chunks = cut.n_chunks
    stages: dict[int, StageMemory] = {}
    for stage in which:
        first, last = holds_ends(cut, stage)
        params = rank_params(shape, shards, counts[stage], first, last, cut.stages)
        states = model_state_bytes(params, replicas=replicas, zero=planned.zero,
                                   master_copy=o.master_copy)
        held = tuple((per_layer - cast) * sizes[c] + (embedding if c == 0 else 0)
                     + (head if c == n_chunks - 1 else 0)
                     for c in cut.local_chunks(stage))
        buckets = min(o.bucket_mb * 2**20, states.grads) * 2 if replicas > 1 else 0
        gathered = 2 * layer_bytes if planned.zero >= 3 and replicas > 1 else 0
        transient = loss_transient if last else 0.0
        stages[stage] = StageMemory(
            params=states.params, grads=states.grads, optimizer=states.optimizer,
            activations=(cut.peak_held(m, stage, held) + cast * counts[stage]
                         + max(rebuilt, transient) + (head_once if last else 0)),
            rebuilt=rebuilt, loss_transient=transient, communication=buckets + gathered + ring,
            other=cluster.reserved_gib * _GIB)
    worst = max(stages, key=lambda st: stages[st].total)
    memory = Estimate(layout=planned, stages=[stages.get(st) for st in range(cut.stages)],
                      worst_stage=worst, n_devices=planned.ranks,
                      peak_flops=cluster.peak_flops(o.precision),
                      fits=stages[worst].total <= cluster.memory_gib * _GIB)
    if memory_only:
        return memory
    return with_step_time(memory, whole, cluster, global_batch, o, chunk_sizes=chunk_sizes)


def with_step_time(memory: Estimate, shape: ModelShape, cluster: Cluster, global_batch: int,
                   options: Options = DEFAULT_OPTIONS, *,
                   chunk_sizes: tuple[int, ...] | None = None) -> Estimate:
    """``memory`` (an estimate with ``memory_only``, of the same model, cluster, batch,
    options and chunks) with its step time, FLOPs and tokens: :func:`estimate`'s
    result, without estimating the memory again (the search times only what fits)."""
    planned = memory.layout
    cut = stage_pricing().cut(planned)
    sizes = chunk_sizes or cut.chunk_layers(shape.layers)
    time = step_time(planned, shape, cluster, options, global_batch, sizes,
                     list(cut.stage_layers(sizes)))
    tokens, model_flops, hardware_flops = _flops(shape, planned, global_batch)
    return replace(memory, step_time_s=time.step_time_s, times=time.times, split=time.split,
                   chunk_forward_s=time.chunk_forward_s,
                   chunk_backward_s=time.chunk_backward_s,
                   p2p_message_s=time.p2p_message_s, tokens=tokens,
                   model_flops=model_flops, hardware_flops=hardware_flops)


def memory_floor(shape: ModelShape, cluster: Cluster, layout: PlannedLayout,
                 options: Options = DEFAULT_OPTIONS) -> float:
    """A lower bound of :func:`estimate`'s memory of ``layout`` that depends on neither
    its micro-batch nor its recomputation: the largest stage's model states and the
    cluster's reserved memory (activations and buffers only add). The search drops a
    layout whose floor exceeds the device without estimating it, and with it every
    micro-batch and recomputation of the same degrees, options and ZeRO stage."""
    cut = stage_pricing().cut(layout)
    shape = _held(shape, layout.token_split)
    counts = cut.stage_layers(cut.chunk_layers(shape.layers))
    # stages alike in layers and ends hold alike: each kind priced once
    kinds = {(layers, st == 0, st == cut.stages - 1) for st, layers in enumerate(counts)}
    states = max(model_state_bytes(
        rank_params(shape, layout.shards, layers, first, last, cut.stages),
        replicas=layout.replicas, zero=layout.zero, master_copy=options.master_copy).total
        for layers, first, last in kinds)
    return states + cluster.reserved_gib * _GIB


@functools.lru_cache(maxsize=256)  # a search asks it per layout: not a new shape each time
def _held(shape: ModelShape, token_split: int) -> ModelShape:
    """What one rank's activations are of: ``shape`` at its part of each sample's
    tokens; split, its attention keeps no scores whatever the model's kernel (each
    block of the ring keeps its log-sum-exp, as a fused kernel does)."""
    held = token_part(shape, token_split)
    return held if token_split == 1 else replace(held, flash=True)


def _flops(shape: ModelShape, planned: PlannedLayout, global_batch: int
           ) -> tuple[int, float, float]:
    """A step's tokens, model FLOPs, and the FLOPs executed (recomputation included)."""
    tokens = global_batch * shape.seq
    model_flops = shape.model_flops_per_token() * tokens
    rebuilt = {"none": 0, "selective": shape.layer_attention_flops(),
               "full": shape.layer_matmul_flops() + shape.layer_attention_flops()}
    return tokens, model_flops, model_flops + shape.layers * rebuilt[planned.recompute] * tokens
