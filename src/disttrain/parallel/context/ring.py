"""Ring attention: causal attention over a sequence split across a cp group.

Each of the N ranks holds 2c positions, chunks i and 2N-1-i of the sequence
(:mod:`.sequence`). Keys and values travel around the ring (rank r sends to r+1 and
receives from r-1) while each rank attends to the block it holds, merging partial
results on the per-row log-sum-exp; the backward walks the ring again. The ring, step by
step, and its memory: ``docs/strategies/context.md``, "The ring".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...comm.collectives import Communicator, TrackedWork
from .kernels import Kernel, block_backward, block_forward, check_kernel, default_kernel

KV_TAG, DKV_TAG = 71, 72  # the keys and values, and their gradients (checked, not matched)


@dataclass(frozen=True)
class _Block:
    """The local query rows and the held block's key rows one ring step computes."""

    rows: slice
    keys: slice
    causal: bool


def _block(rank: int, src: int, c: int) -> _Block:
    """What rank ``rank`` computes against the block of rank ``src``, c x 2c scores in
    each case: its own block causally (the causal half of 2c x 2c); an earlier rank's
    (src < r) with every query row against the block's first half (chunk src),
    unmasked; a later rank's with only the second half of the query rows (chunk
    2N-1-r) against the whole block, unmasked. The masked-out quarter is skipped."""
    if src == rank:
        return _Block(slice(0, 2 * c), slice(0, 2 * c), True)
    if src < rank:
        return _Block(slice(0, 2 * c), slice(0, c), False)
    return _Block(slice(c, 2 * c), slice(0, 2 * c), False)


def _pass_on(comm: Communicator, send: torch.Tensor, recv: torch.Tensor,
             tag: int) -> list[TrackedWork]:
    """Start sending ``send`` to the next rank and receiving ``recv`` from the previous
    one, in an order NCCL can match when they are the same rank (N = 2: even ranks post
    the send first, odd ranks the receive)."""
    nxt, prev = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    if comm.rank % 2 == 0:
        return [comm.isend(send, nxt, tag), comm.irecv(recv, prev, tag)]
    return [comm.irecv(recv, prev, tag), comm.isend(send, nxt, tag)]


def _wait(works: list[TrackedWork]) -> None:
    for w in works:
        w.wait()


def _merge(out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, lse_o: torch.Tensor
           ) -> None:
    """Fold a block's (o, lse_o) into the running (out, lse) (fp32 views, in place):
    the softmax over the union of the two key sets, lse = logaddexp(lse, lse_o),
    out = e^(lse_old - lse) out + e^(lse_o - lse) o."""
    new = torch.logaddexp(lse, lse_o)
    out.mul_(torch.exp(lse - new).unsqueeze(-1))
    out.add_(o.float() * torch.exp(lse_o - new).unsqueeze(-1))
    lse.copy_(new)


def _ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Communicator,
                  scale: float, kernel: Kernel) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, H, 2c, Dh] in q's dtype, lse [B, H, 2c] fp32) of the local queries."""
    c = q.shape[2] // 2
    kv = torch.stack((k, v))  # one message: [2, B, H_kv, 2c, Dh]
    out = lse = torch.empty(0)
    for step in range(comm.size):
        src = (comm.rank - step) % comm.size
        incoming, works = kv, []
        if step + 1 < comm.size:
            incoming = torch.empty_like(kv)
            works = _pass_on(comm, kv, incoming, KV_TAG)
        blk = _block(comm.rank, src, c)
        o, lse_o = block_forward(q[:, :, blk.rows], kv[0][:, :, blk.keys],
                                 kv[1][:, :, blk.keys], blk.causal, scale, kernel)
        if step == 0:
            out, lse = o.float(), lse_o.float().contiguous()
        else:
            _merge(out[:, :, blk.rows], lse[:, :, blk.rows], o, lse_o)
        _wait(works)
        kv = incoming
    return out.to(q.dtype), lse


