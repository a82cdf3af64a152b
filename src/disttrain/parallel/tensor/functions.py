"""Tensor-parallel communication maths: autograd Functions over the tp group.

Every collective goes through the :class:`~disttrain.comm.Communicator` passed in, so
the ledger sees it. Each Function is named after what it does in forward and in
backward. "Last dim" is the hidden / head / vocab dimension a layer is sharded on;
"sequence dim" is dim 1 of activations laid out [B, T, ...] (sequence parallelism
shards the residual stream on it: rank r holds positions [r*T/tp, (r+1)*T/tp)).

The vocab-parallel cross-entropy is here too: it works on logits sharded over the
vocabulary and never gathers them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ...comm.collectives import Communicator, ReduceOp, TrackedWork
from ...targets import IGNORE_INDEX

SEQ_DIM = 1


def _all_reduce(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """Sum over the group into a fresh tensor (autograd may still need ``x``)."""
    out = x.contiguous().clone()
    comm.all_reduce(out)
    return out


def _split(x: torch.Tensor, comm: Communicator, dim: int) -> torch.Tensor:
    """This rank's block of ``x`` along ``dim`` (size must divide evenly)."""
    if x.shape[dim] % comm.size:
        raise ValueError(f"cannot split dim {dim} of size {x.shape[dim]} over "
                         f"tp={comm.size} ranks: make it a multiple of {comm.size}")
    return x.chunk(comm.size, dim=dim)[comm.rank].contiguous()


def _all_gather(x: torch.Tensor, comm: Communicator, dim: int) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in group-rank order."""
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((comm.size * front.shape[0], *front.shape[1:]))
    comm.all_gather_into(out, front)
    return out.movedim(0, dim).contiguous()


def _start_reduce_scatter(x: torch.Tensor, comm: Communicator, dim: int
                          ) -> tuple[TrackedWork, Callable[[], torch.Tensor]]:
    """Start summing ``x`` over ranks, keeping this rank's block along ``dim``; returns
    the work and what gives the block once it is done."""
    if x.shape[dim] % comm.size:
        raise ValueError(f"cannot reduce-scatter dim {dim} of size {x.shape[dim]} over "
                         f"tp={comm.size} ranks: make it a multiple of {comm.size}")
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] // comm.size, *front.shape[1:]))
    work = comm.reduce_scatter(out, front, async_op=True)
    return work, lambda: out.movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, comm: Communicator, dim: int) -> torch.Tensor:
    """Sum ``x`` over ranks; keep this rank's block along ``dim``."""
    work, block = _start_reduce_scatter(x, comm, dim)
    work.wait()
    return block()


