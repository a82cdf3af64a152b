"""What the search leaves out: its memory floor drops layouts without estimating them
(only layouts that do not fit: it keeps every row an exhaustive search keeps and
reports the same closest miss), its candidates leave out the options no schedule takes
(only those: every layout the rules accept is still generated), and ``held`` keys leave
out what a framework lacks."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from disttrain.errors import UserError
from disttrain.parallel.dimensions import BEHAVIOURS
from disttrain.plan import PRESETS, ModelShape, Options, estimate, search
from disttrain.plan.estimate import memory_floor
from disttrain.plan.layout import PlannedLayout
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


def test_candidates_leave_out_only_the_options_no_schedule_takes():
    # the reference: every degree split of 8 devices, every value of every option key
    # (interleaving up to 8, each zero-bubble schedule, sequence parallelism), unpruned;
    # the search's candidates must keep every one of them the rules accept
    shape = ModelShape(name="tiny", layers=4, hidden=512, heads=8, seq=256, vocab=32000)
    cluster = replace(PRESETS["a100-80gb"], nodes=1)
    n, batch, zero, recompute = cluster.n_devices, 16, (0, 1), ("none", "full")
    reference = [
        PlannedLayout(tp=tp, pp=pp, cp=cp, dp=n // (tp * pp * cp), v=v, zb=zb, sp=sp,
                      mbs=mbs, zero=z, recompute=r)
        for tp, pp, cp in itertools.product((1, 2, 4, 8), repeat=3) if n % (tp * pp * cp) == 0
        for v, zb, sp in itertools.product(range(1, 9), (0, 1, 2), (0, 1))
        for mbs, z, r in itertools.product((1, 2), zero, recompute)]
    pruned = list(candidates(shape, cluster, batch, max_mbs=2, zero=zero,
                             recompute=recompute))

    def taken(layouts):
        return {p for p in layouts if layout_problem(shape, cluster, p, batch) is None}

    assert len(set(pruned)) == len(pruned) < len(reference) / 2
    assert set(pruned) <= set(reference)
    assert taken(pruned) == taken(reference)
    # what is left out is left out by a dimension's rule on its options alone, the rule
    # that rejects it (every left-out layout breaks one; a kept one breaks none)
    def options_problem(p):
        return next((r for r in (b.pricing.options_problem(p) for b in BEHAVIOURS) if r),
                    None)
    reasons = {options_problem(p) for p in set(reference) - set(pruned)}
    assert not any(options_problem(p) for p in pruned)
    assert reasons == {"interleaving needs pp > 1", "sp needs tp > 1",
                       "zero bubble needs pp > 1, no gpipe, and v = 1 (zb1) or 2 (zbv)"}
    # and the zero-bubble and interleaved schedules are among the layouts kept
    assert {(p.option("v"), p.option("zb")) for p in taken(pruned)} >= {(1, 1), (2, 2), (2, 0)}
