"""A layout's step time, from the costs of its pieces (:mod:`.work` for a layer and
the head by kind of work, :mod:`.costs` for collectives), over the roles' degrees of
the layout (:class:`~.layout.PlannedLayout`).

Per micro-batch and stage: each layer's kernels and framework time on one tensor shard
(slowed in proportion when a CPU's ranks share fewer cores than they compute with),
and the tensor-sharding dimension's messages (its pricing's ``communication``: tensor
parallelism's all-reduces, two forward, two backward, two more when a full
recomputation reruns the forward, and those of the ends: the vocabulary-parallel
embedding's, the head input's gradient, the loss's max and sum). The stages run m
micro-batches at the pace of the slowest plus the bubble, and one activation and one
gradient message per chunk boundary (the cut's ``step``: (stages - 1) / v stage times).
A token split (context parallelism) leaves each rank 1/N of every sample's positions
(:func:`~.shape.token_part`: the layer's matmuls, memory-bound work, head and
messages of that many tokens) and 1/N of the whole sequence's attention; per layer its
pricing's ``communication`` adds the ring's messages that the attention of the held
block does not hide (the figure ``cp_comm``). A framework that pipelines tensor
parallelism's collectives with the matmuls (``Options.layer_comm_overlap``) shows only
what exceeds each pass's matmul time.

After the pipeline: the replica group's reduction the backward does not hide (none on
a CPU whose cores the ranks' compute threads fill; plain:
one all-reduce per bucket; ZeRO: one reduce-scatter per flat buffer (:func:`~.shape.
zero_flats`), once (stage 1) or per micro-batch (2, 3), then one all-gather per flat
of the updated parameters, hidden behind the next step's first forward with
``Options.param_gather_overlap``; stage 3, as FSDP runs it, gathers each unit before its
forward and its backward, prefetched a unit ahead, and reduce-scatters behind the
next unit's backward: :func:`_prefetched`), the per-step synchronisation every disttrain step
makes (the loss and token counts, the stop flag, telemetry on logged steps, the
gradient norm of sharded gradients, the tied embedding's gradient between the first
and last stage), and the optimizer step (memory-bound, plus framework time per
parameter tensor). ``StepTime.split`` gives the same step by kind of work (matmul,
attention, memory-bound, overhead, each communication, bubble, optimizer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..dimensions import DIMENSIONS, Role
from ..parallel.dimensions import shard_pricing, stage_pricing, token_pricing
from ..parallel.pricing import StageCut, TokenComm
from ..shape import (
    ModelShape,
    key_value_values,
    rank_params,
    rank_tensors,
    token_part,
    zero_flats,
)
from .cluster import Cluster
from .costs import (
    collective_time,
    compute_share,
    elementwise_time,
    node_ranks,
    overlaps_compute,
)
from .layout import PlannedLayout, figure
from .options import Options
from .work import SPLIT_KEYS, Work, attention_backward_ratio, head_work, layer_work

_OPTIMIZER_BYTES = 28 + 8
_CONTROL_BYTES = 16  # a few counters: the size of disttrain's per-step small collectives


@dataclass(frozen=True, kw_only=True)
class StepTime:
    """One step's predicted seconds and its parts (``times``: compute, recompute, the
    tensor shards' communication, the stages' bubble and messages, the replica group's
    exposed reduction, step_sync, optimizer: :data:`TIMES`; ``split``: the same step by
    kind of work, :data:`SPLIT`, summing to it), and what a trace replays: one
    micro-batch on stage r's j-th chunk (global chunk j * stages + r), compute and its
    shards' communication, the backward including recomputation; p2p: one activation
    or gradient message between neighbouring stages."""

    step_time_s: float = 0.0
    times: dict[str, float] = field(default_factory=dict)
    split: dict[str, float] = field(default_factory=dict)
    chunk_forward_s: tuple[tuple[float, ...], ...] = ()
    chunk_backward_s: tuple[tuple[float, ...], ...] = ()
    p2p_message_s: float = 0.0


# the figures of the roles' parts of a step, named after their dimensions (tp_comm, ...)
SHARD_COMM = figure(Role.TENSORS, "comm")
TOKEN_COMM = figure(Role.TOKENS, "comm")
STAGE_BUBBLE, STAGE_P2P = figure(Role.LAYERS, "bubble"), figure(Role.LAYERS, "p2p")
REDUCTION_EXPOSED = figure(Role.REPLICAS, "comm_exposed")
_REDUCTION_OPS = ("all_reduce", "reduce_scatter", "all_gather")
# the step by its parts (StepTime.times)
TIMES = ("compute", "recompute", SHARD_COMM, TOKEN_COMM, STAGE_BUBBLE, STAGE_P2P,
         REDUCTION_EXPOSED, "step_sync", "optimizer")
# the step by kind of work (StepTime.split); the replica group's (dp_*) keys:
# collectives of data parallelism and ZeRO that the backward (or ZeRO-3's prefetch)
# does not hide
SPLIT = (*SPLIT_KEYS, SHARD_COMM, TOKEN_COMM, STAGE_P2P, STAGE_BUBBLE,
         *(figure(Role.REPLICAS, op) for op in _REDUCTION_OPS), "step_sync", "optimizer")


def step_time(planned: PlannedLayout, shape: ModelShape, cluster: Cluster, o: Options,
              global_batch: int, sizes: tuple[int, ...], counts: list[int]) -> StepTime:
    """The step time of ``planned``, its parts and per-chunk costs; ``sizes``: layers of
    each global chunk; ``counts``: layers on each stage."""
    busy = node_ranks(cluster, planned.ranks)
    share = compute_share(cluster, busy)
    async_ = cluster.async_dispatch
    cut, sp = stage_pricing().cut(planned), shard_pricing().sequence_parallel(planned)
    shards, n = planned.shards, cut.stages
    m = planned.micro_batches(global_batch)
    shape = token_part(shape, planned.token_split)  # the positions this rank holds
    tokens, a = planned.mbs * shape.seq, o.act_bytes
    act = tokens * shape.hidden * a
    fwd, bwd, attn = layer_work(shape, cluster, shards, planned.mbs, o.precision, sp,
                                planned.token_split)
    rework = {"none": Work(), "selective": attn, "full": fwd}[planned.recompute]
    ring = _token_messages(shape, cluster, o, planned, attn, busy)
    layer_fwd = share * fwd.seconds(async_)
    layer_bwd = share * bwd.seconds(async_)
    recompute = share * rework.seconds(async_)
    comm = shard_pricing().communication(
        planned, act, 4 * tokens, lambda op, nbytes, ranks: collective_time(
            cluster, op, nbytes, ranks, busy))
    layer_comm = (comm.layer_forward, comm.layer_backward)
    if o.layer_comm_overlap:  # pipelined with the pass's matmuls: only the excess shows
        layer_comm = (max(0.0, comm.layer_forward - share * fwd.matmul),
                      max(0.0, comm.layer_backward - share * bwd.matmul))
    # framework time of the ends, half on the embedding's chunk, half on the head's
    end = share * cluster.microbatch_overhead_s / 2
    ends_fwd = (comm.first_forward + end / 3, comm.last_forward + end / 3)
    ends_bwd = (end * 2 / 3, comm.last_backward + end * 2 / 3)
    head_w = head_work(shape, cluster, planned.mbs, o.precision, shards, o.fused_loss)
    head = share * head_w.device
    chunk_forward_s, chunk_backward_s = cut.chunk_times(
        sizes, layer_fwd + layer_comm[0] + ring.forward,
        layer_bwd + recompute + layer_comm[1] + ring.backward, head, ends_fwd,
        ends_bwd)
    ends = [holds_ends(cut, st) for st in range(n)]
    compute_rank = [layers * (layer_fwd + layer_bwd + recompute)
                    + (head if ends[st][1] else 0.0) + end * sum(ends[st])
                    for st, layers in enumerate(counts)]
    per_rank = [sum(f) + sum(b) for f, b in zip(chunk_forward_s, chunk_backward_s, strict=True)]
    messages = cut.messages_per_micro_batch()
    p2p_message_s = (p2p_message_time(cluster, planned, act / (shards if sp else 1))
                     if messages else 0.0)
    p2p = messages * p2p_message_s
    slowest = max(per_rank) + p2p
    slow = max(range(n), key=lambda st: per_rank[st])
    ring_s = m * (ring.forward + ring.backward) * counts[slow]
    pipeline, bubble = cut.step(m, per_rank, p2p)
    params = max(rank_params(shape, shards, layers, *ends[st], n)
                 for st, layers in enumerate(counts))
    top = max(range(n), key=lambda st: compute_rank[st])
    passes = (layer_fwd * counts[top], (layer_bwd + recompute) * counts[top])
    reduction = _reduction_exposed(shape, cluster, o, planned, cut, m, busy, params, counts,
                                   passes)
    sync = _step_sync(shape, cluster, o, planned, cut, busy)
    optimizer = share * _optimizer_time(shape, cluster, planned, cut, params, counts)
    compute_only = m * compute_rank[top]
    recomputed = m * recompute * max(counts)
    exposed = sum(reduction.values())
    shard_s = m * (slowest - p2p) - compute_only - ring_s
    times = {"compute": compute_only - recomputed, "recompute": recomputed,
             SHARD_COMM: shard_s if shards > 1 else 0.0, TOKEN_COMM: ring_s,
             STAGE_BUBBLE: bubble, STAGE_P2P: m * p2p, REDUCTION_EXPOSED: exposed,
             "step_sync": sync, "optimizer": optimizer}
    work = ((fwd + bwd + rework).scaled(counts[top])
            + (head_w if top == n - 1 else Work()))
    split = {k: m * share * v for k, v in work.split(async_).items()}
    split["overhead"] += compute_only - sum(split.values())  # the ends' framework time
    split |= {SHARD_COMM: max(0.0, shard_s), TOKEN_COMM: ring_s, STAGE_P2P: m * p2p,
              STAGE_BUBBLE: bubble,
              **{figure(Role.REPLICAS, k): v for k, v in reduction.items()},
              "step_sync": sync, "optimizer": optimizer}
    return StepTime(step_time_s=pipeline + exposed + sync + optimizer, times=times,
                    split=split, chunk_forward_s=chunk_forward_s,
                    chunk_backward_s=chunk_backward_s, p2p_message_s=p2p_message_s)


def p2p_message_time(cluster: Cluster, planned: PlannedLayout, nbytes: float) -> float:
    """One message of ``nbytes`` (an activation or its gradient) to the neighbouring
    stage."""
    # neighbouring stages' ranks are the other dimensions' degrees apart; once the
    # stages span nodes, some boundary crosses one, and the slowest boundary paces them
    return message_time(cluster, planned.ranks <= cluster.gpus_per_node, nbytes)


def _token_messages(shape: ModelShape, cluster: Cluster, o: Options, planned: PlannedLayout,
                    attention: Work, busy: int) -> TokenComm:
    """Per layer and micro-batch, what the token split's messages add (its pricing's
    ``communication``): one rank's keys and values (``shape``: the positions it holds)
    to the next rank of the split's group, within a node when the group's span is,
    overlapping this rank's attention where compute and messages progress together."""
    if planned.token_split == 1:
        return TokenComm()
    intra = planned.span(Role.TOKENS) <= cluster.gpus_per_node
    seconds = attention.seconds(cluster.async_dispatch) * compute_share(cluster, busy)
    if not overlaps_compute(cluster, busy):
        seconds = 0.0
    return token_pricing().communication(
        planned, key_value_values(shape, planned.mbs, planned.shards), o.act_bytes, seconds,
        seconds * attention_backward_ratio(shape, cluster),
        lambda nbytes: message_time(cluster, intra, nbytes))


