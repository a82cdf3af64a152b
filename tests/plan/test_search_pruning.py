"""What the search leaves out: its memory floor drops layouts without estimating them
(only layouts that do not fit: it keeps every row an exhaustive search keeps and
reports the same closest miss), and ``held`` keys leave out what a framework lacks."""

from __future__ import annotations

from dataclasses import replace

import pytest

from disttrain.errors import UserError
from disttrain.plan import PRESETS, ModelShape, Options, estimate, search
from disttrain.plan.estimate import memory_floor
from disttrain.plan.search import candidates, layout_problem

_GIB = 2**30


def _exhaustive(shape: ModelShape, cluster, global_batch: int, options: Options):
    """Every candidate estimated, as the search did before it had a floor."""
    rows, rejected, overflows, floors = [], {}, [], []
    for planned in candidates(shape, cluster, global_batch):
        problem = layout_problem(shape, cluster, planned, global_batch)
        if problem:
            rejected[problem] = rejected.get(problem, 0) + 1
            continue
        est = estimate(shape, cluster, planned, global_batch, options)
        floors.append(memory_floor(shape, cluster, planned, options))
        assert floors[-1] <= est.memory_bytes
        if not est.fits:
            overflows.append((est.memory_bytes - cluster.memory_gib * _GIB) / _GIB)
            rejected["does not fit in memory"] = rejected.get("does not fit in memory", 0) + 1
            continue
        rows.append(est)
    rows.sort(key=lambda e: (e.step_time_s, e.memory_bytes))
    return rows, rejected, overflows, floors


def test_pruned_search_keeps_what_an_exhaustive_one_keeps():
    # a 5B model on 8 GPUs of 40 GB: many layouts miss by their model states alone
    shape = ModelShape(name="5b", layers=8, hidden=6144, heads=48, seq=512, vocab=32000)
    cluster = replace(PRESETS["a100-40gb"], nodes=1)
    options = Options()
    rows, rejected, overflows, floors = _exhaustive(shape, cluster, 8, options)
    result = search(shape, cluster, 8, options, top=0)
    budget = cluster.memory_gib * _GIB
    # layouts that fit, layouts that miss, and layouts the floor drops unestimated
    assert rows and overflows
    assert any(f - budget > min(overflows) * _GIB for f in floors)
    assert [(e.layout, e.step_time_s) for e in result.rows] == \
        [(e.layout, e.step_time_s) for e in rows]
    assert dict(result.rejected) == rejected
    assert result.least_overflow_gib == pytest.approx(min(overflows), rel=1e-12)
    # the worst miss is a lower bound once layouts are dropped by their floor
    assert 0 < result.worst_overflow_gib <= max(overflows) * (1 + 1e-12)


def test_held_keys_keep_only_the_layouts_a_framework_offers():
    # Megatron-LM in 2021 had no sequence or context parallelism: a search with those
    # held is the unrestricted search's rows of cp 1 and sp 0, in the same order
    shape = ModelShape(name="1b", layers=8, hidden=2048, heads=16, seq=1024, vocab=32000)
    cluster = replace(PRESETS["a100-80gb"], nodes=1)
    held = (("cp", 1), ("sp", 0))
    every = search(shape, cluster, 16, top=0, zero=(0, 1))
    kept = search(shape, cluster, 16, top=0, zero=(0, 1), held=held)
    want = [e.layout for e in every.rows
            if e.layout.degree("cp") == 1 and e.layout.option("sp") == 0]
    assert want and len(want) < len(every.rows)
    assert [e.layout for e in kept.rows] == want
    assert kept.considered < every.considered
    with pytest.raises(UserError, match="'pq' is neither a dimension"):
        search(shape, cluster, 16, held=(("pq", 1),))
