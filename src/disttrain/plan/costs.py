"""What pieces of a training step cost on a cluster: one matmul by its shape, fused
attention, memory-bound kernels, a ring collective inside a node or over nodes, and
framework time next to kernels. :mod:`.work` builds a layer and the head from these
and :mod:`.steptime` a step; ``plan calibrate`` fits
the cluster's figures with the same functions, so measurement and prediction agree on
what each figure means.
"""

from __future__ import annotations

import math

from .cluster import Cluster, group_link_key

ACT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def gemm_shape_efficiency(cluster: Cluster, m: float, n: float, k: float) -> float:
    """The share of the matmul ceiling an [m, k] x [k, n] matmul keeps after tile and
    wave quantisation (NVIDIA's *Matrix Multiplication Background* guide): the [m, n]
    output is cut into ``gemm_tile`` tiles, one SM each at a time, so a partial tile
    and a partial last wave cost as much as full ones. When the tiles leave SMs idle
    the contraction is split (split-K) into up to ``sm_count / tiles`` parts at least
    a tile deep. 1 without ``sm_count`` (a CPU)."""
    sms = cluster.sm_count
    if not sms:
        return 1.0
    tm, tn = cluster.gemm_tile
    tiles = math.ceil(m / tm) * math.ceil(n / tn)
    split = max(1, min(sms // tiles, int(k // tm))) if tiles < sms else 1
    waves = math.ceil(tiles * split / sms)
    return (m * n * k) / (waves * sms * tm * tn * (k / split))


def matmul_parts(cluster: Cluster, m: float, n: float, k: float, precision: str,
                 bytes_per: int) -> tuple[float, float]:
    """(kernel seconds, launch overhead) of one [m, k] x [k, n] matmul.

    Without ``sm_count`` (a CPU, a calibrated file): the slower of its FLOPs at the
    matmul efficiency and its three operands through memory. With it (a GPU preset):
    its FLOPs at the efficiency times :func:`gemm_shape_efficiency`, or the inputs'
    reads if slower, plus the write of the output, which a tile issues only after its
    whole contraction (a thin contraction pays it in full)."""
    flops = 2 * m * n * k
    peak = cluster.peak_flops(precision) * cluster.matmul_efficiency
    bandwidth = cluster.memory_gbps * 1e9
    if not cluster.sm_count:
        memory = (m * k + k * n + m * n) * bytes_per / bandwidth
        return max(flops / peak, memory), cluster.kernel_overhead_s
    compute = flops / (peak * gemm_shape_efficiency(cluster, m, n, k))
    reads = (m * k + k * n) * bytes_per / bandwidth
    return max(compute, reads) + m * n * bytes_per / bandwidth, cluster.kernel_overhead_s


def matmul_time(cluster: Cluster, m: float, n: float, k: float, precision: str,
                bytes_per: int) -> float:
    """One [m, k] x [k, n] matmul, kernel and overhead (:func:`matmul_parts`)."""
    kernel, overhead = matmul_parts(cluster, m, n, k, precision, bytes_per)
    return kernel + overhead


def attention_flops(cluster: Cluster, b: float, s: float, width: float) -> float:
    """FLOPs fused attention's forward executes over ``b`` sequences of ``s`` tokens,
    ``width`` = heads x head_dim: q.k and the weighted sum of v, 2 x 2bs^2 x width,
    less the blocks above a causal mask's diagonal that a kernel with tiles of
    ``attention_block`` keys skips ((1 + block / s) / 2 of the square is left)."""
    full = 2 * 2 * b * s * s * width
    block = cluster.attention_block
    return full * min(1.0, (1 + block / s) / 2) if block else full


def attention_time(cluster: Cluster, b: float, s: float, width: float,
                   precision: str) -> float:
    """Fused attention's forward over ``b`` sequences of ``s`` tokens, ``width`` =
    heads x head_dim (on one tp rank): :func:`attention_flops` at the attention
    efficiency, of which a sequence of s reaches s / (s + ``attention_seq_half``) (each
    block of queries loops over the keys; a short loop does not amortise its start and
    end)."""
    half = cluster.attention_seq_half
    efficiency = cluster.attention_efficiency * (s / (s + half) if half else 1.0)
    return attention_flops(cluster, b, s, width) / (cluster.peak_flops(precision)
                                                    * efficiency)


def elementwise_time(cluster: Cluster, nbytes: float, kernels: int = 0) -> float:
    """Memory-bound kernels moving ``nbytes`` in all (reads + writes): at the share of
    the memory bandwidth they reach, plus each kernel's device overhead."""
    return (nbytes / (cluster.memory_gbps * 1e9 * cluster.elementwise_efficiency)
            + kernels * cluster.elementwise_overhead_s)


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
    (``group_links``) inside a node, else the ring (:func:`ring_time`) inside a node,
    or across nodes :func:`two_level_time`."""
    if ranks <= 1 or calls <= 0 or nbytes < 0:
        return 0.0
    span = ranks if span is None else span
    fit = cluster.group_links.get(group_link_key(ranks, busy), {}).get(op)
    if fit and span <= cluster.gpus_per_node:
        latency, gbps = fit
        return calls * latency + nbytes / (gbps * 1e9)
    if span > cluster.gpus_per_node:
        return calls * two_level_time(cluster, op, nbytes / calls, ranks, span)
    gbps, latency = tier(cluster, span)
    if op != "all_reduce":
        gbps = op_gbps(cluster, op, span, gbps)
    return calls * ring_time(nbytes / calls, ranks, gbps, latency, kind=op)


def two_level_time(cluster: Cluster, op: str, nbytes: float, ranks: int,
                   span: int) -> float:
    """One call of ``op`` on ``nbytes`` over ``ranks`` spread evenly over the nodes of
    ``span`` consecutive devices, g of them on each node: NCCL's ring visits each
    node's g members over NVLink and leaves the node once, and with one channel per
    member the node's crossings share out over the g members' own NICs. So each rank
    moves the ring's share of the buffer (:func:`ring_bytes_factor`), (g - 1) / g of it
    over NVLink (``intra_gbps``) and the node's crossings 1 / g over its NIC
    (``inter_gbps`` per GPU); the slower link paces the ring."""
    nodes = math.ceil(span / cluster.gpus_per_node)
    g = max(1, ranks // nodes)
    moved = nbytes * ring_bytes_factor(ranks, op)
    nic = moved / g / (cluster.inter_gbps * 1e9)
    intra = op_gbps(cluster, op, cluster.gpus_per_node, cluster.intra_gbps)
    nvlink = moved * (g - 1) / g / (intra * 1e9)
    return max(nic, nvlink) + ring_latency_steps(ranks) * cluster.inter_latency_s
