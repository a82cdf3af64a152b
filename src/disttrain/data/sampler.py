"""The global sample order: the same stream of samples on any number of ranks.

The stream is the concatenation over epochs 0, 1, 2, ... of a permutation of the dataset
that depends on (seed, epoch) only. A *position* in it is a global sample index: position
``p`` is offset ``p % num_samples`` of epoch ``p // num_samples``. Global batch ``k``
occupies positions ``[k * B, (k + 1) * B)``; data-parallel rank ``r`` of ``dp`` takes the
``r``-th contiguous chunk of ``B / dp``. Concatenating every rank's chunk in rank order
gives back the global batch, whatever ``dp`` is, so a run can resume at any position with
another world size and continue the very same stream.
"""

from __future__ import annotations

import hashlib

import torch


class GlobalOrderSampler:
    """Dataset indices for any range of global positions (see the module docstring)."""

    def __init__(self, num_samples: int, seed: int) -> None:
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        self.num_samples = num_samples
        self.seed = seed
        self._cached: tuple[int, torch.Tensor] | None = None

    def permutation(self, epoch: int) -> torch.Tensor:
        """Epoch ``epoch``'s order: a permutation of ``range(num_samples)``, int64 [N]."""
        if self._cached is None or self._cached[0] != epoch:
            gen = torch.Generator().manual_seed(_epoch_seed(self.seed, epoch))
            self._cached = (epoch, torch.randperm(self.num_samples, generator=gen))
        return self._cached[1]

    def epoch_of(self, position: int) -> int:
        """The epoch that global position ``position`` falls in."""
        return _check_position(position) // self.num_samples

    def indices(self, start: int, count: int) -> list[int]:
        """Dataset indices at positions ``start .. start + count - 1`` (may cross epochs)."""
        _check_position(start)
        out: list[int] = []
        pos, end = start, start + count
        while pos < end:
            epoch, offset = divmod(pos, self.num_samples)
            take = min(end - pos, self.num_samples - offset)
            out.extend(self.permutation(epoch)[offset:offset + take].tolist())
            pos += take
        return out

    def rank_slice(self, start: int, global_batch: int, dp_rank: int,
                   dp_size: int) -> list[int]:
        """Rank ``dp_rank``'s ``global_batch // dp_size`` indices of the batch at ``start``."""
        if global_batch % dp_size:
            raise ValueError(f"global_batch={global_batch} is not divisible by "
                             f"dp_size={dp_size}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} is outside 0..{dp_size - 1}")
        per = global_batch // dp_size
        return self.indices(start + dp_rank * per, per)

    def micro_batches(self, start: int, global_batch: int, dp_rank: int, dp_size: int,
                      grad_accum: int) -> list[list[int]]:
        """``rank_slice`` cut into ``grad_accum`` consecutive micro-batches of equal size."""
        local = self.rank_slice(start, global_batch, dp_rank, dp_size)
        if grad_accum < 1 or len(local) % grad_accum:
            raise ValueError(f"{len(local)} samples per rank (global_batch={global_batch}, "
                             f"dp_size={dp_size}) do not split into grad_accum={grad_accum} "
                             "equal micro-batches")
        micro = len(local) // grad_accum
        return [local[i * micro:(i + 1) * micro] for i in range(grad_accum)]


def eval_indices(num_samples: int, limit: int, dp_rank: int, dp_size: int) -> list[int]:
    """Rank ``dp_rank``'s share of the first ``min(limit, num_samples)`` held-out samples.

    Natural order, strided by rank (``r, r + dp_size, ...``); ranks may get counts that
    differ by one, which is fine for a sum all-reduced afterwards.
    """
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} is outside 0..{dp_size - 1}")
    return list(range(dp_rank, min(limit, num_samples), dp_size))


def _epoch_seed(seed: int, epoch: int) -> int:
    """A 63-bit generator seed mixing (seed, epoch); the same in every process."""
    digest = hashlib.sha256(f"disttrain-order:{seed}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _check_position(position: int) -> int:
    if position < 0:
        raise ValueError(f"global sample positions are >= 0, got {position}")
    return position
