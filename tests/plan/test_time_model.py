"""The step-time model by kind of work: matmuls by shape, attention, memory-bound
kernels, the split --explain prints, ZeRO-3's prefetch, collectives across nodes, and
the published runs bench/plan.py checks it against."""

from __future__ import annotations

from dataclasses import replace

import pytest

from disttrain.cli import main
from disttrain.plan import PRESETS, ModelShape, Options, PlannedLayout, estimate
from disttrain.plan.choose import parse_layout
from disttrain.plan.cluster import parse_cluster
from disttrain.plan.costs import (
    attention_flops,
    attention_time,
    collective_time,
    gemm_shape_efficiency,
    matmul_time,
    ring_bytes_factor,
    ring_latency_steps,
)
from disttrain.plan.published import LLM_FOUNDRY_A100, MPT_DIMS
from disttrain.plan.search import layout_problem
from disttrain.plan.steptime import SPLIT, _prefetched
from disttrain.plan.work import kernel_time_of_layer, layer_work

A100 = PRESETS["a100-80gb"]
LLAMA_7B = ModelShape(name="7b", layers=32, hidden=4096, heads=32, seq=4096,
                      vocab=32000, ffn=11008, gated=True, bias=False, tied=False,
                      norm="rmsnorm")


def test_tile_and_wave_quantisation_cost_a_matmul_its_idle_share():
    tm, tn = A100.gemm_tile
    sms = A100.sm_count
    # whole tiles filling whole waves: nothing lost
    assert gemm_shape_efficiency(A100, tm * sms, tn, 4096) == pytest.approx(1.0)
    # one more column than a tile: the second tile column is almost all padding
    assert gemm_shape_efficiency(A100, tm * sms, tn + 1, 4096) == pytest.approx(
        (tn + 1) / (2 * tn), rel=1e-9)  # two waves of tiles, the second column's empty
    # one tile more than the SMs: a second, nearly empty wave
    assert gemm_shape_efficiency(A100, tm * (sms + 1), tn, 2**20) == pytest.approx(
        (sms + 1) / (2 * sms))
    # a small output over a long contraction is split along it (split-K)
    assert gemm_shape_efficiency(A100, tm, tn, 2**20) == pytest.approx(1.0)
    # a CPU (no SMs): no quantisation
    assert gemm_shape_efficiency(replace(A100, sm_count=0), 1, 1, 1) == 1.0


def test_causal_fused_attention_skips_blocks_and_short_sequences_run_slower():
    full = 2 * 2 * 1 * 4096**2 * 4096
    assert attention_flops(A100, 1, 4096, 4096) == pytest.approx(
        full * (1 + 128 / 4096) / 2)
    assert attention_flops(replace(A100, attention_block=0), 1, 4096, 4096) == full
    half = A100.attention_seq_half
    at_half = attention_time(A100, 1, half, 4096, "bf16") / attention_flops(
        A100, 1, half, 4096)
    long = attention_time(A100, 1, 2**20, 4096, "bf16") / attention_flops(
        A100, 1, 2**20, 4096)
    assert at_half / long == pytest.approx(2 * 2**20 / (2**20 + half), rel=1e-9)


@pytest.mark.parametrize("cluster, layout, batch", [
    (A100, PlannedLayout(dp=8, mbs=2, zero=3, recompute="full"), 32),
    (replace(A100, nodes=4), PlannedLayout(dp=32, mbs=1, zero=3), 64),
    (replace(A100, nodes=2), PlannedLayout(tp=4, pp=2, dp=2, mbs=1, v=2,
                                           recompute="selective", sp=True), 16),
    (PRESETS["h100"], PlannedLayout(tp=2, dp=4, mbs=4, zero=1), 64),
    (A100, PlannedLayout(tp=2, cp=2, dp=2, mbs=1, recompute="full"), 16),
    (replace(A100, nodes=2), PlannedLayout(pp=2, cp=4, dp=2, mbs=1, zero=1), 16),
    (replace(A100, gpus_per_node=2, host_cores=2, async_dispatch=False, sm_count=0),
     PlannedLayout(dp=2, mbs=2), 8),
])
def test_the_split_explain_prints_sums_to_the_step_time(cluster, layout, batch):
    est = estimate(LLAMA_7B, cluster, layout, batch)
    assert set(est.split) == set(SPLIT)
    assert all(v >= -1e-12 for v in est.split.values()), est.split
    assert sum(est.split.values()) == pytest.approx(est.step_time_s, rel=1e-9)
    assert est.split["matmul"] > est.split["memory_bound"] > 0


def test_memory_bound_and_overhead_grow_as_the_model_shrinks():
    shares = []
    for hidden, heads in ((768, 12), (4096, 32)):
        shape = ModelShape(layers=12, hidden=hidden, heads=heads, seq=2048, vocab=50368)
        est = estimate(shape, A100, PlannedLayout(dp=8, mbs=8, zero=3), 64)
        shares.append((est.split["memory_bound"] + est.split["overhead"])
                      / est.step_time_s)
    assert shares[0] > 2 * shares[1]


