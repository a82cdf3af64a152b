"""Splitting each global batch over data-parallel ranks.

Static: equal shares. Dynamic: shares in proportion to each rank's measured throughput
(samples per second of busy time), re-measured at every logged step. Because the loss
is normalised by the global number of loss terms, an uneven split changes nothing in
the update: gradients are weighted by the tokens each rank processed.
"""

from __future__ import annotations

from ..config.layout import Layout
from ..config.schema import Config
from ..dimensions import DIMENSIONS, Role, joined
from ..errors import ConfigError
from ..names import SYNC_EVERY_STEP


def check_balance(config: Config, layout: Layout) -> None:
    """Dynamic shares need every rank of a replica (its pipeline stages, its tp shards:
    every dimension but the one splitting the samples) to run the same micro-batches,
    and replicas that meet at every step."""
    if config.parallel.balance != "dynamic":
        return
    others = [d for d in DIMENSIONS if not d.has(Role.SAMPLES)]
    if any(layout.degree(d.key) > 1 for d in others):
        raise ConfigError("parallel.balance", "dynamic", "is not supported with "
                          f"{joined(others, ' or ')} > 1 (every stage and tp shard of a "
                          "pipeline works on the same micro-batches, so their shares "
                          "cannot differ)", "use parallel.balance=static")
    if config.train.sync != SYNC_EVERY_STEP:
        raise ConfigError("parallel.balance", "dynamic",
                          f"is not supported with train.sync={config.train.sync} "
                          "(replicas train apart between rounds)",
                          "use parallel.balance=static")


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


def micro_batch_sizes(share: int, micro_batch: int, count: int) -> list[int]:
    """``share`` samples cut into ``count`` micro-batches of at most ``micro_batch``
    (as even as possible; empty ones when the share is smaller than the count)."""
    base, extra = divmod(share, count)
    sizes = [base + (1 if i < extra else 0) for i in range(count)]
    if max(sizes) > micro_batch:
        raise ValueError(f"{share} samples do not fit {count} micro-batches of "
                         f"{micro_batch}")
    return sizes


class BatchSplitter:
    """Current shares of the global batch; ``update`` re-balances (dynamic only)."""

    def __init__(self, global_batch: int, dp: int, dynamic: bool) -> None:
        self.global_batch, self.dp, self.dynamic = global_batch, dp, dynamic
        self.shares = split_evenly(global_batch, dp)

    def micro_batches(self, micro_batch: int) -> int:
        """Micro-batches every rank runs this step: enough for the largest share, the
        same on every rank, because sharded strategies issue collectives per
        micro-batch."""
        return max(-(-s // micro_batch) for s in self.shares)

    def offsets(self) -> list[int]:
        out, acc = [], 0
        for s in self.shares:
            out.append(acc)
            acc += s
        return out

    def update(self, samples: list[float], busy_s: list[float],
               micro_batch: int | None = None) -> None:
        """New shares in proportion to each rank's samples per busy second. With
        ``micro_batch``, every share is at least the number of micro-batches the
        largest share needs, so no rank has an empty micro-batch."""
        if not self.dynamic or any(t <= 0 for t in busy_s):
            return
        rates = [n / t for n, t in zip(samples, busy_s, strict=True)]
        minimum = 1
        while True:
            shares = split_by_rate(self.global_batch, rates, minimum)
            count = max(-(-s // micro_batch) for s in shares) if micro_batch else 1
            if min(shares) >= count:
                break
            minimum = count
        self.shares = shares
