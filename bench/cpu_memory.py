"""The CPU allocator's peak during a piece of work, from torch's profiler.

``peak_bytes(run)``: the most bytes the CPU allocator held above what it held when
``run()`` started, over its whole run (``peak_and_held``: and what it still held at the
end): the profiler's memory records (one per
allocation and free, signed) summed in time order. What a CPU bench reports as a peak,
so two benches' figures mean the same thing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from torch.profiler import ProfilerActivity, profile

T = TypeVar("T")


def peak_bytes(run: Callable[[], T]) -> tuple[int, T]:
    """(peak bytes allocated above the start, what ``run()`` returned)."""
    peak, _, result = peak_and_held(run)
    return peak, result


def peak_and_held(run: Callable[[], T]) -> tuple[int, int, T]:
    """(peak bytes allocated above the start, bytes still allocated above the start when
    ``run()`` returned, what it returned: alive until the caller drops it)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = run()
    records = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]")
    now = peak = 0
    for _, nbytes in records:
        now += nbytes
        peak = max(peak, now)
    return peak, now, result
