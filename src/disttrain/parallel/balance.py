"""Splitting each global batch over data-parallel ranks.

Static: equal shares. Dynamic: shares in proportion to each rank's measured throughput
(samples per second of busy time), re-measured at every logged step. Because the loss
is normalised by the global number of loss terms, an uneven split changes nothing in
the update: gradients are weighted by the tokens each rank processed.
"""

from __future__ import annotations


def split_evenly(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def split_by_rate(total: int, rates: list[float], minimum: int = 1) -> list[int]:
    """Shares of ``total`` proportional to ``rates`` (largest remainder), each at least
    ``minimum`` so every rank keeps measuring; deterministic for equal inputs."""
    parts = len(rates)
    spare = total - minimum * parts
    if spare < 0 or sum(rates) <= 0:
        return split_evenly(total, parts)
    exact = [spare * r / sum(rates) for r in rates]
    shares = [int(x) for x in exact]
    order = sorted(range(parts), key=lambda i: (-(exact[i] - shares[i]), i))
    for i in order[: spare - sum(shares)]:
        shares[i] += 1
    return [s + minimum for s in shares]


class BatchSplitter:
    """Current shares of the global batch; ``update`` re-balances (dynamic only)."""

    def __init__(self, global_batch: int, dp: int, dynamic: bool) -> None:
        self.global_batch, self.dp, self.dynamic = global_batch, dp, dynamic
        self.shares = split_evenly(global_batch, dp)

    def offsets(self) -> list[int]:
        out, acc = [], 0
        for s in self.shares:
            out.append(acc)
            acc += s
        return out

    def update(self, samples: list[float], busy_s: list[float]) -> None:
        if not self.dynamic or any(t <= 0 for t in busy_s):
            return
        self.shares = split_by_rate(self.global_batch,
                                    [n / t for n, t in zip(samples, busy_s)])
