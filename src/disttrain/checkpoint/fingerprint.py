"""Fingerprints of the tensors a checkpoint does not hold: a run's frozen parameters.

A run that trains only some parameters (LoRA adapters beside a frozen base) saves only
those; on a resume the others come again from the run's source (``model.pretrained``,
the seeded initialiser). Each checkpoint therefore records, per frozen tensor, four
numbers that any layout can compute from the pieces it holds, summed over the pieces:

    [sum x, sum x^2, sum over rows of w_r * (sum of row r), numel]

with w_r = (r + 1) / rows (row r of dim 0, its global index: a swap of rows changes it).
A resume, and an export that reads the base, recompute them and refuse a base that
differs. Pieces summed in another order (another layout) differ by float64 rounding
only, far below the tolerance of :func:`first_difference` (1e-9 of each sum's bound).
"""

from __future__ import annotations

import math

import torch

# the checkpoint metadata's key: tensor name -> its fingerprint
FROZEN_KEY = "frozen"
_RTOL = 1e-9


def piece_checksums(tensor: torch.Tensor, global_shape: tuple[int, ...],
                    offsets: tuple[int, ...]) -> torch.Tensor:
    """This piece's share of its tensor's fingerprint, [4] float64 on its device
    (``offsets``: where the piece lies in the global tensor of ``global_shape``)."""
    x = tensor.detach()
    rows_total = global_shape[0] if global_shape else 1
    first = offsets[0] if offsets else 0
    flat = x.reshape(x.shape[0] if x.dim() else 1, -1)
    weights = torch.arange(first + 1, first + flat.shape[0] + 1, device=x.device,
                           dtype=torch.float64) / rows_total
    return torch.stack([
        x.sum(dtype=torch.float64),
        torch.linalg.vector_norm(x, dtype=torch.float64).square(),
        (flat.sum(1, dtype=torch.float64) * weights).sum(),
        torch.tensor(float(x.numel()), dtype=torch.float64, device=x.device)])


def first_difference(saved: dict[str, list[float]], now: dict[str, list[float]]
                     ) -> str | None:
    """None when ``now`` fingerprints the same tensors as ``saved`` up to rounding; else
    what differs, in a few words (a tensor missing on one side, or the first tensor
    whose values differ)."""
    for name in sorted(saved.keys() | now.keys()):
        if name not in now:
            return f"{name} is frozen in the checkpoint's run and not in this one"
        if name not in saved:
            return f"{name} is frozen in this run and not in the checkpoint's"
        if not _same(saved[name], now[name]):
            return f"the values of {name} differ"
    return None


def _same(a: list[float], b: list[float]) -> bool:
    if len(a) != 4 or len(b) != 4 or a[3] != b[3]:
        return False
    sq = max(a[1], b[1], 0.0)
    bound = math.sqrt(a[3] * sq)  # |sum x| <= sqrt(n) * ||x||, also for the row sums
    return (abs(a[0] - b[0]) <= _RTOL * bound + 1e-30
            and abs(a[1] - b[1]) <= _RTOL * sq + 1e-30
            and abs(a[2] - b[2]) <= _RTOL * bound + 1e-30)
