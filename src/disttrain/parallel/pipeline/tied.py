"""Tied weights across pipeline stages (the GPT's ``head.weight`` tied to
``tok_emb.weight``): with ``pp > 1`` the first and last chunks are different chunks,
so after backward the two copies' gradients are summed between the first and the last
stage (in a V both chunks live on rank 0 and the sum is local): both receive the same
update and stay equal."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...comm.collectives import Communicator
from .chunks import PipelineChunk

# Above any tag the runner uses, so the exchange never matches an activation message.
_TIED_TAG = 1 << 24


def exchange_tied_grads(pairs: Sequence[tuple[torch.Tensor, int]],
                        comm: Communicator) -> None:
    """Sum each tied weight's gradient (or this rank's piece of it) with the peer
    holding the other copy, over the pp group ``comm``: each side sends its gradient
    and adds the other's, so both end bitwise equal. ``pairs``: (gradient tensor, peer
    pp rank); both sides must pass pieces of the same shape in the same order. The
    lower rank of a pair sends first and the higher receives first, so both post the
    pair's two messages in one order (NCCL: a send waits for its receive). Pairs whose
    peer is this rank (a V: first and last chunk on rank 0) are summed here: the k-th
    of them with the k-th of their second half (owners first, then the copies)."""
    local = [grad for grad, peer in pairs if peer == comm.rank]
    half = len(local) // 2
    for owner, copy_ in zip(local[:half], local[half:], strict=True):
        owner.add_(copy_)
        copy_.copy_(owner)
    for grad, peer in pairs:
        if peer == comm.rank:
            continue
        mine, theirs = grad.detach().clone(), torch.empty_like(grad)
        if comm.rank < peer:
            works = [comm.isend(mine, peer, _TIED_TAG), comm.irecv(theirs, peer, _TIED_TAG)]
        else:
            works = [comm.irecv(theirs, peer, _TIED_TAG), comm.isend(mine, peer, _TIED_TAG)]
        for work in works:
            work.wait()
        grad.add_(theirs)


def sync_tied_grads(chunks: Sequence[PipelineChunk], comm: Communicator) -> None:
    """:func:`exchange_tied_grads` on the chunks' own ``.grad`` (a missing gradient
    counts as zero). Call it on every pp rank, after the pipeline's backward and before
    the optimizer step; pp = 1 (one shared parameter) does nothing."""
    pairs = []
    for chunk in chunks:
        for weight, peer in chunk.tied_weights():
            if weight.grad is None:
                weight.grad = torch.zeros_like(weight)
            pairs.append((weight.grad, peer))
    exchange_tied_grads(pairs, comm)
