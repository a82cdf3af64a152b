"""The machines a plan is for: per-device compute, memory and links.

Presets are set from published hardware figures (vendor datasheets: dense peak
FLOP/s, SMs, HBM capacity and bandwidth, NVLink and per-GPU network bandwidth of the
DGX / HGX systems) and from public microbenchmarks of what kernels and collectives
reach (the best matmul, FlashAttention by sequence length, streaming kernels, NCCL
inside and between nodes); each constant's source is beside the presets. They are not
fitted to any training run. ``disttrain plan calibrate`` measures these figures on the machine it
runs on and writes them in the same JSON form (:meth:`Cluster.to_json`).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from ..errors import UserError
from ..monitor.peaks import PUBLISHED_PEAKS

_GIB = 2**30


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """``gpus_per_node`` x ``nodes`` identical devices.

    ``peak_tflops``: dense peak per matmul precision (bf16, fp16, fp32);
    ``matmul_efficiency``: the fraction of it a large, well-shaped matmul reaches
    (smaller shapes get less: each matmul also pays ``kernel_overhead_s`` and is bound
    by ``memory_gbps``); ``attention_efficiency``: the same for fused attention;
    ``memory_gib``: per device, of which ``reserved_gib`` is never available (runtime
    context, allocator slack). Links: ``intra_*`` inside a node, ``inter_*`` between
    nodes, as NCCL *bus* bandwidth (GB/s per device) and per-step latency; ``p2p_*``
    one point-to-point message; ``op_gbps``: inside a node, a collective whose bus
    bandwidth differs from the all-reduce's (``reduce_scatter``, ``all_gather``);
    ``p2p_latency_s``: one message's latency (0: the tier's collective latency).
    ``group_links``: collectives measured on this machine, which replace the ring model
    for the groups they describe: ``"g/w"`` (a group of g ranks while w ranks of the
    node are busy, w / g such groups at once) -> op -> ``[latency_s, gbps]``, the
    time of one call being latency + its whole tensor (an all-reduce's buffer, a
    reduce-scatter's input, an all-gather's output) / gbps. On a CPU, where ranks
    share cores and a collective's latency depends on how many share them, calibration
    measures every such group; a GPU cluster needs none.

    Framework time beyond the kernels: ``layer_overhead_s`` per transformer layer's
    forward and backward (eager dispatch of its small operations, autograd's
    bookkeeping), ``microbatch_overhead_s`` per micro-batch for the model's ends
    (embedding, final norm, head, loss) beyond their kernels, ``tensor_overhead_s`` per
    parameter tensor per optimizer step (clipping, the update, zeroing). With
    ``async_dispatch`` (a GPU) the host's work overlaps the device's and a layer takes
    the longer of the two; on a CPU they add.
    Shape terms (a GPU preset sets them; their defaults turn them off, as on a CPU,
    where ``plan calibrate`` measures the figures above directly): ``sm_count``
    streaming multiprocessors and the ``gemm_tile`` (rows, columns) of the output one
    computes at a time, for matmuls' tile and wave quantisation;
    ``elementwise_efficiency``: the share of ``memory_gbps`` that memory-bound kernels
    (norms, activations, residual adds, the loss, the optimizer) reach, and
    ``elementwise_overhead_s`` the device time each of them adds beyond its bytes;
    ``attention_seq_half``: the sequence length at which fused attention reaches half
    of ``attention_efficiency``; ``attention_block``: its tile of keys, which lets a
    causal kernel skip the blocks above the diagonal; ``attention_backward_ratio``:
    its backward's time over its forward's.
    ``host_cores``: on a CPU, the cores a node's ranks share, each computing with
    ``threads_per_rank`` threads, so that more threads than cores slow every rank's
    compute in proportion (0: every device computes on its own, a GPU).
    """

    name: str
    gpus_per_node: int
    nodes: int = 1
    peak_tflops: dict[str, float]
    matmul_efficiency: float
    attention_efficiency: float
    kernel_overhead_s: float = 5e-6
    memory_gib: float
    reserved_gib: float = 1.0
    memory_gbps: float
    intra_gbps: float
    intra_latency_s: float = 8e-6
    inter_gbps: float
    inter_latency_s: float = 15e-6
    p2p_intra_gbps: float = 0.0  # 0: intra_gbps
    p2p_inter_gbps: float = 0.0  # 0: inter_gbps
    p2p_latency_s: float = 0.0  # 0: the tier's latency
    op_gbps: dict[str, float] = field(default_factory=dict)
    group_links: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    layer_overhead_s: float = 0.0
    microbatch_overhead_s: float = 0.0
    tensor_overhead_s: float = 0.0
    sm_count: int = 0  # 0: no tile / wave quantisation (a CPU)
    gemm_tile: tuple[int, int] = (256, 128)
    elementwise_efficiency: float = 1.0
    elementwise_overhead_s: float = 0.0
    attention_seq_half: float = 0.0  # 0: attention's efficiency does not depend on s
    attention_block: int = 0  # 0: fused attention computes the whole s x s square
    attention_backward_ratio: float = 2.0
    async_dispatch: bool = True
    host_cores: int = 0
    threads_per_rank: int = 1
    source: str = "preset"
    measured: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def n_devices(self) -> int:
        return self.gpus_per_node * self.nodes

    def peak_flops(self, precision: str) -> float:
        key = precision if precision in self.peak_tflops else "fp32"
        if key not in self.peak_tflops:
            raise UserError(f"cluster {self.name!r} has no peak for {precision}; add "
                            "peak_tflops to the cluster file")
        return self.peak_tflops[key] * 1e12

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(data: dict[str, Any], where: str = "cluster file") -> Cluster:
        known = {f.name for f in fields(Cluster)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise UserError(f"{where}: unknown keys {unknown}; known: {sorted(known)}")
        if isinstance(data.get("gemm_tile"), list):
            data = data | {"gemm_tile": tuple(data["gemm_tile"])}
        try:
            cluster = Cluster(**data)
        except TypeError as exc:
            raise UserError(f"{where}: {exc}") from None
        _validate(cluster, where)
        return cluster


def _validate(c: Cluster, where: str) -> None:
    positive = ("gpus_per_node", "nodes", "matmul_efficiency", "attention_efficiency",
                "memory_gib", "memory_gbps", "intra_gbps", "inter_gbps")
    for name in positive:
        value = getattr(c, name)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise UserError(f"{where}: {name}={value!r} must be a positive number")
    if c.matmul_efficiency > 1 or c.attention_efficiency > 1:
        raise UserError(f"{where}: efficiencies are fractions of the peak, at most 1")
    if not 0 < c.elementwise_efficiency <= 1:
        raise UserError(f"{where}: elementwise_efficiency={c.elementwise_efficiency!r} "
                        "must be a fraction of memory_gbps in (0, 1]")
    if c.attention_backward_ratio <= 0:
        raise UserError(f"{where}: attention_backward_ratio must be > 0")
    tile = c.gemm_tile
    if (not isinstance(tile, (tuple, list)) or len(tile) != 2
            or not all(isinstance(x, int) and x > 0 for x in tile)):
        raise UserError(f"{where}: gemm_tile={tile!r} must be two positive integers")
    for name in ("layer_overhead_s", "tensor_overhead_s", "kernel_overhead_s",
                 "microbatch_overhead_s", "elementwise_overhead_s", "attention_seq_half",
                 "attention_block", "sm_count",
                 "p2p_latency_s", "host_cores"):
        value = getattr(c, name)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            raise UserError(f"{where}: {name}={value!r} must be a number >= 0")
    if not isinstance(c.op_gbps, dict) or any(
            k not in ("reduce_scatter", "all_gather") or not isinstance(v, (int, float))
            or v <= 0 for k, v in c.op_gbps.items()):
        raise UserError(f"{where}: op_gbps maps reduce_scatter / all_gather to GB/s > 0")
    if not isinstance(c.threads_per_rank, int) or c.threads_per_rank < 1:
        raise UserError(f"{where}: threads_per_rank={c.threads_per_rank!r} must be an "
                        "integer >= 1")
    _validate_group_links(c.group_links, where)
    if not c.peak_tflops or any(not isinstance(v, (int, float)) or v <= 0
                                for v in c.peak_tflops.values()):
        raise UserError(f"{where}: peak_tflops must map precisions to positive TFLOP/s")


GROUP_LINK_OPS = ("all_reduce", "reduce_scatter", "all_gather")


def group_link_key(ranks: int, busy: int) -> str:
    """The ``group_links`` key of a group of ``ranks`` while ``busy`` ranks of the node
    run."""
    return f"{ranks}/{busy}"


def _validate_group_links(links: Any, where: str) -> None:
    problem = f"{where}: group_links maps 'g/w' (g divides w) to {{op: [latency_s, gbps]}}"
    if not isinstance(links, dict):
        raise UserError(problem)
    for key, ops in links.items():
        g, slash, w = str(key).partition("/")
        if not (slash and g.isdigit() and w.isdigit() and 1 < int(g) <= int(w)
                and int(w) % int(g) == 0) or not isinstance(ops, dict):
            raise UserError(f"{problem}; not {key!r}")
        for op, fit in ops.items():
            if op not in GROUP_LINK_OPS or not isinstance(fit, list) or len(fit) != 2 \
                    or not all(isinstance(x, (int, float)) and not isinstance(x, bool)
                               for x in fit) or fit[0] < 0 or fit[1] <= 0:
                raise UserError(f"{problem}, op one of {GROUP_LINK_OPS}; not {op!r}: "
                                f"{fit!r}")


def _peaks(name: str) -> dict[str, float]:
    table = {p.name: p.tflops for p in PUBLISHED_PEAKS}
    return {k: table[name][k] for k in ("bf16", "fp16", "fp32")}


# GPU presets. Every constant is a vendor figure or a public measurement, none is
# fitted to a training run (the runs the planner is checked against, in bench/plan.py
# and tests/plan, are never used to set them):
#
# - peak_tflops: dense bf16/fp16/fp32 from the datasheets (monitor.peaks).
# - matmul_efficiency: the Maximum Achievable Matmul FLOPS that Bekman's mamf-finder
#   measured over a sweep of shapes (github.com/stas00/ml-engineering,
#   compute/accelerator/README.md, "Maximum Achievable Matmul FLOPS comparison table"):
#   A100 SXM 271.2 of 312 TFLOPS bf16 (86.9%), H100 SXM 794.5 of 989 (80.3%; "H200 is
#   the same"). Smaller and oddly shaped matmuls get less through gemm_tile / sm_count.
# - sm_count: 108 SMs on an A100, 132 on an H100 / H200 SXM (the architecture
#   whitepapers). gemm_tile 256 x 128: the tile NVIDIA's "Matrix Multiplication
#   Background User's Guide" (DU-09799-001, section 2.3, "Typical tile dimensions in
#   cuBLAS") names as cuBLAS's most efficient; its chapter 3 is the tile and wave
#   quantisation that costs.gemm_shape_efficiency prices.
# - memory_gbps: HBM bandwidth from the datasheets (A100 40GB 1555, 80GB 2039, H100
#   SXM 3350, H200 4800 GB/s); elementwise_efficiency 0.9: STREAM-style copy and triad
#   kernels reach about 90% of it (a public H100 SXM log: triad 3089 of 3350 GB/s, 92%;
#   the same share assumed for the A100).
# - attention: FlashAttention-2 reaches "50-73% of the theoretical maximum FLOPs/s on
#   A100" (Dao 2023, arXiv 2307.08691, abstract), forward at the top of that range,
#   backward at the bottom: 0.6 for both together on the FLOPs it executes. Its
#   backward runs 5 matmuls to the forward's 2 (attention_backward_ratio 2.5), its
#   tiles are 128 keys wide (attention_block 128, what a causal kernel skips), and a
#   short sequence reaches less: the sweep of pytorch/benchmark (commit ff65cb67, H100,
#   head dim 128, B x S = 16k) gives 329, 390, 434, 458, 471, 477 TFLOPS for s = 512
#   ... 16384, which is 477 x s / (s + 256) within 4% (attention_seq_half 256). On an
#   H100 FlashAttention-2 reaches 477 of 989 TFLOPS there (0.45 with the backward).
# - links, as NCCL bus bandwidth per GPU: NVLink 300 GB/s each way on an A100, 450 on
#   an H100 / H200; Bekman measured an all-reduce at 234.89 GB/s on an A100 node (78%)
#   and 367.61 on an H200 node with NVLS off (82%) (network/README.md). Between nodes
#   each GPU has its own NIC: DGX A100 8 x 200 Gb/s HDR (25 GB/s per GPU), DGX H100 /
#   H200 8 x 400 Gb/s NDR (50 GB/s per GPU); a 4-node ring reached 377 of the node's
#   8 x 50 GB/s (94%, B200) and 365 of 400 (91%, H200) in the same chapter: 0.9 of the
#   NIC per GPU (costs.collective_time charges a ring over nodes to all the node's NICs
#   that the group uses).
# - launch: a CUDA kernel launch costs about 5 us of device-side gap per kernel;
#   eager PyTorch spends roughly 60 kernels' host time per transformer layer (forward
#   and backward, ~5 us each), which the host overlaps with the device (async
#   dispatch), so it only shows for tiny layers; fused AdamW: no per-tensor loop.
_GPU_HOST: dict[str, Any] = {"layer_overhead_s": 3e-4, "tensor_overhead_s": 0.0,
                             "async_dispatch": True, "elementwise_efficiency": 0.9,
                             "elementwise_overhead_s": 5e-6, "gemm_tile": (256, 128),
                             "attention_seq_half": 256.0, "attention_block": 128,
                             "attention_backward_ratio": 2.5}
_A100 = Cluster(name="a100-40gb", gpus_per_node=8, peak_tflops=_peaks("A100-SXM"),
                matmul_efficiency=271.2 / 312, attention_efficiency=0.6, sm_count=108,
                memory_gib=40 * 1e9 / _GIB, memory_gbps=1555.0, intra_gbps=234.89,
                inter_gbps=0.9 * 25, **_GPU_HOST)
_H100 = Cluster(name="h100-80gb", gpus_per_node=8, peak_tflops=_peaks("H100-SXM"),
                matmul_efficiency=794.5 / 989, attention_efficiency=0.45, sm_count=132,
                memory_gib=80 * 1e9 / _GIB, memory_gbps=3350.0, intra_gbps=367.61,
                inter_gbps=0.9 * 50, **_GPU_HOST)
# the 80 GB A100 and the H200 differ from their siblings in memory only
PRESETS: dict[str, Cluster] = {
    "a100-40gb": _A100,
    "a100-80gb": replace(_A100, name="a100-80gb", memory_gib=80 * 1e9 / _GIB,
                         memory_gbps=2039.0),
    "h100-80gb": _H100,
    "h200": replace(_H100, name="h200", peak_tflops=_peaks("H200-SXM"),
                    memory_gib=141 * 1e9 / _GIB, memory_gbps=4800.0),
}
PRESETS["h100"] = replace(PRESETS["h100-80gb"], name="h100")
PRESETS["a100"] = replace(PRESETS["a100-80gb"], name="a100")

# How each preset's predictions compared with published runs (bench/plan.py's tables,
# the figures and sources in bench/README.md, `plan.py`): printed under the planner's
# table, so that a predicted throughput is read as what it is
_PRESET_CHECKS = {
    "a100": ("predicted throughput 3% above published A100 runs' at the median "
             "(Megatron-LM 2021, 10 rows, worst 7%) and 12% above (llm-foundry, 41 rows, "
             "worst 45%)"),
    "h100": ("predicted throughput 42-85% above published H100 runs' at the median "
             "(Megatron-LM, llm-foundry, torchtitan; its matmuls match a measured sweep, "
             "what a sustained run loses beyond them is not modelled): rank layouts by "
             "it, do not budget by it; 'disttrain plan calibrate' measures a machine you "
             "have"),
}


def preset_check(cluster: Cluster) -> str | None:
    """How the predictions of ``cluster``'s preset family compared with published runs
    (None: a calibrated cluster, or a preset no published table checks); the H200
    shares the H100's compute figures."""
    if cluster.source != "preset":
        return None
    family = "h100" if cluster.name.startswith(("h100", "h200")) else cluster.name[:4]
    text = _PRESET_CHECKS.get(family)
    return None if text is None else f"{cluster.name} preset: {text}"


