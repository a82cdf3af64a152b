"""Data parallelism: replicas kept identical by a bucketed, overlapped gradient all-reduce.

:func:`apply_data_parallel` leaves the model unchanged (same class, same state-dict
keys) and returns a :class:`DataParallel` handle that owns the gradient hooks:

- parameters and buffers are broadcast from dp rank 0 at start;
- each parameter's ``.grad`` is a view into a flat bucket; a post-accumulate hook marks
  it ready, and a full bucket's all-reduce (SUM) starts at once, overlapping the rest of
  backward;
- :meth:`DataParallel.no_sync` turns the hooks off for accumulation micro-batches;
- :meth:`DataParallel.finish_gradient_sync` waits for the reductions and applies the
  loss normalisation (1 / global number of target tokens), so the update does not depend
  on how the global batch was split into ranks and micro-batches;
- an optional gradient codec (:mod:`disttrain.comm.codecs`) reduces each bucket in a
  compressed form; :meth:`DataParallel.comm_stats` reports the bytes it sent.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from ...comm.buckets import BucketReducer, GradBucket, assign_buckets
from ...comm.codecs import GradientCodec
from ...comm.collectives import Communicator, TrackedWork, wire_bytes
from ...comm.spans import SpanRecorder
from ..clipping import local_grad_norm
from ..interfaces import grad_of


class DataParallel:
    """Gradient synchronisation for one model replica over the dp group; implements
    :class:`~disttrain.parallel.interfaces.GradSync`."""

    def __init__(self, model: nn.Module, comm: Communicator, bucket_bytes: int,
                 tracer: SpanRecorder | None = None,
                 reduce_dtype: torch.dtype = torch.float32,
                 codec: GradientCodec | None = None) -> None:
        self.model = model
        self.comm = comm
        self.grad_replicas = comm.size  # every dp rank holds the same reduced gradients
        params = [p for p in model.parameters() if p.requires_grad]
        # Backward visits layers roughly in reverse registration order.
        self.buckets = assign_buckets(list(reversed(params)), bucket_bytes)
        self.reducer = BucketReducer(self.buckets, comm, tracer, reduce_dtype, codec)
        self._last_bytes = (0, 0, 0)  # (payload, fp32 size, wire sent) of the last sync
        self._sync = True
        self._slots: dict[nn.Parameter, tuple[GradBucket, int]] = {}
        self._hooks = []
        for bucket in self.buckets:
            for slot, p in enumerate(bucket.params):
                self._slots[p] = (bucket, slot)
                p.grad = bucket.grad_view(slot)
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))

    def broadcast_parameters(self) -> None:
        """Make every replica start from dp rank 0's parameters and buffers."""
        with torch.no_grad():
            for t in list(self.model.parameters()) + list(self.model.buffers()):
                self.comm.broadcast(t.data, src=0)

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        bucket, slot = self._slots[param]
        view, grad = bucket.grad_view(slot), grad_of(param)  # just accumulated
        if grad.data_ptr() != view.data_ptr():
            # Someone replaced .grad (e.g. optimizer.zero_grad(set_to_none=True) then a
            # fresh accumulation): move it back into the bucket.
            view.copy_(grad)
            param.grad = view
        if self._sync:
            self.reducer.mark_ready(bucket, slot)

    def _adopt_unready_grads(self) -> None:
        """Parameters that got no gradient this backward: a ``.grad`` the user set to
        None means zero, one they replaced is copied in, so stale bucket contents are
        never reduced."""
        for bucket in self.buckets:
            if bucket.pending == 0:
                continue
            for slot, p in enumerate(bucket.params):
                if slot in bucket.ready:
                    continue
                view = bucket.grad_view(slot)
                if p.grad is None:
                    view.zero_()
                elif p.grad.data_ptr() != view.data_ptr():
                    view.copy_(p.grad)
                else:
                    continue
                p.grad = view

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the next backward outside reduces the sum."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def backward(self, scope: int, last: bool) -> contextlib.AbstractContextManager[None]:
        """A pipeline chunk's backward: only its last one of the step reduces (the
        buckets launch in their fixed order as they fill, whatever the schedule)."""
        return contextlib.nullcontext() if last else self.no_sync()

    def reduce_loss_totals(self, totals: torch.Tensor) -> TrackedWork:
        return self.comm.all_reduce(totals, async_op=True)

    def gradient_pieces(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        return [(p, grad_of(p)) for b in self.buckets for p in b.params]

    def finish_gradient_sync(self, scale: float | torch.Tensor = 1.0) -> None:
        """Wait for all bucket reductions, then multiply the summed gradients by
        ``scale`` (the trainer passes 1 / global target-token count)."""
        self._adopt_unready_grads()
        self.reducer.wait(scale)
        self._last_bytes = (self.reducer.sent_bytes, self.reducer.dense_bytes,
                            self.reducer.wire_sent)
        self.reducer.reset()

    def comm_stats(self) -> dict[str, float]:
        """The last gradient sync: payload bytes this rank handed to collectives for
        the buckets (``grad_sync_bytes``; the trainer's ``comm_bytes_per_step`` is the
        whole step's ledger payload), ``compression_ratio`` = the buckets' fp32 bytes /
        that payload (1.0 for a plain fp32 all-reduce), and on the wire:
        ``grad_sync_wire_bytes`` this rank sent, ``wire_compression_ratio`` = what a
        ring all-reduce of the fp32 buckets sends / that (an all-gathering codec's
        ratio falls with the world size)."""
        sent, dense, wire = self._last_bytes
        dense_wire, _ = wire_bytes("all_reduce", dense, self.comm.size)
        return {"grad_sync_bytes": sent,
                "compression_ratio": dense / sent if sent else 1.0,
                "grad_sync_wire_bytes": wire,
                "wire_compression_ratio": dense_wire / wire if wire else 1.0}

    def zero_grad(self) -> None:
        """Zero the buckets and point every ``.grad`` back at its view."""
        for b in self.buckets:
            b.buffer.zero_()
            for p, view in zip(b.params, b.views, strict=True):
                if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                    p.grad = view
        self.reducer.reset()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Global gradient norm (replicas hold the same reduced gradients, so the local
        norm is the global one), a 0-dim tensor on the device; clip if ``max_norm > 0``."""
        return local_grad_norm([p for p in self.model.parameters() if p.grad is not None],
                               max_norm, self.comm.device)

    def after_optimizer_step(self) -> None:
        """Every replica applied the same update (or skipped it alike); the codec's
        residuals and warm starts lose whatever a non-finite gradient put in them
        (nothing, after a finite step), so one nan never poisons a later step."""
        if self.reducer.codec is not None:
            self.reducer.codec.drop_nonfinite_state()

    def model_state_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Bytes this rank holds for parameters, gradients (the buckets) and optimizer
        state."""
        params = sum(p.numel() * p.element_size() for p in self.model.parameters())
        grads = sum(b.buffer.numel() * b.buffer.element_size() for b in self.buckets)
        optim = sum(v.numel() * v.element_size() for st in optimizer.state.values()
                    for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
        return {"params": params, "grads": grads, "optimizer": optim}

    def finalize(self) -> None:
        """End of training: remove the gradient hooks; the model is plain again."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def apply_data_parallel(model: nn.Module, comm: Communicator, *,
                        bucket_mb: float = 25.0, broadcast: bool = True,
                        tracer: SpanRecorder | None = None,
                        reduce_dtype: torch.dtype = torch.float32,
                        codec: GradientCodec | None = None) -> DataParallel:
    """Attach data-parallel gradient sync to ``model`` over ``comm``'s group;
    gradients travel in ``reduce_dtype`` (e.g. bf16 to halve the bytes), or through
    ``codec`` (see :func:`disttrain.comm.codecs.build_codec`; None = plain all-reduce)."""
    dp = DataParallel(model, comm, bucket_bytes=int(bucket_mb * 2**20), tracer=tracer,
                      reduce_dtype=reduce_dtype, codec=codec)
    if broadcast:
        dp.broadcast_parameters()
    return dp
