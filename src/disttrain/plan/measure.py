"""Timings of this machine for ``plan calibrate``: matmuls, fused attention and a large
copy on one device (in this process), collectives over N local ranks (in child
processes, with a hard timeout).

Every figure is the median of several calls after warm-up calls (the collectives: each
call kept, for the calibration's fit); on a GPU each call is
timed with CUDA events, on a CPU with ``time.perf_counter`` (the calls block). A long
call is repeated fewer times (three at least) so the whole stays within its budget.
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..comm.transport import yield_to_compute
from ..monitor.peaks import MATMUL_DTYPES
from .fit import MatmulPoint

_GIB = 2**30
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "p2p")

# [m, k] x [k, n] = [tokens, hidden] x [hidden, out]: square-ish layer matmuls from
# small to large, then thin ones (few tokens, or a narrow output) that are bound by
# memory or by the kernel's overhead.
_MATMULS = {
    ("cpu", False): ((128, 256, 256), (256, 512, 512), (512, 512, 2048),
                     (1024, 1024, 1024), (2048, 1024, 1024), (1024, 1024, 8),
                     (8, 1024, 1024), (2048, 512, 16)),
    ("cpu", True): ((128, 256, 256), (256, 512, 512), (512, 1024, 1024),
                    (1024, 1024, 8), (8, 1024, 1024)),
    # with three of a training step's: 16k tokens of a 4096-wide layer into 3 x 4096
    # (qkv), out of 4 x 4096 (the MLP's down projection), and a weight gradient
    ("cuda", False): ((1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096),
                      (8192, 4096, 4096), (8192, 8192, 8192), (8192, 4096, 16),
                      (16, 4096, 4096), (8192, 8192, 128), (16384, 4096, 12288),
                      (16384, 16384, 4096), (4096, 16384, 4096)),
    ("cuda", True): ((1024, 1024, 1024), (4096, 4096, 4096), (8192, 8192, 8192),
                     (8192, 4096, 16), (16, 4096, 4096)),
}
# A CPU's 16-bit matmuls are tried on this shape first: large enough to be a fair
# sample, small enough to take a fraction of a second where they are emulated.
CPU_PROBE = (256, 512, 512)
# (batch, heads, seq, head_dim) of causal fused attention
_ATTENTION = {
    ("cpu", False): ((1, 8, 256, 64), (1, 8, 512, 64), (1, 8, 1024, 64)),
    ("cpu", True): ((1, 8, 256, 64), (1, 8, 512, 64)),
    ("cuda", False): ((8, 16, 1024, 128), (4, 16, 2048, 128), (2, 16, 4096, 128),
                      (1, 32, 8192, 128)),
    ("cuda", True): ((8, 16, 1024, 128), (2, 16, 4096, 128)),
}
_COPY_BYTES = {("cpu", False): 256 * 2**20, ("cpu", True): 64 * 2**20,
               ("cuda", False): 2 * _GIB, ("cuda", True): 512 * 2**20}


@dataclass(frozen=True, kw_only=True)
class Effort:
    """How hard to measure: ``repeats`` timed calls (after ``warmup``), fewer when
    they would take more than ``seconds`` (three at least, if ``repeats`` allows)."""

    repeats: int
    warmup: int
    seconds: float

    @staticmethod
    def of(quick: bool) -> Effort:
        return Effort(repeats=5, warmup=1, seconds=0.15) if quick else \
            Effort(repeats=15, warmup=2, seconds=1.0)


@dataclass(frozen=True, kw_only=True)
class AttentionPoint:
    batch: int
    heads: int
    seq: int
    head_dim: int
    seconds: float


def median_time(fn: Callable[[], object], device: torch.device, effort: Effort) -> float:
    """Median seconds of one ``fn()`` call."""
    for _ in range(effort.warmup):
        fn()
    _sync(device)
    times: list[float] = []
    deadline = time.perf_counter() + effort.seconds
    while len(times) < effort.repeats and (len(times) < 3 or time.perf_counter() < deadline):
        times.append(_time_once(fn, device))
    return statistics.median(times)


def _time_once(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    start_s = time.perf_counter()
    fn()
    return time.perf_counter() - start_s


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_shapes(device: torch.device, quick: bool) -> tuple[tuple[int, int, int], ...]:
    return _MATMULS[(device.type, quick)]


def time_matmul(device: torch.device, precision: str, shape: tuple[int, int, int],
                effort: Effort) -> MatmulPoint:
    m, k, n = shape
    dtype = MATMUL_DTYPES[precision]
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    out = torch.empty(m, n, device=device, dtype=dtype)
    seconds = median_time(lambda: torch.matmul(a, b, out=out), device, effort)
    return MatmulPoint(precision=precision, m=m, k=k, n=n, seconds=seconds)


def time_attention(device: torch.device, precision: str, quick: bool,
                   effort: Effort) -> list[AttentionPoint]:
    """Causal ``scaled_dot_product_attention`` forward, q, k, v: [batch, heads, seq,
    head_dim]."""
    points = []
    for batch, heads, seq, dim in _ATTENTION[(device.type, quick)]:
        q, k, v = (torch.randn(batch, heads, seq, dim, device=device,
                               dtype=MATMUL_DTYPES[precision]) for _ in range(3))
        seconds = median_time(functools.partial(F.scaled_dot_product_attention, q, k, v,
                                                is_causal=True), device, effort)
        points.append(AttentionPoint(batch=batch, heads=heads, seq=seq, head_dim=dim,
                                     seconds=seconds))
    return points


# A transformer layer small enough that its kernels take next to nothing: what it
# costs is eager PyTorch's dispatch and autograd's bookkeeping (disttrain's own block)
_TINY_LAYER: dict[str, Any] = {"d_model": 32, "n_head": 4, "seq_len": 16, "vocab_size": 64,
                               "n_layer": 1}
_TINY_BATCH = 2
_TENSORS = 64  # parameter tensors the optimizer's per-tensor cost is averaged over


def time_tiny_layer(device: torch.device, effort: Effort) -> tuple[dict, float]:
    """(the layer's dimensions, seconds of one forward + backward)."""
    from ..config.schema import ModelConfig
    from ..models.gpt import Block

    cfg = ModelConfig(**_TINY_LAYER)
    block = Block(cfg).to(device)
    x = torch.randn(_TINY_BATCH, cfg.seq_len, cfg.d_model, device=device,
                    requires_grad=True)

    def step() -> None:
        block(x).sum().backward()

    return {**_TINY_LAYER, "batch": _TINY_BATCH}, median_time(step, device, effort)


def time_tiny_model(device: torch.device, effort: Effort) -> float:
    """Seconds of one forward + backward of the built-in GPT with one layer of
    :func:`time_tiny_layer`'s size: the layer and the model's ends (embedding, final
    norm, head, loss)."""
    from ..config.schema import ModelConfig
    from ..models.gpt import GPT, token_loss

    cfg = ModelConfig(**_TINY_LAYER)
    model = GPT(cfg).to(device)
    ids = torch.randint(0, cfg.vocab_size, (_TINY_BATCH, cfg.seq_len), device=device)

    def step() -> None:
        loss, _ = token_loss(model(ids), ids)
        loss.backward()

    return median_time(step, device, effort)


def time_optimizer_tensors(device: torch.device, effort: Effort) -> tuple[int, float]:
    """(tensors, seconds of clipping, an AdamW step and zeroing over that many small
    parameter tensors), AdamW built as disttrain builds it (fused on a GPU)."""
    params = [torch.nn.Parameter(torch.randn(32, device=device)) for _ in range(_TENSORS)]
    for p in params:
        p.grad = torch.randn_like(p)
    fused = True if device.type == "cuda" else None
    opt = torch.optim.AdamW(params, lr=1e-3, fused=fused)

    def step() -> None:
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=False)

    return _TENSORS, median_time(step, device, effort)