def message_time(cluster: Cluster, intra: bool, nbytes: float) -> float:
    """One point-to-point message of ``nbytes``, inside a node or between nodes."""
    gbps = ((cluster.p2p_intra_gbps or cluster.intra_gbps) if intra else
            (cluster.p2p_inter_gbps or cluster.inter_gbps))
    latency = cluster.p2p_latency_s or (cluster.intra_latency_s if intra
                                        else cluster.inter_latency_s)
    return nbytes / (gbps * 1e9) + latency


def _reduction_exposed(shape: ModelShape, cluster: Cluster, o: Options,
                       planned: PlannedLayout, cut: StageCut, m: int, busy: int, params: float,
                       counts: list[int], passes: tuple[float, float]) -> dict[str, float]:
    """The replica group's communication of one step that compute does not hide, per
    collective (all_reduce, reduce_scatter, all_gather); ``passes``: the slowest
    stage's layers' (forward, backward with recomputation) per micro-batch."""
    none = dict.fromkeys(_REDUCTION_OPS, 0.0)
    replicas = planned.replicas
    if replicas == 1:
        return none
    span = planned.span(Role.REPLICAS)
    grads = params * o.grad_bytes
    hides = overlaps_compute(cluster, busy)
    forward, backward = passes if hides else (0.0, 0.0)
    if planned.zero == 0:
        buckets = max(1, math.ceil(grads / (o.bucket_mb * 2**20)))
        total = collective_time(cluster, "all_reduce", grads, replicas, busy,
                                calls=buckets, span=span)
        return none | {"all_reduce": _hidden_behind(total, backward, buckets)}
    flats = max(zero_flats(layers, *holds_ends(cut, st))
                for st, layers in enumerate(counts))
    reduce = collective_time(cluster, "reduce_scatter", grads, replicas, busy,
                             calls=flats, span=span)
    gather = collective_time(cluster, "all_gather", params * o.grad_bytes, replicas, busy,
                             calls=flats, span=span)
    if planned.zero < 3:  # stage 1 reduces in the last backward only; the shards after
        rounds = m if planned.zero == 2 else 1
        if o.param_gather_overlap:  # behind the next step's first forward
            gather = _hidden_behind(gather, forward, flats)
        return none | {"reduce_scatter": rounds * _hidden_behind(reduce, backward, flats),
                       "all_gather": gather}
    gathered, reduced = _prefetched(gather, reduce, forward, backward, max(1, flats // 2))
    return none | {"all_gather": m * gathered, "reduce_scatter": m * reduced}


def _prefetched(gather: float, reduce: float, forward: float, backward: float,
                units: int) -> tuple[float, float]:
    """ZeRO-3 as FSDP runs it, per micro-batch: (all-gather, reduce-scatter) seconds
    exposed. Each of ``units`` units (a block's two flat buffers, or the rest of the
    stage) is gathered before its forward and again before its backward, the next
    unit's gather prefetched while this one computes; each backward reduce-scatters
    its unit's gradients, behind the next unit's backward. So the first gather of each
    pass is exposed, then a unit's collectives beyond its compute, then the last
    reduce-scatter. The unit's share of ``gather`` / ``reduce`` (every unit's
    collectives) and of ``forward`` / ``backward`` (compute) is an even one."""
    g, r = gather / units, reduce / units
    f, b = forward / units, backward / units
    over_f = max(0.0, g - f)
    over_b = max(0.0, g + r - b)
    share = g / (g + r) if g + r > 0 else 0.5
    gathered = 2 * g + (units - 1) * (over_f + share * over_b)
    reduced = r + (units - 1) * (1 - share) * over_b
    return gathered, reduced


def _hidden_behind(total: float, window: float, calls: int) -> float:
    """What ``calls`` collectives taking ``total`` leave exposed when they overlap a
    compute ``window``: the excess, and at least the last call."""
    return max(total - window, total / calls)


def _step_sync(shape: ModelShape, cluster: Cluster, o: Options, planned: PlannedLayout,
               cut: StageCut, busy: int) -> float:
    """The small collectives of every step over the world (loss and token counts, the
    stop flag, telemetry on logged steps, the global norm of gradients that ZeRO or a
    dimension changing the model splits) and the tied embedding's gradient between the
    first and last stage."""
    world = planned.ranks
    split = planned.zero or any(planned.degree(d.key) > 1 for d in DIMENSIONS if d.changes_model)
    small = 2 + 1 / max(1, o.log_every) + (1 if split else 0)
    sync = small * collective_time(cluster, "all_reduce", _CONTROL_BYTES, world, busy)
    if cut.stages > 1 and shape.tied:
        sync += 2 * p2p_message_time(cluster, planned,
                                     shape.vocab * shape.hidden / planned.shards * o.grad_bytes)
    return sync


def holds_ends(cut: StageCut, stage: int) -> tuple[bool, bool]:
    """Whether ``stage`` holds the first chunk (the embedding) and the last (the
    head): stage 0 and the last stage, or in a V (zbv) both on stage 0."""
    local = cut.local_chunks(stage)
    return 0 in local, cut.n_chunks - 1 in local


def _optimizer_time(shape: ModelShape, cluster: Cluster, planned: PlannedLayout,
                    cut: StageCut, params: float, counts: list[int]) -> float:
    """The optimizer step on one rank's shard, memory-bound: AdamW reads the
    gradient and reads and writes the parameter and both moments (28 bytes per fp32
    parameter); clipping reads the gradient for its norm and zeroing writes it (8
    more); a few kernels, and framework time per parameter tensor."""
    shard = params / (planned.replicas if planned.zero >= 1 else 1)
    seconds = elementwise_time(cluster, shard * _OPTIMIZER_BYTES, 4)
    seconds += cluster.kernel_overhead_s * 4
    if cluster.tensor_overhead_s:
        tensors = max(rank_tensors(shape, layers, *holds_ends(cut, st), cut.stages,
                                   planned.zero) for st, layers in enumerate(counts))
        seconds += tensors * cluster.tensor_overhead_s
    return seconds
