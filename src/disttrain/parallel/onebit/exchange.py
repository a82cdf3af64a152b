"""1-bit Adam's momentum exchange: an average over the dp group in sign bits, with
error feedback on both sides (Tang et al., 2021, "1-bit Adam").

Each tensor ``x`` [n] of a rank is cut into ``size`` runs (by default of ceil(n / size)
rounded up to a multiple of 8 elements; a ZeRO flat buffer's are its shards), each
padded to a chunk of a multiple of 8 elements: chunk j goes to rank j, its *server*.
One round, per tensor:

1. worker: ``y = x + e_w``; each chunk becomes ``s_j * sign(y_j)`` with ``s_j`` = mean
   |y_j| over its real elements (sign of 0 is +); ``e_w = y - decoded`` (all-to-all of
   [scales | packed signs] per destination);
2. server r: ``a = mean over ranks of the decoded chunks r + e_s``; compressed again,
   ``t * sign(a)`` with ``t`` = mean |a|; ``e_s = a - decoded`` (all-gather);
3. every rank decodes every server's chunk: the same average on every rank.

Tensors travel in *buckets* (:class:`BucketLayout`): a bucket's tensors sit side by
side in one [size, C] matrix (row j: each tensor's chunk j, C the sum of their chunks),
so every step of a round is a few operations over the whole bucket, not a dozen per
tensor, and one all-to-all and one all-gather carry the bucket. Row j of what a rank
sends is [the bucket's P fp32 scales for rank j | the packed signs of row j]: byte for
byte what one round over the same tensors, each packed on its own, sends.

Scales are per tensor and chunk, never shared between tensors, so a tensor's result
depends on that tensor alone (a tied weight held by two pipeline stages gets the same
result on both), whichever bucket it travels in. Wire bytes per rank and round for N
ranks and n elements: the all-to-all sends (N-1)/N (n/8 + 4N) and the all-gather (N-1)
(n/8N + 4): about n/4 x (N-1)/N, against 8n (N-1)/N for a ring all-reduce in fp32:
~32x less.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...comm.collectives import Communicator, TrackedWork, wire_bytes

_SHIFTS = torch.arange(8, dtype=torch.uint8)


@dataclass(frozen=True)
class _Layout:
    """One tensor of ``numel`` elements cut into ``parts`` runs of ``stride`` (run j,
    elements [j*stride, (j+1)*stride), goes to rank j), each run padded to ``chunk``, a
    multiple of 8 (for the sign bits)."""

    numel: int
    parts: int
    stride: int

    @classmethod
    def of(cls, numel: int, parts: int, stride: int | None = None) -> _Layout:
        """Even runs of a multiple of 8 (the default), or runs of a given ``stride`` (a
        ZeRO flat buffer's shards)."""
        return cls(numel, parts, stride if stride is not None
                   else 8 * math.ceil(numel / (8 * parts)))

    @property
    def chunk(self) -> int:
        return 8 * math.ceil(self.stride / 8)

    def real(self, j: int) -> int:
        """Real (unpadded) elements in run j."""
        return max(0, min(self.stride, self.numel - j * self.stride))


class BucketLayout:
    """Tensors of ``numels`` elements (``strides``: each one's run length, None for
    even runs) side by side: run j of every tensor, padded to its chunk, in row j of a
    [parts, columns] matrix, tensor i from column ``offsets[i]``. ``starts[i]``: where
    tensor i begins in the bucket's flat concatenation [numel]."""

    def __init__(self, numels: list[int], parts: int, rank: int,
                 strides: list[int | None] | None = None) -> None:
        self.parts, self.rank = parts, rank
        self.layouts = [_Layout.of(n, parts, None if strides is None else strides[i])
                        for i, n in enumerate(numels)]
        self.starts, self.offsets = [], []
        start = column = 0
        for lay in self.layouts:
            self.starts.append(start)
            self.offsets.append(column)
            start, column = start + lay.numel, column + lay.chunk
        self.numel, self.columns = start, column
        self.chunks = torch.tensor([lay.chunk for lay in self.layouts], dtype=torch.long)
        real = torch.tensor([[lay.real(j) for lay in self.layouts] for j in range(parts)],
                            dtype=torch.float32)
        self.real = real.clamp(min=1)  # [parts, P]: what each chunk's scale divides by
        # the padding of row ``rank`` (what this rank serves), as column ranges
        self.padding = [(o + lay.real(rank), o + lay.chunk)
                        for o, lay in zip(self.offsets, self.layouts, strict=True)
                        if lay.real(rank) < lay.chunk]

    def __len__(self) -> int:
        return len(self.layouts)

    def served(self, i: int) -> tuple[int, int]:
        """[start, stop) of tensor i's elements this rank serves."""
        lay = self.layouts[i]
        start = min(lay.numel, self.rank * lay.stride)
        return start, start + lay.real(self.rank)

    def rows(self, flat: torch.Tensor) -> torch.Tensor:
        """The bucket's flat concatenation [numel] as [parts, columns], zero on the
        padding."""
        out = flat.new_zeros(self.parts, self.columns)
        for lay, start, col in zip(self.layouts, self.starts, self.offsets, strict=True):
            if lay.numel == 0:
                continue
            whole = lay.numel // lay.stride  # runs with no padding of their own
            out[:whole, col:col + lay.stride] = \
                flat[start:start + whole * lay.stride].view(whole, lay.stride)
            tail = lay.numel - whole * lay.stride
            if tail:
                out[whole, col:col + tail] = flat[start + whole * lay.stride:start + lay.numel]
        return out

    def flat_into(self, rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`rows`, written into ``out`` [numel]."""
        for lay, start, col in zip(self.layouts, self.starts, self.offsets, strict=True):
            if lay.numel == 0:
                continue
            whole = lay.numel // lay.stride
            out[start:start + whole * lay.stride].view(whole, lay.stride).copy_(
                rows[:whole, col:col + lay.stride])
            tail = lay.numel - whole * lay.stride
            if tail:
                out[start + whole * lay.stride:start + lay.numel].copy_(
                    rows[whole, col:col + tail])
        return out

    def chunk_sums(self, a: torch.Tensor) -> torch.Tensor:
        """Sums of ``a`` [..., columns] over each tensor's chunk: [..., P]."""
        return torch.stack([a[..., o:o + lay.chunk].sum(-1)
                            for o, lay in zip(self.offsets, self.layouts, strict=True)], -1)

    def spread(self, per_tensor: torch.Tensor) -> torch.Tensor:
        """[..., P] -> [..., columns]: each tensor's value over its chunk's columns."""
        return per_tensor.repeat_interleave(self.chunks.to(per_tensor.device), dim=-1)


def _pack(nonneg: torch.Tensor) -> torch.Tensor:
    """bool [k, c] (c a multiple of 8) -> uint8 [k, c / 8]: bit i of byte j is 1 where
    element 8j + i is True (the layout of :func:`disttrain.comm.codecs.pack_signs`)."""
    bits = nonneg.view(nonneg.shape[0], -1, 8).view(torch.uint8)
    return (bits << _SHIFTS.to(bits.device)).sum(-1, dtype=torch.uint8)


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_pack`: uint8 [k, b] -> bool [k, 8 b]."""
    bits = (packed.unsqueeze(-1) >> _SHIFTS.to(packed.device)) & 1
    return bits.view(torch.bool).reshape(packed.shape[0], -1)


def _signed(nonneg: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``scales`` where ``nonneg``, else ``-scales`` (sign of 0 is +); as +-1 times the
    scale, which is exact, and on a CPU several times faster than ``torch.where``."""
    return nonneg.to(scales.dtype).mul_(2).sub_(1).mul_(scales)


@dataclass
class ExchangeStats:
    """Bytes of the last round: payload handed to the collectives (and the fp32 size of
    the tensors), what this rank sent on the wire, and what a ring all-reduce of the
    fp32 tensors would have sent."""

    payload: int = 0
    dense_payload: int = 0
    wire_sent: int = 0
    dense_wire: int = 0

    def add(self, other: ExchangeStats) -> ExchangeStats:
        return ExchangeStats(*(a + b for a, b in zip(
            (self.payload, self.dense_payload, self.wire_sent, self.dense_wire),
            (other.payload, other.dense_payload, other.wire_sent, other.dense_wire),
            strict=True)))


@dataclass
class PendingBucket:
    """A bucket whose all-to-all is in flight (:meth:`MomentumExchange.start`)."""

    layout: BucketLayout
    recv: torch.Tensor  # [size, 4P + columns / 8] uint8
    work: TrackedWork
    sent: int  # payload bytes of the all-to-all


class MomentumExchange:
    """Averages buckets of tensors over ``comm`` in 1-bit form; the error-feedback state
    is the caller's: per bucket, the worker residual [numel] (flat, as the bucket's
    tensors concatenate) and the server residual [columns] (this rank's row: each
    tensor's chunk, zero on the padding)."""

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self.stats = ExchangeStats()

    def chunk(self, numel: int, stride: int | None = None) -> tuple[int, int]:
        """The [start, stop) of a tensor of ``numel`` elements this rank serves."""
        lay = _Layout.of(numel, self.comm.size, stride)
        start = min(numel, self.comm.rank * lay.stride)
        return start, start + lay.real(self.comm.rank)

    def server_size(self, numel: int) -> int:
        return _Layout.of(numel, self.comm.size).chunk

    def layout(self, numels: list[int], strides: list[int | None] | None = None
               ) -> BucketLayout:
        return BucketLayout(numels, self.comm.size, self.comm.rank, strides)

    @torch.no_grad()
    def start(self, layout: BucketLayout, x: torch.Tensor, worker_error: torch.Tensor
              ) -> PendingBucket:
        """Worker side of a round over one bucket: ``y = x + e_w`` (``x`` [numel] fp32,
        consumed), compressed per tensor and chunk, ``worker_error`` [numel] set to
        what was not sent, and the all-to-all started."""
        y = layout.rows(x.add_(worker_error))
        scales = layout.chunk_sums(y.abs()).div_(layout.real.to(y.device))  # [size, P]
        nonneg = y >= 0
        layout.flat_into(y.sub_(_signed(nonneg, layout.spread(scales))), worker_error)
        send = torch.cat([scales.view(torch.uint8), _pack(nonneg)], dim=1)
        recv = torch.empty_like(send)
        work = self.comm.all_to_all(recv.view(-1), send.view(-1), async_op=True)
        return PendingBucket(layout, recv, work, send.numel())

    @torch.no_grad()
    def finish(self, pending: PendingBucket, server_error: torch.Tensor) -> torch.Tensor:
        """Server side and decoding of a started round: ``server_error`` [columns]
        updated in place; returns the average [numel], the same on every rank."""
        lay, size = pending.layout, self.comm.size
        p = len(lay)
        pending.work.wait()
        got = pending.recv[:, :4 * p].contiguous().view(torch.float32)  # [size, P]
        mine = _signed(_unpack(pending.recv[:, 4 * p:]), lay.spread(got))  # [size, C]
        a = mine.mean(0).add_(server_error)
        for lo, hi in lay.padding:
            a[lo:hi] = 0
        t = lay.chunk_sums(a.abs()).div_(lay.real[lay.rank].to(a.device))  # [P]
        nonneg = a >= 0
        server_error.copy_(a.sub_(_signed(nonneg, lay.spread(t))))
        for lo, hi in lay.padding:
            server_error[lo:hi] = 0
        payload = torch.cat([t.view(torch.uint8), _pack(nonneg.unsqueeze(0))[0]])
        gathered = torch.empty(size * payload.numel(), dtype=torch.uint8, device=a.device)
        self.comm.all_gather_into(gathered, payload)
        rows = gathered.view(size, -1)
        every = rows[:, :4 * p].contiguous().view(torch.float32)  # [size, P]
        decoded = _signed(_unpack(rows[:, 4 * p:]), lay.spread(every))
        out = lay.flat_into(decoded, torch.empty(lay.numel, device=a.device))
        dense = lay.numel * 4
        self.stats = self.stats.add(ExchangeStats(
            payload=pending.sent + payload.numel(), dense_payload=dense,
            wire_sent=(wire_bytes("all_to_all", pending.sent, size)[0]
                       + wire_bytes("all_gather", payload.numel(), size)[0]),
            dense_wire=wire_bytes("all_reduce", dense, size)[0]))
        return out

    def new_round(self) -> None:
        """Start counting a new round's bytes (:attr:`stats`)."""
        self.stats = ExchangeStats()