def time_copy(device: torch.device, quick: bool, effort: Effort) -> tuple[int, float]:
    """(bytes read + written, seconds) of copying one large buffer into another."""
    nbytes = _COPY_BYTES[(device.type, quick)]
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes, median_time(lambda: dst.copy_(src), device, effort)


def device_memory_gib(device: torch.device, nproc: int) -> tuple[float, float]:
    """(memory, reserved) GiB of one device: a GPU's memory and what is in use once
    this process holds a context on it; on a CPU, the RAM's share of one of ``nproc``
    ranks, 0.5 GiB kept back."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        return total / _GIB, max(0.5, (total - free) / _GIB)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total / nproc / _GIB, 0.5


def collective_sizes(quick: bool) -> list[int]:
    """Message sizes in bytes: 4 KiB to 64 MiB (to 8 MiB with ``quick``)."""
    if quick:
        return [4 * 2**10, 64 * 2**10, 2**20, 8 * 2**20]
    return [4 * 2**10 * 4**i for i in range(8)]


def collective_times(sizes: list[int], effort: Effort) -> dict[str, list[list[float]]]:
    """Run on every rank of a process group: ``{op: [[seconds of each timed call] for
    each size]}`` as this rank saw them (:func:`_timed_calls`); ``p2p`` is half a round
    trip between ranks 0 and 1 (0.0 on the other ranks)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) \
        if dist.get_backend() == "nccl" else torch.device("cpu")
    out: dict[str, list[list[float]]] = {op: [] for op in COLLECTIVES}
    for size in sizes:
        numel = -(-size // (4 * n)) * n  # fp32 elements, a multiple of the ranks
        whole = torch.zeros(numel, device=device)
        shard = torch.zeros(numel // n, device=device)
        # this size's buffers bound now (partial), not looked up when a call runs
        calls: dict[str, Callable[[], object]] = {
            "all_reduce": functools.partial(dist.all_reduce, whole),
            "reduce_scatter": functools.partial(_REDUCE_SCATTER, shard, whole),
            "all_gather": functools.partial(_ALL_GATHER, whole, shard),
            "p2p": functools.partial(_ping_pong, whole, rank)}
        batch = max(1, min(8, 2**20 // size))  # small messages: several per figure
        for op, call in calls.items():
            times = _timed_calls(call, device, effort, batch)
            if op == "p2p":
                times = [t / 2 if rank < 2 else 0.0 for t in times]
            out[op].append(times)
    return out


def group_sizes(world: int) -> list[int]:
    """The group sizes measured inside a world of ``world`` ranks: powers of two below
    it, and the world itself."""
    sizes = [g for g in (2**i for i in range(1, world.bit_length())) if g < world]
    return sizes + [world] if world > 1 else []


def link_times(sizes: list[int], effort: Effort, groups: list[int]
               ) -> dict[str, object]:
    """Run on every rank of a process group: the whole world's
    :func:`collective_times` (``world``), and for each size g in ``groups`` smaller
    than the world, the collectives of consecutive groups of g ranks running at once
    (``groups``: {g: {op: [[seconds of each call] for each size]}} as this rank saw
    them in its own group)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    out: dict[int, dict[str, list[list[float]]]] = {}
    for g in groups:
        if g >= n:
            continue
        # every rank creates every group, in the same order
        mine = [dist.new_group(list(range(s, s + g))) for s in range(0, n, g)][rank // g]
        _as_a_run_has_them()
        out[g] = group_collective_times(sizes, effort, mine, g)
    _as_a_run_has_them()
    return {"world": collective_times(sizes, effort), "groups": out}


def _as_a_run_has_them() -> None:
    """Gloo's polling threads lowered, as a CPU run lowers them (:mod:`~disttrain.comm.
    transport`)."""
    if dist.get_backend() == "gloo":
        yield_to_compute()


def group_collective_times(sizes: list[int], effort: Effort, group: object, g: int
                           ) -> dict[str, list[list[float]]]:
    """:func:`collective_times` of all-reduce, reduce-scatter and all-gather on
    ``group`` (``g`` ranks), every group of the world timing its own at once."""
    device = torch.device("cuda", torch.cuda.current_device()) \
        if dist.get_backend() == "nccl" else torch.device("cpu")
    out: dict[str, list[list[float]]] = {op: [] for op in COLLECTIVES if op != "p2p"}
    for size in sizes:
        numel = -(-size // (4 * g)) * g
        whole = torch.zeros(numel, device=device)
        shard = torch.zeros(numel // g, device=device)
        calls: dict[str, Callable[[], object]] = {
            "all_reduce": functools.partial(dist.all_reduce, whole, group=group),
            "reduce_scatter": functools.partial(_REDUCE_SCATTER, shard, whole, group=group),
            "all_gather": functools.partial(_ALL_GATHER, whole, shard, group=group)}
        batch = max(1, min(8, 2**20 // size))
        for op, call in calls.items():
            out[op].append(_timed_calls(call, device, effort, batch))
    return out


def _ping_pong(buf: torch.Tensor, rank: int) -> None:
    if rank == 0:
        dist.send(buf, 1)
        dist.recv(buf, 1)
    elif rank == 1:
        dist.recv(buf, 0)
        dist.send(buf, 0)


def _timed_calls(call: Callable[[], object], device: torch.device, effort: Effort,
                 batch: int) -> list[float]:
    """Seconds per call, after a barrier per ``batch`` calls back to back (so that one
    rank's late start weighs little). On a GPU each figure is the mean of a batch (one
    device synchronisation per batch); on a CPU every call is its own figure, since a
    collective there meets the scheduler: most calls are quick and some wait for a
    core (the calibration fits the mean call, ``calibrate.call_center``, and keeps every
    call in its notes).
    Every rank makes the same calls: no deadline here, the ranks must agree."""
    for _ in range(effort.warmup):
        call()
    times = []
    for _ in range(effort.repeats):
        dist.barrier()
        _sync(device)
        if device.type == "cpu":
            for _ in range(batch):
                start = time.perf_counter()
                call()
                times.append(time.perf_counter() - start)
            continue
        start = time.perf_counter()
        for _ in range(batch):
            call()
        _sync(device)
        times.append((time.perf_counter() - start) / batch)
    return times
