"""What pieces of a training step cost on a cluster: one matmul, fused attention, a
ring collective, one transformer layer's kernels, and framework time next to them.
The planner's :mod:`~.estimate` assembles a step from these; ``plan calibrate`` fits
the cluster's figures with the same functions, so measurement and prediction agree on
what each figure means.
"""

from __future__ import annotations

import math

from .cluster import Cluster, group_link_key
from .shape import ModelShape

ACT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def matmul_time(cluster: Cluster, m: float, n: float, k: float, precision: str,
                bytes_per: int) -> float:
    """One [m, k] x [k, n] matmul: the slower of its FLOPs at the cluster's matmul
    efficiency and its operands through memory, plus the per-kernel overhead."""
    flops = 2 * m * n * k
    compute = flops / (cluster.peak_flops(precision) * cluster.matmul_efficiency)
    memory = (m * k + k * n + m * n) * bytes_per / (cluster.memory_gbps * 1e9)
    return max(compute, memory) + cluster.kernel_overhead_s


def attention_time(cluster: Cluster, b: float, s: float, width: float,
                   precision: str) -> float:
    """Fused attention's forward over ``b`` sequences of ``s`` tokens, ``width`` =
    heads x head_dim (on one tp rank): q.k and the weighted sum of v, 2 x 2bs^2 x width
    FLOPs (causal masking not subtracted), at the cluster's attention efficiency."""
    flops = 2 * 2 * b * s * s * width
    return flops / (cluster.peak_flops(precision) * cluster.attention_efficiency)


def ring_bytes_factor(ranks: int, kind: str = "all_reduce") -> float:
    """The share of the whole buffer each rank sends: all-reduce 2(n-1)/n,
    reduce-scatter and all-gather (n-1)/n (NCCL's bus bandwidth over its algorithm
    bandwidth)."""
    return (2 if kind == "all_reduce" else 1) * (ranks - 1) / ranks


def ring_latency_steps(ranks: int) -> int:
    """Latency terms a collective pays: the cheaper of the ring's and a tree's."""
    return min(2 * (ranks - 1), 2 * math.ceil(math.log2(ranks)))


def ring_time(nbytes: float, ranks: int, gbps: float, latency: float, *,
              kind: str = "all_reduce") -> float:
    """NCCL-style ring (bus bandwidth ``gbps``, ``latency`` per step): see
    :func:`ring_bytes_factor` and :func:`ring_latency_steps`."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    return (nbytes * ring_bytes_factor(ranks, kind) / (gbps * 1e9)
            + ring_latency_steps(ranks) * latency)


def tier(cluster: Cluster, span: int) -> tuple[float, float]:
    """(bus GB/s, latency) of a group whose ranks span ``span`` consecutive devices."""
    if span <= cluster.gpus_per_node:
        return cluster.intra_gbps, cluster.intra_latency_s
    return cluster.inter_gbps, cluster.inter_latency_s


def layer_kernels(shape: ModelShape, cluster: Cluster, tp: int, b: int,
                   precision: str) -> tuple[float, float]:
    """(every kernel, the attention kernel alone) of one layer's forward on one tp
    rank for a micro-batch of ``b``: each matmul from its shape, fused attention,
    elementwise work through memory (norms, residuals, activation)."""
    tokens, h, a = b * shape.seq, shape.hidden, ACT_BYTES[precision]
    total = 0.0
    for name, i, out in shape.matmul_shapes():
        n, k = (out / tp, i) if name in ("qkv", "gate", "up") else (out, i / tp)
        total += matmul_time(cluster, tokens, n, k, precision, a)
    attn = attention_time(cluster, b, shape.seq, h / tp, precision)
    elementwise = (12 * h + (4 if shape.gated else 2) * shape.ffn_width / tp) * tokens * a
    return total + attn + elementwise / (cluster.memory_gbps * 1e9), attn


def head_kernel_time(shape: ModelShape, cluster: Cluster, b: int, precision: str,
                     tp: int = 1) -> float:
    """Kernel seconds of the head and loss's forward and backward for a micro-batch of
    ``b`` on one tp rank: three matmuls of the head's shape, three passes over the
    fp32 logits."""
    tokens = b * shape.seq
    return (3 * matmul_time(cluster, tokens, shape.vocab / tp, shape.hidden, precision,
                            ACT_BYTES[precision])
            + 3 * 4 * tokens * shape.vocab / tp / (cluster.memory_gbps * 1e9))


def kernel_time_of_layer(shape: ModelShape, cluster: Cluster, b: int,
                         precision: str) -> float:
    """Kernel seconds of one layer's forward and backward (backward = 2 x forward) on
    one device, without framework time."""
    return 3 * layer_kernels(shape, cluster, 1, b, precision)[0]


def with_host(cluster: Cluster, device_s: float, host_s: float) -> float:
    """A piece of work that takes ``device_s`` in kernels and ``host_s`` of framework
    time: the longer of the two when the host runs ahead of the device, else both."""
    return max(device_s, host_s) if cluster.async_dispatch else device_s + host_s


def op_gbps(cluster: Cluster, kind: str, span: int, default: float) -> float:
    """Bus bandwidth of collective ``kind`` on a group spanning ``span`` devices: the
    cluster's own figure for it inside a node, if it has one."""
    if span <= cluster.gpus_per_node and cluster.op_gbps.get(kind):
        return cluster.op_gbps[kind]
    return default


def node_ranks(cluster: Cluster, ranks: int) -> int:
    """Ranks of a layout of ``ranks`` busy on each node it uses."""
    return min(ranks, cluster.gpus_per_node)


def compute_share(cluster: Cluster, busy: int) -> float:
    """How much slower each rank computes while ``busy`` ranks of its node run: on a
    CPU whose ranks share ``host_cores``, threads beyond the cores wait their turn; a
    device of its own (a GPU), 1."""
    if not cluster.host_cores:
        return 1.0
    return max(1.0, busy * cluster.threads_per_rank / cluster.host_cores)


def overlaps_compute(cluster: Cluster, busy: int) -> bool:
    """Whether an asynchronous collective progresses while ranks compute: on a GPU,
    yes (its own engines); on a CPU only when a core is left over for the backend's
    thread beside the ``busy`` ranks' compute threads."""
    return not cluster.host_cores or busy * cluster.threads_per_rank < cluster.host_cores


def collective_time(cluster: Cluster, op: str, nbytes: float, ranks: int, busy: int, *,
                    calls: int = 1, span: int | None = None) -> float:
    """``calls`` calls of collective ``op`` (all_reduce, reduce_scatter, all_gather)
    moving ``nbytes`` in all (counted as each call's whole tensor) over a group of
    ``ranks`` spanning ``span`` consecutive devices (default ``ranks``), while ``busy``
    ranks of each node run: the cluster's measured fit for that group
    (``group_links``) inside a node, else the ring (:func:`ring_time`) on the tier the
    group spans."""
    if ranks <= 1 or calls <= 0 or nbytes < 0:
        return 0.0
    span = ranks if span is None else span
    fit = cluster.group_links.get(group_link_key(ranks, busy), {}).get(op)
    if fit and span <= cluster.gpus_per_node:
        latency, gbps = fit
        return calls * latency + nbytes / (gbps * 1e9)
    gbps, latency = tier(cluster, span)
    if op != "all_reduce":
        gbps = op_gbps(cluster, op, span, gbps)
    return calls * ring_time(nbytes / calls, ranks, gbps, latency, kind=op)
