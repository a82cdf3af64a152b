"""Gradient compression codecs: sum a flat tensor over a group while sending less.

A codec stands in for the all-reduce of a flat fp32 tensor (a gradient bucket, or a
sync mode's pseudo-gradient): same result contract, the SUM over ranks (of each rank's
decoded contribution), fewer bytes, and every collective through the Communicator so
the ledger counts the compressed payload. Each codec's payload, bias and when to use
it: ``docs/strategies/compression.md``.
"""

from __future__ import annotations

import math
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ..config.schema import CommConfig
from ..names import (
    BIASED_CODECS,
    CODEC_BF16,
    CODEC_FP16,
    CODEC_NONE,
    CODEC_ONEBIT,
    CODEC_POWERSGD,
    CODEC_QSGD,
    CODEC_RANDOMK,
    CODEC_TOPK,
    CODECS,
)
from .collectives import Communicator, TrackedWork

# the wire dtype of each cast codec (ZeRO's reduce-scatter takes it too)
CAST_DTYPES = {CODEC_FP16: torch.float16, CODEC_BF16: torch.bfloat16}
Shape = Sequence[int]
_Matrix = tuple[int, int, int, int]  # (offset, rows, cols, r) of a compressed matrix
_Span = tuple[int, int]  # (offset, size) of an uncompressed segment


class PendingReduction:
    """A codec reduction in flight: ``wait()`` waits for ``work`` (the first collective),
    then runs ``finish`` (decode, any further collective, write the sum into place)."""

    def __init__(self, work: TrackedWork | None, finish: Callable[[], object]) -> None:
        self.work, self.finish = work, finish

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
        self.finish()
        self.finish = lambda: None  # waiting twice is harmless


class GradientCodec(ABC):
    """Base class: per-key state, seeding, fp32 staging and error feedback.

    :meth:`start` encodes this rank's ``flat`` [n] and issues the first collective
    asynchronously; the handle's ``wait()`` leaves, in place in ``flat``, the sum over
    ranks of each rank's decoded contribution (averaging is the caller's). ``segments``:
    the shapes of the tensors laid end to end in ``flat`` (one segment without them);
    onebit and qsgd keep one scale / norm per segment, powersgd factorises each segment
    of dim >= 2 as [shape[0], prod(shape[1:])] and sends the others uncompressed.
    State is kept per ``key`` (the bucket): the error-feedback residual (biased codecs:
    what was not sent is added to the next input), PowerSGD's warm-start Q and a call
    counter that, with the seed, makes every random draw repeat exactly."""

    name = "abstract"

    def __init__(self, *, seed: int = 0, error_feedback: bool = False) -> None:
        self.seed = seed
        self.error_feedback = error_feedback and self.biased
        self.residuals: dict[Hashable, torch.Tensor] = {}
        self._calls: dict[Hashable, int] = {}

    @property
    def biased(self) -> bool:
        """Whether the decoded sum is off in expectation (error feedback applies)."""
        return self.name in BIASED_CODECS

    def start(self, flat: torch.Tensor, comm: Communicator, *, key: Hashable = 0,
              segments: Sequence[Shape] | None = None) -> PendingReduction:
        """Encode ``flat`` [n] and launch the reduction; ``wait()`` on the result leaves
        the sum over ranks in ``flat``. ``flat`` is modified (error feedback is added in
        place) and must not be touched until then."""
        if flat.dim() != 1 or not flat.is_floating_point():
            raise ValueError(f"codec {self.name} needs a 1-D floating tensor, got "
                             f"{flat.dtype} {tuple(flat.shape)}")
        shapes = _check_segments(flat.numel(), segments)
        step = self._calls.get(key, 0)
        self._calls[key] = step + 1
        x = flat if flat.dtype == torch.float32 else flat.float()
        if self.error_feedback and key in self.residuals:
            x.add_(self.residuals[key])
        pending = self._start(x, comm, key, step, shapes)
        if x is flat:
            return pending

        def finish() -> None:
            pending.wait()
            flat.copy_(x)
        return PendingReduction(None, finish)

    def all_reduce(self, flat: torch.Tensor, comm: Communicator, *, key: Hashable = 0,
                   segments: Sequence[Shape] | None = None) -> torch.Tensor:
        """Blocking form of :meth:`start`; returns ``flat`` holding the sum."""
        self.start(flat, comm, key=key, segments=segments).wait()
        return flat

    @abstractmethod
    def _start(self, x: torch.Tensor, comm: Communicator, key: Hashable, step: int,
               shapes: list[tuple[int, ...]]) -> PendingReduction:
        """Launch the reduction of ``x`` (error feedback already added); each codec's
        own wire format."""

    def drop_nonfinite_state(self) -> None:
        """Zero the nan / inf entries of the kept state (after a step whose gradients
        were not finite was skipped: the rest of the residual is still owed). Called
        after every step, on the device: on a finite state it changes nothing."""
        for residual in self.residuals.values():
            residual.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)

    def _keep_residual(self, key: Hashable, residual: torch.Tensor) -> None:
        if self.error_feedback:
            self.residuals[key] = residual

    def _generator(self, device: torch.device, *salt: Hashable) -> torch.Generator:
        """A generator seeded from (seed, salt...) only: the same draws on every run."""
        value = self.seed
        for s in salt:
            part = s if isinstance(s, int) else zlib.crc32(repr(s).encode())
            value = (value * 0x9E3779B97F4A7C15 + part + 0x632BE59BD9B4E019) % 2**61
        return torch.Generator(device=device).manual_seed(value)