def _ring_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, comm: Communicator,
                   scale: float, kernel: Kernel
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of the local q, k, v: each block's share recomputed from the saved
    lse and output (never the full attention); dq stays local, dk and dv accumulate in
    fp32 in a buffer that travels one step behind its block and reaches its owner after
    the last step."""
    c = q.shape[2] // 2
    dout = dout.contiguous()
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = torch.stack((k, v))
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
    dkv_works: list[TrackedWork] = []
    for step in range(comm.size):
        src = (comm.rank - step) % comm.size
        incoming, kv_works = kv, []
        if step + 1 < comm.size:
            incoming = torch.empty_like(kv)
            kv_works = _pass_on(comm, kv, incoming, KV_TAG)
        blk = _block(comm.rank, src, c)
        r, keys = blk.rows, blk.keys
        gq, gk, gv = block_backward(dout[:, :, r], q[:, :, r], kv[0][:, :, keys],
                                    kv[1][:, :, keys], out[:, :, r],
                                    lse[:, :, r].contiguous(), blk.causal, scale, kernel)
        dq[:, :, r] += gq
        _wait(dkv_works)  # the held block's gradient so far, from the previous rank
        dkv[0][:, :, keys] += gk
        dkv[1][:, :, keys] += gv
        if comm.size > 1:  # on, one step behind the block: after the last, its owner
            arriving = torch.empty_like(dkv)
            dkv_works = _pass_on(comm, dkv, arriving, DKV_TAG)
            dkv = arriving
        _wait(kv_works)
        kv = incoming
    _wait(dkv_works)
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class RingKVFwdRingDKVBwd(torch.autograd.Function):
    """Causal attention of the local queries over the whole sequence. Forward: keys and
    values passed around the ring, each block's partial output merged on its lse.
    Backward: keys and values passed around again, their gradients carried along one
    step behind back to their owner, dq local.

    q: [B, H, 2c, Dh]; k, v: [B, H_kv, 2c, Dh]; all split over the cp group as
    :mod:`.sequence` lays out (chunks r and 2N-1-r). Output [B, H, 2c, Dh], same split.
    """

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                comm: Communicator, scale: float, kernel: Kernel) -> torch.Tensor:
        # in q's dtype as given: autocast would round the maths kernel's fp32 scores
        with torch.autocast(q.device.type, enabled=False):
            out, lse = _ring_forward(q, k, v, comm, scale, kernel)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.scale, ctx.kernel = comm, scale, kernel
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        with torch.autocast(q.device.type, enabled=False):
            dq, dk, dv = _ring_backward(dout, q, k, v, out, lse, ctx.comm, ctx.scale,
                                        ctx.kernel)
        return dq, dk, dv, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Communicator,
                   *, scale: float | None = None, dropout_p: float = 0.0,
                   kernel: str | None = None) -> torch.Tensor:
    """Causal scaled-dot-product attention over a sequence split across ``comm`` (the
    cp group): q [B, H, 2c, Dh], k, v [B, H_kv, 2c, Dh] (H_kv divides H) hold this
    rank's chunks r and 2N-1-r (:func:`.sequence.split_sequence` of dim 2) -> the
    output for those queries, [B, H, 2c, Dh]. ``scale`` defaults to Dh^-1/2;
    ``kernel``: ``"fused"`` (CPU) or ``"math"`` (:mod:`.kernels`; default: the
    device's). Attention dropout is refused: the ring does not reproduce it."""
    if dropout_p:
        raise ValueError(f"ring attention got dropout_p={dropout_p}: attention dropout "
                         "is not supported under context parallelism; set the model's "
                         "attention dropout to 0")
    _check_shapes(q, k, v)
    chosen = check_kernel(kernel or default_kernel(q.device), q.device)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    out: torch.Tensor = RingKVFwdRingDKVBwd.apply(q, k, v, comm, float(scale), chosen)
    return out


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(f"ring attention takes q [B, H, T, Dh] and k, v [B, H_kv, T, Dh]; "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    b, h, t, d = q.shape
    if k.shape[0] != b or k.shape[2] != t or k.shape[3] != d or h % k.shape[1]:
        raise ValueError(f"ring attention: k, v {tuple(k.shape)} do not fit q "
                         f"{tuple(q.shape)}: same batch, positions and head size, and "
                         "a number of key heads that divides the query heads")
    if t % 2:
        raise ValueError(f"ring attention: {t} local positions cannot be this rank's two "
                         "chunks; split the sequence with parallel.context.split_sequence")
