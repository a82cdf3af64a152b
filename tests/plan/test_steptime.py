"""The step-time model's parts that calibration feeds: measured collectives per group,
cores shared between ranks, and the collectives each ZeRO stage issues."""

from __future__ import annotations

from dataclasses import replace

import pytest

from disttrain.config.schema import ModelConfig
from disttrain.errors import UserError
from disttrain.models.gpt import GPT
from disttrain.parallel.zero.flat import build_units
from disttrain.plan import ModelShape, Options
from disttrain.plan.cluster import PRESETS, Cluster
from disttrain.plan.costs import collective_time, compute_share, ring_time, tier
from disttrain.plan.estimate import estimate
from disttrain.plan.layout import PlannedLayout
from disttrain.shape import gpt_shape, zero_flats

CALL_S = 1e-3  # every measured collective call below costs this, whatever its size
SHAPE = ModelShape(name="small", layers=4, hidden=64, heads=4, seq=32, vocab=128)


def _latency_cluster(ranks: int) -> Cluster:
    """A cluster whose compute costs nearly nothing and whose every collective call on
    a group of ``ranks`` costs CALL_S: a step's communication is then its calls."""
    ops = {op: [CALL_S, 1e9] for op in ("all_reduce", "reduce_scatter", "all_gather")}
    return replace(PRESETS["h100"], gpus_per_node=ranks, kernel_overhead_s=0.0,
                   elementwise_overhead_s=0.0, sm_count=0, layer_overhead_s=0.0,
                   tensor_overhead_s=0.0,
                   group_links={f"{ranks}/{ranks}": ops})


def test_zero_flats_are_the_buffers_disttrain_builds():
    cfg = ModelConfig(n_layer=3, d_model=32, n_head=4, seq_len=16, vocab_size=64)
    model = GPT(cfg)
    units = build_units([(0, model, list(model.blocks))])
    flats = sum(len({p.dim() >= 2 for _, p in u.params}) for u in units)
    assert flats == zero_flats(cfg.n_layer, True, True)


def test_a_measured_group_replaces_the_ring_and_only_for_its_own_key():
    cluster = _latency_cluster(2)
    assert collective_time(cluster, "all_reduce", 5e6, 2, 2, calls=3) == pytest.approx(
        3 * CALL_S + 5e6 / 1e18)
    gbps, latency = tier(cluster, 2)
    # measured with 2 ranks busy, not 4: the ring model answers
    assert collective_time(cluster, "all_reduce", 5e6, 2, 4) == pytest.approx(
        ring_time(5e6, 2, gbps, latency))
    assert collective_time(cluster, "all_reduce", 5e6, 1, 2) == 0.0


def test_threads_beyond_the_cores_slow_every_rank():
    cpu = replace(PRESETS["h100"], gpus_per_node=4, host_cores=2, threads_per_rank=1,
                  async_dispatch=False)
    assert compute_share(cpu, 2) == 1.0 and compute_share(cpu, 4) == 2.0
    assert compute_share(replace(cpu, host_cores=0), 4) == 1.0  # a device of its own
    shape = gpt_shape(ModelConfig(n_layer=2, d_model=32, n_head=4, seq_len=16,
                                  vocab_size=64))
    two = estimate(shape, replace(cpu, gpus_per_node=2), PlannedLayout(dp=2), 8).times["compute"]
    four = estimate(shape, cpu, PlannedLayout(dp=4), 16).times["compute"]
    assert four == pytest.approx(2 * two)  # the same work per rank, half a core each


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_each_zero_stage_pays_for_the_collectives_it_issues(zero):
    """dp 2, 4 micro-batches: plain data parallelism all-reduces one bucket; ZeRO
    reduce-scatters each flat buffer once (stage 1) or per micro-batch (2, 3), gathers
    each after the step (1, 2) or before every forward and backward (3)."""
    m, flats = 4, zero_flats(SHAPE.layers, True, True)
    est = estimate(SHAPE, _latency_cluster(2), PlannedLayout(dp=2, zero=zero), 2 * m,
                   Options(log_every=1))
    calls = {0: 1, 1: 2 * flats, 2: (m + 1) * flats, 3: 3 * m * flats}[zero]
    assert est.times["dp_comm_exposed"] == pytest.approx(calls * CALL_S, rel=1e-3)
    # loss counts, the stop flag, telemetry, and the norm of sharded gradients
    assert est.times["step_sync"] == pytest.approx((3 + (zero > 0)) * CALL_S)


def test_group_links_are_checked_when_read():
    base = PRESETS["h100"].to_json()
    for bad in ({"3/4": {}}, {"2/2": {"broadcast": [1e-3, 1.0]}},
                {"2/2": {"all_reduce": [1e-3, 0]}}, {"x": {}}):
        with pytest.raises(UserError, match="group_links"):
            Cluster.from_json(base | {"group_links": bad})
    ok = Cluster.from_json(base | {"group_links": {"2/4": {"all_reduce": [1e-4, 2.0]}}})
    assert ok.group_links["2/4"]["all_reduce"] == [1e-4, 2.0]