def _check_segments(n: int, segments: Sequence[Shape] | None) -> list[tuple[int, ...]]:
    if not segments:
        return [(n,)]
    shapes = [tuple(int(d) for d in s) for s in segments]
    total = sum(math.prod(s) for s in shapes)
    if total != n:
        raise ValueError(f"segments cover {total} elements, the tensor has {n}")
    return shapes


def _sizes(shapes: list[tuple[int, ...]]) -> list[int]:
    return [math.prod(s) for s in shapes]


def _blocks(sizes: list[int], block: int) -> list[int]:
    """Each segment size split into blocks of at most ``block`` elements."""
    return [min(block, size - i) for size in sizes for i in range(0, size, block)]


def _block_sums(values: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """[n] -> [B]: the sum of each consecutive block of ``sizes`` (one pass)."""
    counts = torch.tensor(sizes, device=values.device)
    ids = torch.repeat_interleave(torch.arange(len(sizes), device=values.device), counts)
    return values.new_zeros(len(sizes)).index_add_(0, ids, values)


def _count(n: int, ratio: float) -> int:
    """Elements a sparsifying codec keeps: ceil(ratio * n), at least 1, at most n."""
    return max(1, min(n, math.ceil(ratio * n)))


def _pad_to_words(t: torch.Tensor) -> torch.Tensor:
    """A uint8 tensor padded with zeros to a multiple of 4 bytes, so every rank's block
    in a gathered buffer starts fp32-aligned."""
    return F.pad(t, (0, -t.numel() % 4))


def _per_element(values: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """[..., S] per-segment values -> [..., n], each repeated over its segment."""
    counts = torch.tensor(sizes, device=values.device)
    return torch.repeat_interleave(values, counts, dim=-1)


class CastCodec(GradientCodec):
    """fp16 / bf16: cast, all-reduce in the low precision, cast back."""

    def __init__(self, dtype: torch.dtype, **kw: Any) -> None:
        super().__init__(**kw)
        self.dtype = dtype
        self.name = next(name for name, d in CAST_DTYPES.items() if d == dtype)

    def _start(self, x: torch.Tensor, comm: Communicator, key: Hashable, step: int,
               shapes: list[tuple[int, ...]]) -> PendingReduction:
        wire = x.to(self.dtype)
        return PendingReduction(comm.all_reduce(wire, async_op=True), lambda: x.copy_(wire))


class RandomKCodec(GradientCodec):
    """Random-k: the same k = ceil(ratio * n) indices on every rank (drawn from the seed,
    the key and the call count, so never sent), values scaled by n / k so the expected
    result is the exact sum; the k values are all-reduced."""

    name = CODEC_RANDOMK

    def __init__(self, *, ratio: float = 0.01, **kw: Any) -> None:
        super().__init__(**kw)
        self.ratio = ratio

    def _start(self, x: torch.Tensor, comm: Communicator, key: Hashable, step: int,
               shapes: list[tuple[int, ...]]) -> PendingReduction:
        n = x.numel()
        k = _count(n, self.ratio)
        gen = self._generator(x.device, key, step)
        idx = torch.randperm(n, generator=gen, device=x.device)[:k]
        values = x[idx].mul_(n / k)

        def finish() -> None:
            x.zero_()
            x[idx] = values
        return PendingReduction(comm.all_reduce(values, async_op=True), finish)


class TopKCodec(GradientCodec):
    """Top-k: each rank sends its k largest-magnitude entries as one int32 payload
    [k fp32 values bit-cast | k indices], all-gathered; every rank scatter-adds all of
    them into a dense result (entries chosen by several ranks are summed)."""

    name = CODEC_TOPK

    def __init__(self, *, ratio: float = 0.01, **kw: Any) -> None:
        super().__init__(**kw)
        self.ratio = ratio

    def _start(self, x: torch.Tensor, comm: Communicator, key: Hashable, step: int,
               shapes: list[tuple[int, ...]]) -> PendingReduction:
        k = _count(x.numel(), self.ratio)
        idx = x.abs().topk(k, sorted=False).indices
        values = x[idx]
        if self.error_feedback:
            residual = x.clone()
            residual[idx] = 0
            self._keep_residual(key, residual)
        payload = torch.cat([values.view(torch.int32), idx.to(torch.int32)])
        gathered = payload.new_empty(comm.size * 2 * k)
        work = comm.all_gather_into(gathered, payload, async_op=True)

        def finish() -> None:
            blocks = gathered.view(comm.size, 2, k)
            x.zero_()
            x.index_add_(0, blocks[:, 1].reshape(-1).long(),
                         blocks[:, 0].reshape(-1).view(torch.float32))
        return PendingReduction(work, finish)


_SHIFTS = torch.arange(8, dtype=torch.uint8)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """Bit i of byte j is 1 where ``x[8j + i] >= 0``: [n] -> uint8 [ceil(n / 8)]."""
    bits = F.pad((x >= 0).to(torch.uint8), (0, -x.numel() % 8)).view(-1, 8)
    return (bits << _SHIFTS.to(x.device)).sum(1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor, n: int) -> torch.Tensor:
    """uint8 [..., ceil(n / 8)] -> float32 [..., n] of +1 / -1."""
    bits = (packed.unsqueeze(-1) >> _SHIFTS.to(packed.device)) & 1
    bits = bits.flatten(-2)[..., :n]
    return bits.to(torch.float32).mul_(2).sub_(1)


class OneBitCodec(GradientCodec):
    """Sign compression: each block becomes scale * sign(x) with scale = mean |x|
    (sign of 0 is +); a block is a whole segment, or with ``block`` > 0 at most that
    many consecutive elements of one. Payload, uint8: [B fp32 scales | packed sign
    bits], padded to a multiple of 4 bytes; all-gathered and summed. Biased: use error
    feedback."""

    name = CODEC_ONEBIT

    def __init__(self, *, block: int = 0, **kw: Any) -> None:
        super().__init__(**kw)
        self.block = block

    def _start(self, x: torch.Tensor, comm: Communicator, key: Hashable, step: int,
               shapes: list[tuple[int, ...]]) -> PendingReduction:
        n, sizes = x.numel(), _sizes(shapes)
        if self.block:
            sizes = _blocks(sizes, self.block)
        scales = _block_sums(x.abs(), sizes) / torch.tensor(sizes, device=x.device)
        payload = _pad_to_words(torch.cat([scales.view(torch.uint8), pack_signs(x)]))
        if self.error_feedback:
            self._keep_residual(key, x - self._decode(payload.unsqueeze(0), n, sizes)[0])
        gathered = payload.new_empty(comm.size * payload.numel())
        work = comm.all_gather_into(gathered, payload, async_op=True)

        def finish() -> None:
            blocks = gathered.view(comm.size, -1)
            torch.sum(self._decode(blocks, n, sizes), dim=0, out=x)
        return PendingReduction(work, finish)

    @staticmethod
    def _decode(blocks: torch.Tensor, n: int, sizes: list[int]) -> torch.Tensor:
        """uint8 [ranks, L] -> float32 [ranks, n]."""
        s = len(sizes)
        scales = blocks[:, :4 * s].contiguous().view(torch.float32)
        signs = unpack_signs(blocks[:, 4 * s:4 * s + math.ceil(n / 8)], n)
        return signs.mul_(_per_element(scales, sizes))


class QSGDCodec(GradientCodec):
    """QSGD with s levels: each block of at most ``block`` elements of a segment is
    scaled by its L2 norm and |x| / norm * s is rounded up or down at random (probability
    = the fractional part), so E[decoded] = x. Payload, uint8: [B fp32 norms (one per
    block) | n int8 signed levels], padded to 4 bytes; all-gathered and summed. Each
    rank draws its own rounding noise (seed, key, call count, rank)."""

    name = CODEC_QSGD

    def __init__(self, *, levels: int = 16, block: int = 512, **kw: Any) -> None:
        super().__init__(**kw)
        if not 1 <= levels <= 127:
            raise ValueError(f"qsgd levels must be in 1..127 (int8), got {levels}")
        self.levels, self.block = levels, block

    def _start(self, x: torch.Tensor, comm: Communicator, key: Hashable, step: int,
               shapes: list[tuple[int, ...]]) -> PendingReduction:
        n, s = x.numel(), self.levels
        sizes = _blocks(_sizes(shapes), self.block)
        norms = _block_sums(x * x, sizes).sqrt_()
        denom = _per_element(norms, sizes)
        scaled = torch.where(denom > 0, x.abs() / denom.clamp(min=1e-30) * s, 0.0)
        noise = torch.rand(n, generator=self._generator(x.device, key, step, comm.rank),
                           device=x.device)
        level = torch.floor(scaled + noise).clamp_(max=s).mul_(torch.sign(x))
        payload = _pad_to_words(torch.cat([norms.view(torch.uint8),
                                           level.to(torch.int8).view(torch.uint8)]))
        gathered = payload.new_empty(comm.size * payload.numel())
        work = comm.all_gather_into(gathered, payload, async_op=True)

        def finish() -> None:
            blocks = gathered.view(comm.size, -1)
            k = len(sizes)
            got_norms = blocks[:, :4 * k].contiguous().view(torch.float32)
            levels = blocks[:, 4 * k:4 * k + n].view(torch.int8).to(torch.float32)
            decoded = levels.mul_(_per_element(got_norms, sizes)).div_(s)
            torch.sum(decoded, dim=0, out=x)
        return PendingReduction(work, finish)


class PowerSGDCodec(GradientCodec):
    """PowerSGD, one power iteration per step on each matrix segment M [rows, cols]:
    P = M Q, all-reduce P (with the uncompressed segments), orthonormalise P, Q = M^T P,
    all-reduce Q; the result P Q^T is the sum of the ranks' M projected on P's span
    (exact when that sum has rank <= r). Q starts random from the seed (the same on all
    ranks) and, with warm start, is reused from the previous call; without, it is
    redrawn each call. Matrices too small to gain (r (rows + cols) >= rows cols) travel
    uncompressed.

    ``batched``: the whole of ``flat`` (every segment, vectors too) is laid, zero-padded,
    into one near-square matrix [ceil(sqrt n), ceil(n / rows)] and factorised at rank r:
    about sqrt(n) / (2 r) times fewer bytes, far more than per matrix when the matrices
    are narrow, at the price of mixing unrelated rows (a coarser approximation, the
    difference carried by error feedback)."""

    name = CODEC_POWERSGD

    def __init__(self, *, rank: int = 4, warm_start: bool = True, batched: bool = False,
                 **kw: Any) -> None:
        super().__init__(**kw)
        self.rank, self.warm_start, self.batched = rank, warm_start, batched
        self.q: dict[tuple[Hashable, int], torch.Tensor] = {}

    def _layout(self, shapes: list[tuple[int, ...]]) -> tuple[list[_Matrix], list[_Span]]:
        """(offset, rows, cols, r) per compressed matrix, (offset, size) per other."""
        mats: list[_Matrix] = []
        rest: list[_Span] = []
        offset = 0
        for shape in shapes:
            size = math.prod(shape)
            rows, cols = (shape[0], size // max(shape[0], 1)) if len(shape) >= 2 else (0, 0)
            r = min(self.rank, rows, cols)
            if len(shape) >= 2 and r * (rows + cols) < size:
                mats.append((offset, rows, cols, r))
            else:
                rest.append((offset, size))
            offset += size
        return mats, rest

    def drop_nonfinite_state(self) -> None:
        """Also forget a warm-start Q that a non-finite gradient reached: it becomes the
        draw from the seed it started from (chosen on the device, no host read)."""
        super().drop_nonfinite_state()
        for (key, j), q in self.q.items():
            fresh = torch.randn(q.shape, generator=self._generator(q.device, key, j),
                                device=q.device, dtype=q.dtype)
            q.copy_(torch.where(torch.isfinite(q).all(), q, fresh))

    def _q(self, key: Hashable, j: int, step: int, cols: int, r: int,
           device: torch.device) -> torch.Tensor:
        stored = self.q.get((key, j))
        if self.warm_start and stored is not None:
            return stored
        salt = (key, j) if self.warm_start else (key, j, step)
        return torch.randn(cols, r, generator=self._generator(device, *salt), device=device)

    def _start(self, x: torch.Tensor, comm: Communicator, key: Hashable, step: int,
               shapes: list[tuple[int, ...]]) -> PendingReduction:
        if self.batched:
            n = x.numel()
            rows = math.isqrt(n - 1) + 1 if n > 1 else 1
            cols = -(-n // rows)
            square = F.pad(x, (0, rows * cols - n))
            pending = self._start_matrices(square, comm, key, step, [(rows, cols)], n)

            def finish() -> None:
                pending.finish()
                x.copy_(square[:n])
            return PendingReduction(pending.work, finish)
        return self._start_matrices(x, comm, key, step, shapes, x.numel())

    def _start_matrices(self, x: torch.Tensor, comm: Communicator, key: Hashable,
                        step: int, shapes: list[tuple[int, ...]],
                        n: int) -> PendingReduction:
        """The protocol on ``x`` laid out as ``shapes``; the error-feedback residual kept
        is its first ``n`` elements (the rest is batched mode's zero padding)."""
        mats, rest = self._layout(shapes)
        ms = [x[o:o + a * b].view(a, b) for o, a, b, _ in mats]
        qs = [self._q(key, j, step, b, r, x.device) for j, (_, _, b, r) in enumerate(mats)]
        ps = [m @ q for m, q in zip(ms, qs, strict=True)]
        first = torch.cat([p.reshape(-1) for p in ps] + [x[o:o + n] for o, n in rest]
                          + [x.new_empty(0)])
        work = comm.all_reduce(first, async_op=True)
        return PendingReduction(work, lambda: self._finish(x, comm, key, mats, rest, ms,
                                                           first, n))

    def _finish(self, x: torch.Tensor, comm: Communicator, key: Hashable,
                mats: list[_Matrix], rest: list[_Span], ms: list[torch.Tensor],
                first: torch.Tensor, n: int) -> None:
        p_sizes = [a * r for _, a, _, r in mats]
        pieces = first.split(p_sizes + [first.numel() - sum(p_sizes)])
        # pieces has one more entry than mats (the uncompressed rest), left out here
        ps = [torch.linalg.qr(p.view(a, r)).Q
              for p, (_, a, _, r) in zip(pieces, mats, strict=False)]
        local_qs = [m.T @ p for m, p in zip(ms, ps, strict=True)]
        if self.error_feedback:
            residual = torch.zeros_like(x)
            for (o, a, b, _), m, p, q in zip(mats, ms, ps, local_qs, strict=True):
                residual[o:o + a * b] = (m - p @ q.T).reshape(-1)
            self._keep_residual(key, residual[:n])
        second = torch.cat([q.reshape(-1) for q in local_qs] + [x.new_empty(0)])
        comm.all_reduce(second)
        q_sizes = [b * r for _, _, b, r in mats]
        q_pieces = second.split(q_sizes)
        for j, ((o, a, b, r), p, q) in enumerate(zip(mats, ps, q_pieces, strict=True)):
            q = q.view(b, r)
            x[o:o + a * b] = (p @ q.T).reshape(-1)
            if self.warm_start:
                self.q[(key, j)] = q.clone()
        start = 0
        for o, size in rest:
            x[o:o + size] = pieces[-1][start:start + size]
            start += size


def build_codec(config: CommConfig, seed: int = 0) -> GradientCodec | None:
    """The codec ``[comm]`` selects, or None for ``codec = "none"`` (the plain
    all-reduce, which callers run themselves)."""
    name, ef = config.codec, config.error_feedback
    if name == CODEC_NONE:
        return None
    if name in CAST_DTYPES:
        return CastCodec(CAST_DTYPES[name], seed=seed)
    if name == CODEC_TOPK:
        return TopKCodec(ratio=config.topk_ratio, seed=seed, error_feedback=ef)
    if name == CODEC_RANDOMK:
        return RandomKCodec(ratio=config.randomk_ratio, seed=seed)
    if name == CODEC_POWERSGD:
        return PowerSGDCodec(rank=config.powersgd_rank, warm_start=config.powersgd_warm_start,
                             batched=config.powersgd_batched, seed=seed, error_feedback=ef)
    if name == CODEC_ONEBIT:
        return OneBitCodec(block=config.onebit_block, seed=seed, error_feedback=ef)
    if name == CODEC_QSGD:
        return QSGDCodec(levels=config.qsgd_levels, seed=seed)
    raise ValueError(f"unknown codec {name!r}; one of {', '.join(CODECS)}")


def reduce_flat(flat: torch.Tensor, comm: Communicator, codec: GradientCodec | None,
                *, key: Hashable = 0) -> torch.Tensor:
    """Sum ``flat`` over ``comm``'s group in place, through ``codec`` when given (for
    callers outside the bucket reducer, e.g. a pseudo-gradient)."""
    if codec is None:
        comm.all_reduce(flat)
        return flat
    return codec.all_reduce(flat, comm, key=key)