class IdentityFwdAllReduceBwd(torch.autograd.Function):
    """Copy to the tp region: identity in forward, all-reduce (sum) in backward.

    Placed before a column-parallel layer: its replicated input [..., d] feeds every
    rank's shard, so the input gradient is the sum of the ranks' partial gradients.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.comm), None


class AllReduceFwdIdentityBwd(torch.autograd.Function):
    """Reduce from the tp region: all-reduce (sum) in forward, identity in backward.

    Placed after a row-parallel layer: partial outputs [..., d] summed over ranks; the
    replicated output gradient is already each rank's full input gradient.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        return _all_reduce(x, comm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class AllGatherLastFwdSplitBwd(torch.autograd.Function):
    """Gather from the tp region: all-gather along the last dim in forward
    ([..., n/tp] -> [..., n]), keep this rank's block of the gradient in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        ctx.comm = comm
        return _all_gather(x, comm, x.dim() - 1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _split(grad, ctx.comm, grad.dim() - 1), None


class SplitLastFwdAllGatherBwd(torch.autograd.Function):
    """Scatter to the tp region: keep this rank's block of the last dim in forward
    ([..., n] -> [..., n/tp]), all-gather the gradient along it in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        ctx.comm = comm
        return _split(x, comm, x.dim() - 1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_gather(grad, ctx.comm, grad.dim() - 1), None


class ReduceScatterSeqFwdAllGatherBwd(torch.autograd.Function):
    """Reduce-scatter along the sequence dim in forward ([B, T, d] partial sums ->
    [B, T/tp, d] summed), all-gather the gradient along it in backward.

    Replaces the all-reduce after a row-parallel layer under sequence parallelism.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        ctx.comm = comm
        return _reduce_scatter(x, comm, SEQ_DIM)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_gather(grad, ctx.comm, SEQ_DIM), None


class AllGatherSeqFwdReduceScatterBwd(torch.autograd.Function):
    """All-gather along the sequence dim in forward ([B, T/tp, d] -> [B, T, d]),
    reduce-scatter the gradient along it in backward.

    Replaces the identity before a column-parallel layer under sequence parallelism:
    every rank's shard consumes all positions, so each position's gradient is a sum
    over ranks, and each rank keeps its own positions' sum.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        ctx.comm = comm
        return _all_gather(x, comm, SEQ_DIM)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _reduce_scatter(grad, ctx.comm, SEQ_DIM), None


class SplitSeqFwdAllGatherBwd(torch.autograd.Function):
    """Enter the sequence-parallel region: keep this rank's positions in forward
    ([B, T, d] replicated -> [B, T/tp, d]), all-gather the gradient in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        ctx.comm = comm
        return _split(x, comm, SEQ_DIM)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_gather(grad, ctx.comm, SEQ_DIM), None


def _autocast_state(device_type: str) -> tuple[str, bool, torch.dtype]:
    """The caller's autocast state on ``device_type``, for a backward to run under."""
    return (device_type, torch.is_autocast_enabled(device_type),
            torch.get_autocast_dtype(device_type))


def wanted_now(ctx: Any, index: int) -> bool:
    """Whether this run of a Function's backward must give the gradient of its forward
    input ``index``: it needs one (``needs_input_grad``) and the running graph task
    goes on from that input (``torch._C._will_engine_execute_node``). A split backward
    asks for part of a node: a zero-bubble B for the input only, its W for the weights
    only (:mod:`disttrain.parallel.pipeline.split_backward`), where computing the other
    part would repeat a matmul, a collective, or read a weight ZeRO-3 has freed.
    Unknown (a leaf ``autograd.grad`` asked for, an older torch): wanted."""
    if not ctx.needs_input_grad[index]:
        return False
    node = ctx.next_functions[index][0]
    will_run = getattr(torch._C, "_will_engine_execute_node", None)
    if node is None or will_run is None:
        return True
    try:
        return bool(will_run(node))
    except RuntimeError:  # torch cannot tell for a leaf that autograd.grad asked for
        return True


def _linear_grads(ctx: Any, grad: torch.Tensor, x: torch.Tensor
                  ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(weight, bias) gradients of y = x @ W^T + b, as much as this backward asks for
    (:func:`wanted_now`): W stored [out, in], or [in, out] when ``ctx.transposed``;
    grad [..., out]."""
    g2 = grad.reshape(-1, grad.shape[-1])
    grad_w = None
    if wanted_now(ctx, 1):
        x2 = x.reshape(-1, x.shape[-1])
        grad_w = x2.t().matmul(g2) if ctx.transposed else g2.t().matmul(x2)
    grad_b = g2.sum(0) if ctx.has_bias and wanted_now(ctx, 2) else None
    return grad_w, grad_b


class ColumnParallelLinearFn(torch.autograd.Function):
    """A column-parallel linear with its region's entry fused in, so that the backward
    starts the input gradient's collective before computing the weight and bias
    gradients and waits for it after them: the two overlap.

    Replicated input (``sequence_parallel`` False): forward y = x @ W^T + b with no
    communication (x [..., in], W [out/tp, in]); backward the input gradient
    grad_y @ W [..., in] all-reduced over tp (:func:`copy_to_tp_region`'s backward).
    Sequence-sharded input: forward x [B, T/tp, in] all-gathered along the sequence
    first (:func:`gather_from_sequence_region`); backward the input gradient [B, T, in]
    reduce-scattered back to [B, T/tp, in]."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None, comm: Communicator, transposed: bool,
                sequence_parallel: bool) -> torch.Tensor:
        full = _all_gather(x, comm, SEQ_DIM) if sequence_parallel else x
        ctx.comm, ctx.transposed, ctx.has_bias = comm, transposed, bias is not None
        ctx.sequence_parallel = sequence_parallel
        ctx.autocast, ctx.x_dtype = _autocast_state(x.device.type), x.dtype
        ctx.save_for_backward(full, weight)
        return F.linear(full, weight.t() if transposed else weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        full, weight = ctx.saved_tensors
        device_type, enabled, dtype = ctx.autocast
        pending = None
        with torch.autocast(device_type, dtype=dtype, enabled=enabled):
            if wanted_now(ctx, 0):  # summed in the input's dtype, as unfused
                w = weight.t() if ctx.transposed else weight
                grad_x = grad.matmul(w).to(ctx.x_dtype).contiguous()
                if ctx.sequence_parallel:
                    pending = _start_reduce_scatter(grad_x, ctx.comm, SEQ_DIM)
                else:
                    pending = (ctx.comm.all_reduce(grad_x, async_op=True),
                               lambda: grad_x)
            grad_w, grad_b = _linear_grads(ctx, grad, full)
        if pending is None:
            return None, grad_w, grad_b, None, None, None
        work, finish = pending
        work.wait()
        return finish(), grad_w, grad_b, None, None, None


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           comm: Communicator, *, sequence_parallel: bool = False,
                           transposed: bool = False) -> torch.Tensor:
    """x @ W^T + b for a column-parallel W [out/tp, in] ([in, out/tp] when
    ``transposed``): x replicated [..., in] (the input gradient all-reduced in
    backward), or [B, T/tp, in] under sequence parallelism (all-gathered along T in
    forward, its gradient reduce-scattered in backward); output [..., out/tp]. The
    same as :func:`copy_to_tp_region` (or :func:`gather_from_sequence_region`) then
    ``F.linear``, with the backward's collective overlapping the weight gradient."""
    return ColumnParallelLinearFn.apply(x, weight, bias, comm, transposed,
                                        sequence_parallel)


def copy_to_tp_region(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """Identity forward, all-reduce backward."""
    return IdentityFwdAllReduceBwd.apply(x, comm)


def reduce_from_tp_region(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """All-reduce forward, identity backward."""
    return AllReduceFwdIdentityBwd.apply(x, comm)


def gather_from_tp_region(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """All-gather the last dim forward, split backward: [..., n/tp] -> [..., n]."""
    return AllGatherLastFwdSplitBwd.apply(x, comm)


def scatter_to_tp_region(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """Split the last dim forward, all-gather backward: [..., n] -> [..., n/tp]."""
    return SplitLastFwdAllGatherBwd.apply(x, comm)


def reduce_scatter_to_sequence_region(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """Reduce-scatter the sequence dim forward, all-gather backward: [B, T, d] -> [B, T/tp, d]."""
    return ReduceScatterSeqFwdAllGatherBwd.apply(x, comm)


def gather_from_sequence_region(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """All-gather the sequence dim forward, reduce-scatter backward: [B, T/tp, d] -> [B, T, d]."""
    return AllGatherSeqFwdReduceScatterBwd.apply(x, comm)


def scatter_to_sequence_region(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """Split the sequence dim forward, all-gather backward: [B, T, d] -> [B, T/tp, d]."""
    return SplitSeqFwdAllGatherBwd.apply(x, comm)


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of vocab-sharded logits, in fp32.

    Forward: local_logits [N, V/tp] (rank r holds vocabulary ids [r*V/tp, (r+1)*V/tp)),
    targets [N] -> loss [N] (0 where the target is IGNORE_INDEX). Two small
    all-reduces over tp, [N] then [2, N] (the row max; the row sum of exp stacked with
    the target logit), never the logits themselves. Backward: (softmax - onehot) on the local
    shard, scaled by the incoming per-token gradient; no communication.
    """

    @staticmethod
    def forward(ctx: Any, local_logits: torch.Tensor, targets: torch.Tensor,
                comm: Communicator, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
        logits = local_logits.float()
        n_local = logits.shape[-1]
        # the max only stabilises exp(); it carries no gradient
        row_max = logits.max(dim=-1).values
        comm.all_reduce(row_max, op=ReduceOp.MAX)
        shifted = logits - row_max.unsqueeze(-1)
        local_t = targets - comm.rank * n_local
        valid = targets != ignore_index
        mine = (local_t >= 0) & (local_t < n_local) & valid
        local_t = local_t.clamp(0, n_local - 1)
        target_logit = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1) * mine
        exp = shifted.exp()
        sums = torch.stack([exp.sum(dim=-1), target_logit])  # one collective, not two
        comm.all_reduce(sums)
        loss = (sums[0].log() - sums[1]) * valid
        exp.div_(sums[0].unsqueeze(-1))
        ctx.save_for_backward(exp, local_t, mine, valid)
        ctx.logits_dtype = local_logits.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, local_t, mine, valid = ctx.saved_tensors
        grad_logits = softmax.clone()
        rows = torch.arange(grad_logits.shape[0], device=grad_logits.device)
        grad_logits[rows, local_t] -= mine.to(grad_logits.dtype)
        grad_logits.mul_((grad.float() * valid).unsqueeze(-1))
        return grad_logits.to(ctx.logits_dtype), None, None, None


def vocab_parallel_token_loss(local_logits: torch.Tensor, targets: torch.Tensor,
                              comm: Communicator, *, ignore_index: int = IGNORE_INDEX
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy over targets != ``ignore_index``, and their count, like
    :func:`disttrain.models.token_loss`, from vocab-sharded logits.

    local_logits: [B, T, V/tp] (this rank's vocabulary block); targets: [B, T] global
    vocabulary ids. Every tp rank returns the same (loss_sum, count); the count is a
    0-dim int64 tensor on the targets' device (read on the host, it would make a GPU
    step wait for its forward).
    """
    flat = local_logits.flatten(0, -2)
    tgt = targets.flatten()
    losses = VocabParallelCrossEntropy.apply(flat, tgt, comm, ignore_index)
    return losses.sum(), (tgt != ignore_index).sum()
