"""1-bit Adam's momentum exchange: an average over the dp group in sign bits, with
error feedback on both sides (Tang et al., 2021, "1-bit Adam").

Each tensor ``x`` [n] is cut into ``size`` runs, chunk j going to rank j, its *server*
(:class:`BucketLayout`). One round, per tensor:

1. worker: ``y = x + e_w``; chunk j becomes ``s_j * sign(y_j)``, ``s_j`` = mean |y_j|
   over its real elements (sign of 0 is +); ``e_w = y - decoded`` (all-to-all);
2. server r: ``a = mean over ranks of the decoded chunks r + e_s``, compressed again as
   ``t * sign(a)``, ``t`` = mean |a|; ``e_s = a - decoded`` (all-gather);
3. every rank decodes every server's chunk: the same average on every rank.

Buckets, scales per chunk and the wire bytes: ``docs/strategies/onebit-adam.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
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
    even runs) in one bucket.

    - flat: the tensors concatenated [numel], tensor i from ``starts[i]``;
    - blocks: tensor i's runs, each padded to its chunk, as a block [parts, chunk_i]
      (row j goes to rank j), the blocks concatenated [padded] from ``bases[i]``; a
      tensor whose runs are its chunks has its elements at the head of its block, the
      padding at its tail, so a bucket without padding has the same blocks as flat;
    - the wire: row j of every tensor's block side by side, [parts, columns], tensor i
      from column ``offsets[i]`` (and byte ``offsets[i] / 8`` of its packed signs).
    """

    def __init__(self, numels: list[int], parts: int, rank: int,
                 strides: list[int | None] | None = None) -> None:
        self.parts, self.rank = parts, rank
        self.layouts = [_Layout.of(n, parts, None if strides is None else strides[i])
                        for i, n in enumerate(numels)]
        self.starts, self.bases, self.offsets = [], [], []
        start = base = column = 0
        for lay in self.layouts:
            self.starts.append(start)
            self.bases.append(base)
            self.offsets.append(column)
            start, base, column = start + lay.numel, base + parts * lay.chunk, column + lay.chunk
        self.numel, self.padded, self.columns = start, base, column
        real = torch.tensor([[lay.real(j) for lay in self.layouts] for j in range(parts)],
                            dtype=torch.float32)
        self.real = real.clamp(min=1)  # [parts, P]: what each chunk's scale divides by
        self.unpadded = self.padded == self.numel  # blocks and flat coincide
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

    def block(self, blocks: torch.Tensor, i: int) -> torch.Tensor:
        """Tensor i's block [parts, chunk_i] of ``blocks`` [padded] (a view)."""
        lay = self.layouts[i]
        return blocks[self.bases[i]:self.bases[i] + self.parts * lay.chunk].view(
            self.parts, lay.chunk)

    def blocks(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` [numel] as blocks [padded], zero on the padding (``flat`` itself
        when the bucket has none)."""
        if self.unpadded:
            return flat
        out = flat.new_zeros(self.padded)
        for i, lay in enumerate(self.layouts):
            if lay.numel:
                self._runs(out, i).copy_(self._pieces(flat, i))
                self._tail(out, i, flat)
        return out

    def flat(self, blocks: torch.Tensor) -> torch.Tensor:
        """Blocks [padded] as flat [numel] (``blocks`` itself when the bucket has no
        padding)."""
        if self.unpadded:
            return blocks
        return self.flat_into(blocks, blocks.new_empty(self.numel))

    def flat_into(self, blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`blocks`, written into ``out`` [numel]."""
        if self.unpadded:
            return out.copy_(blocks)
        for i, lay in enumerate(self.layouts):
            if lay.numel:
                self._pieces(out, i).copy_(self._runs(blocks, i))
                self._tail(blocks, i, out, inverse=True)
        return out

    def _whole(self, i: int) -> int:
        lay = self.layouts[i]
        return lay.numel // lay.stride  # runs with no padding of their own

    def _runs(self, blocks: torch.Tensor, i: int) -> torch.Tensor:
        """Tensor i's whole runs inside its block: [whole, stride] (a view)."""
        return self.block(blocks, i)[:self._whole(i), :self.layouts[i].stride]

    def _pieces(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        lay, whole = self.layouts[i], self._whole(i)
        s = self.starts[i]
        return flat[s:s + whole * lay.stride].view(whole, lay.stride)

    def _tail(self, blocks: torch.Tensor, i: int, flat: torch.Tensor,
              inverse: bool = False) -> None:
        """Copy tensor i's last, partial run between ``flat`` and its block."""
        lay, whole = self.layouts[i], self._whole(i)
        tail = lay.numel - whole * lay.stride
        if not tail:
            return
        s = self.starts[i] + whole * lay.stride
        in_block = self.block(blocks, i)[whole, :tail]
        if inverse:
            flat[s:s + tail].copy_(in_block)
        else:
            in_block.copy_(flat[s:s + tail])

    def chunk_sums(self, blocks: torch.Tensor) -> torch.Tensor:
        """Sums over each tensor's chunks of ``blocks`` [padded]: [parts, P]."""
        return torch.stack([self.block(blocks, i).sum(1) for i in range(len(self))], dim=1)

    def signed_blocks(self, bits: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """Each chunk's scale times its signs: ``bits`` [padded] (bool or 0 / 1; 1 is
        +), ``scales`` [parts, P] -> fp32 [padded], ``2 s b - s`` (exactly +-s)."""
        out = torch.empty(self.padded, device=scales.device)
        if bits.dtype == torch.bool:  # the same bytes, on a faster path
            bits = bits.view(torch.uint8)
        for i in range(len(self)):
            s = scales[:, i:i + 1]
            torch.mul(self.block(bits, i), s * 2, out=self.block(out, i)).sub_(s)
        return out

    def to_wire(self, packed: torch.Tensor) -> list[torch.Tensor]:
        """Packed signs of blocks [padded / 8] -> each tensor's [parts, chunk_i / 8]
        (cat them along dim 1 for the wire's rows)."""
        return [packed[b // 8:(b + self.parts * lay.chunk) // 8].view(self.parts,
                                                                       lay.chunk // 8)
                for b, lay in zip(self.bases, self.layouts, strict=True)]

    def from_wire(self, rows: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`to_wire`: the signs part of the wire's rows [parts,
        columns / 8] -> packed blocks [padded / 8]."""
        return torch.cat([rows[:, o // 8:(o + lay.chunk) // 8].reshape(-1)
                          for o, lay in zip(self.offsets, self.layouts, strict=True)])

    def row_sums(self, row: torch.Tensor) -> torch.Tensor:
        """Sums over each tensor's chunk of one wire row ``row`` [columns]: [P]."""
        return torch.stack([row[o:o + lay.chunk].sum()
                            for o, lay in zip(self.offsets, self.layouts, strict=True)])

    def signed_row(self, bits: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """:meth:`signed_blocks` for one wire row: ``bits`` [columns], ``scales`` [P]."""
        out = torch.empty(self.columns, device=scales.device)
        if bits.dtype == torch.bool:
            bits = bits.view(torch.uint8)
        for i, (o, lay) in enumerate(zip(self.offsets, self.layouts, strict=True)):
            s = scales[i]
            torch.mul(bits[o:o + lay.chunk], s * 2, out=out[o:o + lay.chunk]).sub_(s)
        return out


def _pack(nonneg: torch.Tensor) -> torch.Tensor:
    """bool [n] (n a multiple of 8) -> uint8 [n / 8]: bit i of byte j is 1 where element
    8j + i is True (the layout of :func:`disttrain.comm.codecs.pack_signs`). On the CPU
    through numpy's packbits (some 40x faster than shifting and summing)."""
    if nonneg.device.type == "cpu":
        return torch.from_numpy(np.packbits(nonneg.numpy(), bitorder="little"))
    bits = nonneg.view(-1, 8).view(torch.uint8)
    return (bits << _SHIFTS.to(bits.device)).sum(-1, dtype=torch.uint8)


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_pack`: uint8 [b] -> uint8 [8 b] of 0 / 1 (on the CPU
    through numpy's unpackbits)."""
    if packed.device.type == "cpu":
        return torch.from_numpy(np.unpackbits(packed.numpy(), bitorder="little"))
    return ((packed.unsqueeze(-1) >> _SHIFTS.to(packed.device)) & 1).view(-1)


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
        y = layout.blocks(x.add_(worker_error))
        scales = layout.chunk_sums(y.abs()).div_(layout.real.to(y.device))  # [parts, P]
        nonneg = y >= 0
        packed = _pack(nonneg)
        decoded = layout.signed_blocks(nonneg, scales)
        if layout.unpadded:  # y is x: the residual straight into worker_error
            torch.sub(y, decoded, out=worker_error)
        else:
            layout.flat_into(y.sub_(decoded), worker_error)
        send = torch.cat([scales.view(torch.uint8), *layout.to_wire(packed)], dim=1)
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
        mine = lay.signed_blocks(_unpack(lay.from_wire(pending.recv[:, 4 * p:])), got)
        a = torch.cat([lay.block(mine, i).mean(0) for i in range(p)]).add_(server_error)
        for lo, hi in lay.padding:
            a[lo:hi] = 0
        t = lay.row_sums(a.abs()).div_(lay.real[lay.rank].to(a.device))  # [P]
        nonneg = a >= 0
        packed = _pack(nonneg)
        torch.sub(a, lay.signed_row(nonneg, t), out=server_error)
        for lo, hi in lay.padding:
            server_error[lo:hi] = 0
        payload = torch.cat([t.view(torch.uint8), packed])
        gathered = torch.empty(size * payload.numel(), dtype=torch.uint8, device=a.device)
        self.comm.all_gather_into(gathered, payload)
        rows = gathered.view(size, -1)
        every = rows[:, :4 * p].contiguous().view(torch.float32)  # [size, P]
        out = lay.flat(lay.signed_blocks(_unpack(lay.from_wire(rows[:, 4 * p:])), every))
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