# a GPU's name as torch.cuda.get_device_name gives it -> its preset; first match wins
_DEVICE_PRESETS = ((r"\bH200\b", "h200"), (r"\bH100\b", "h100-80gb"),
                   (r"\bA100\b.*\b80\s*GB\b", "a100-80gb"), (r"\bA100\b", "a100-40gb"))


def preset_for_device(device_name: str) -> str | None:
    """The preset of the GPU called ``device_name`` (``NVIDIA A100-SXM4-80GB``), or None
    when no preset describes it (a CPU, another GPU)."""
    name = device_name.upper()
    return next((preset for pattern, preset in _DEVICE_PRESETS
                 if re.search(pattern, name)), None)


def parse_cluster(text: str) -> Cluster:
    """``--cluster``: ``gpu=NAME,gpus_per_node=G,nodes=N`` (a preset, any field
    overridable: ``memory_gib=..``) or a JSON file (from ``plan calibrate``)."""
    if text.strip().endswith(".json"):
        path = Path(text.strip())
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise UserError(f"--cluster {path}: cannot read a JSON cluster file "
                            f"({exc})") from None
        if not isinstance(data, dict):
            raise UserError(f"--cluster {path}: not a JSON object")
        return Cluster.from_json(data, str(path))
    items = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            raise UserError(f"--cluster item {item!r}: expected key=value")
        items[key] = value
    gpu = items.pop("gpu", "")
    if gpu not in PRESETS:
        raise UserError(f"--cluster gpu={gpu!r} is not a preset; use one of "
                        f"{', '.join(sorted(PRESETS))}, or a cluster JSON file from "
                        "'disttrain plan calibrate'")
    base = PRESETS[gpu]
    changes: dict[str, Any] = {}
    types = {f.name: f.type for f in fields(Cluster)}
    for key, value in items.items():
        if key not in types or key in ("name", "peak_tflops", "measured", "source",
                                       "op_gbps", "async_dispatch", "group_links",
                                       "gemm_tile"):
            raise UserError(f"--cluster {key}=...: not a cluster field; use gpu, "
                            "gpus_per_node, nodes, memory_gib, ...")
        try:
            changes[key] = int(value) if key in ("gpus_per_node", "nodes", "host_cores",
                                                 "threads_per_rank", "sm_count",
                                                 "attention_block") else float(value)
        except ValueError:
            raise UserError(f"--cluster {key}={value!r} is not a number") from None
    cluster = replace(base, **changes)
    _validate(cluster, "--cluster")
    return cluster