def test_a_ring_across_nodes_uses_every_members_nic():
    nbytes, cluster = 2e9, replace(A100, nodes=4)
    nic = cluster.inter_gbps * 1e9

    def latency(ranks: int) -> float:
        return ring_latency_steps(ranks) * cluster.inter_latency_s

    moved = nbytes * ring_bytes_factor(32, "all_gather")
    # 32 ranks, 8 per node: the node's crossings share out over 8 NICs
    t = collective_time(cluster, "all_gather", nbytes, 32, 8)
    assert t == pytest.approx(moved / 8 / nic + latency(32), rel=1e-9)
    # one member per node (tp 8 inside): one NIC each
    t1 = collective_time(cluster, "all_gather", nbytes, 4, 8, span=32)
    assert t1 == pytest.approx(nbytes * ring_bytes_factor(4, "all_gather") / nic
                               + latency(4), rel=1e-9)
    # twice the NICs: NVLink, carrying 7/8 of what each rank moves, paces the ring
    fast = replace(cluster, inter_gbps=2 * cluster.inter_gbps)
    assert collective_time(fast, "all_gather", nbytes, 32, 8) == pytest.approx(
        moved * 7 / 8 / (cluster.intra_gbps * 1e9) + latency(32), rel=1e-9)


def test_zero3_across_nodes_is_priced_on_the_nics_and_hidden_by_prefetch():
    shape = ModelShape(layers=80, hidden=8192, heads=64, seq=2048, vocab=50368)
    lay = PlannedLayout(dp=32, mbs=2, zero=3, recompute="full")
    cluster = replace(A100, nodes=4)
    est = estimate(shape, cluster, lay, 1024, Options(accounting="mixed"))
    exposed = est.split["dp_all_gather"] + est.split["dp_reduce_scatter"]
    assert exposed < 0.05 * est.step_time_s  # prefetched behind each unit's compute
    # a network 50 times slower than the NICs can no longer hide behind compute
    slow = replace(cluster, inter_gbps=cluster.inter_gbps / 50)
    slow_est = estimate(shape, slow, lay, 1024, Options(accounting="mixed"))
    assert slow_est.split["dp_all_gather"] > 10 * est.split["dp_all_gather"]


def test_prefetch_exposes_the_first_gather_and_what_compute_does_not_cover():
    # compute longer than every unit's collectives: the first gather of each pass,
    # and the last reduce-scatter
    gathered, reduced = _prefetched(gather=4.0, reduce=8.0, forward=40.0,
                                    backward=80.0, units=4)
    assert (gathered, reduced) == pytest.approx((2 * 1.0, 2.0))
    # no compute: everything
    gathered, reduced = _prefetched(4.0, 8.0, 0.0, 0.0, 4)
    assert (gathered, reduced) == pytest.approx((8.0, 8.0))


def test_the_llm_foundry_rows_are_the_published_models_and_plan_without_refusal():
    assert len(LLM_FOUNDRY_A100) == 41 and {r.model for r in LLM_FOUNDRY_A100} == set(
        MPT_DIMS)
    for run in LLM_FOUNDRY_A100:
        shape = run.shape()
        assert shape.num_params() == run.num_params, run.label  # the table's NumParams
        assert run.seq <= 8192 and run.tokens_per_s_per_gpu > 0
        cluster = parse_cluster(run.cluster_spec())
        lay = parse_layout(run.layout_spec(), cluster.n_devices)
        assert layout_problem(shape, cluster, lay, run.global_batch) is None
        est = estimate(shape, cluster, lay, run.global_batch, Options(accounting="mixed"))
        assert est.fits and est.tokens_per_s > 0


def test_explain_prints_the_split(capsys):
    code = main(["plan", "--model", "layers=8,hidden=1024,heads=16,seq=2048,vocab=50368",
                 "--cluster", "gpu=a100-80gb,nodes=2", "--global-batch", "64",
                 "--layout", "dp=16,mbs=2,zero=3", "--explain"])
    out = capsys.readouterr().out
    assert code == 0
    line = next(x for x in out.splitlines() if x.strip().startswith("by kind:"))
    for word in ("matmul", "attention", "memory-bound ops", "framework and launch "
                 "overhead", "exposed all-gather", "optimizer"):
        assert word in line


@pytest.mark.parametrize("spec, message", [
    ("gpu=a100-80gb,elementwise_efficiency=1.5", "elementwise_efficiency"),
    ("gpu=a100-80gb,sm_count=-1", "sm_count"),
    ("gpu=a100-80gb,gemm_tile=64", "not a cluster field"),
])
def test_bad_shape_terms_are_one_line_and_exit_2(capsys, spec, message):
    code = main(["plan", "--model", "gpt", "--cluster", spec, "--global-batch", "8"])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1, err


def test_without_shape_terms_a_layer_is_the_roofline_calibration_fits():
    """A calibrated CPU file has no SMs, tiles or attention terms: a layer's kernels
    are its matmuls at the roofline, attention and the forward's bytes, the backward
    twice the forward, as ``plan calibrate`` subtracts them from a measured layer."""
    cpu = replace(PRESETS["a100-80gb"], sm_count=0, elementwise_efficiency=1.0,
                  elementwise_overhead_s=0.0, attention_seq_half=0.0, attention_block=0,
                  attention_backward_ratio=2.0)
    shape = ModelShape(layers=2, hidden=64, heads=4, seq=32, vocab=128)
    fwd, bwd, _ = layer_work(shape, cpu, 1, 2, "fp32")
    tokens, h = 2 * 32, 64
    matmuls = sum(matmul_time(cpu, tokens, o, i, "fp32", 4)
                  for _, i, o in shape.matmul_shapes())
    attention = attention_time(cpu, 2, 32, h, "fp32")
    memory = (12 * h + 2 * 4 * h) * tokens * 4 / (cpu.memory_gbps * 1e9)
    assert fwd.device == pytest.approx(matmuls + attention + memory, rel=1e-12)
    assert bwd.device == pytest.approx(2 * fwd.device, rel=1e-12)
    assert kernel_time_of_layer(shape, cpu, 2, "fp32") == pytest.approx(3 * fwd.device)
