"""How a sequence is split over a context-parallel (cp) group of N ranks.

A sequence of T positions is cut into 2N chunks of c = T / 2N positions; cp rank i
holds chunks i and 2N-1-i, in that order: ``x_local = [x_i ; x_{2N-1-i}]`` along the
sequence dim (2c positions). Under a causal mask the queries of chunk j attend to
j + 1/2 chunks of keys, so a rank holding one early and one late chunk does
(i + 1/2) + (2N-1-i + 1/2) = 2N chunk pairs of work, the same on every rank; the
contiguous split (rank i holding chunks 2i, 2i+1) would leave rank N-1 with about
2N-1 times the work of rank 0.

Everything here is indexing, with no process group: a rank's part of any [B, T, ...]
tensor (input ids, targets, labels, masks), the global positions of its tokens (for
learned or rotary position embeddings), and the parts put back together.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...errors import ConfigError
from ...targets import LABEL_IGNORE_INDEX


def chunk_length(seq_len: int, cp: int, field: str = "seq_len") -> int:
    """c = seq_len / (2 cp), the length of one of the 2 cp chunks; a length that does
    not divide is a :class:`ConfigError` on ``field`` (the caller's name for it)."""
    if cp < 1:
        raise ConfigError("parallel.cp", cp, "must be at least 1")
    if seq_len < 2 * cp or seq_len % (2 * cp):
        lower = seq_len - seq_len % (2 * cp)
        hint = f"e.g. {lower} or {lower + 2 * cp}" if lower else f"e.g. {2 * cp}"
        raise ConfigError(field, seq_len,
                          f"context parallelism over cp={cp} ranks cuts each sequence "
                          f"into 2 x cp = {2 * cp} equal chunks",
                          f"use a sequence length that is a multiple of {2 * cp} ({hint}), "
                          "or a cp that divides half of it")
    return seq_len // (2 * cp)


def local_chunks(cp: int, rank: int) -> tuple[int, int]:
    """The two chunk indices cp rank ``rank`` holds: (rank, 2 cp - 1 - rank)."""
    if not 0 <= rank < cp:
        raise ValueError(f"cp rank {rank} is outside a cp group of {cp} ranks")
    return rank, 2 * cp - 1 - rank


def local_positions(seq_len: int, cp: int, rank: int,
                    device: torch.device | str | None = None) -> torch.Tensor:
    """[2c] int64: the global positions of cp rank ``rank``'s tokens, in local order
    (chunk ``rank`` then chunk 2 cp-1-rank); increasing, so local causal order is
    global causal order."""
    c = chunk_length(seq_len, cp)
    first, second = local_chunks(cp, rank)
    return torch.cat([torch.arange(first * c, (first + 1) * c, device=device),
                      torch.arange(second * c, (second + 1) * c, device=device)])


def split_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """cp rank ``rank``'s part of ``x`` along ``dim`` (the sequence, T positions):
    [..., T, ...] -> [..., 2c, ...], chunks ``rank`` and 2 cp-1-rank (a new tensor)."""
    c = chunk_length(x.shape[dim], cp, field=f"the sequence dim (dim {dim})")
    first, second = local_chunks(cp, rank)
    return torch.cat([x.narrow(dim, first * c, c), x.narrow(dim, second * c, c)], dim=dim)


def gather_sequence(parts: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole sequence from every cp rank's part (in cp rank order), the inverse of
    :func:`split_sequence`: N parts [..., 2c, ...] -> [..., 2 N c, ...]."""
    cp = len(parts)
    halves = [p.chunk(2, dim=dim) for p in parts]
    chunks = [halves[i][0] for i in range(cp)] + [halves[i][1] for i in reversed(range(cp))]
    return torch.cat(chunks, dim=dim)


def shift_labels(labels: torch.Tensor, ignore_index: int = LABEL_IGNORE_INDEX
                 ) -> torch.Tensor:
    """Unshifted labels [B, T] (Hugging Face: position t predicts label t+1) as targets
    [B, T] aligned with the logits: ``targets[:, t] = labels[:, t+1]``, the last
    position ``ignore_index``. Shift before :func:`split_sequence`: a rank's two chunks
    are not contiguous, so shifting its part would pair a chunk's last token with the
    first label of the wrong chunk."""
    out = torch.full_like(labels, ignore_index)
    out[:, :-1] = labels[:, 1:]
    return out
