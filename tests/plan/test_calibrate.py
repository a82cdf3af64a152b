"""``plan calibrate``: the fits recover the constants that generated synthetic timings,
the link fields reproduce measured collectives through ``ring_time``, and the command
writes a cluster file that ``plan`` reads (on a CPU, two Gloo ranks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

import disttrain
from disttrain.cli import main
from disttrain.plan import PRESETS, Cluster, parse_cluster
from disttrain.plan.calibrate import (
    calibrate,
    calibrate_options,
    call_center,
    group_fits,
    link_fields,
)
from disttrain.plan.costs import matmul_time, ring_time
from disttrain.plan.fit import MatmulPoint, fit_line, fit_matmul
from disttrain.plan.measure import Effort, group_sizes, link_times
from disttrain.testing import run_distributed

SIZES = [4 * 2**10 * 4**i for i in range(8)]  # 4 KiB .. 64 MiB
REL = 1e-6


@pytest.mark.parametrize("latency, gbps", [(25e-6, 12.5), (0.9e-3, 1.1), (0.0, 300.0)])
def test_fit_line_recovers_latency_and_bandwidth(latency, gbps):
    times = [latency + s / (gbps * 1e9) for s in SIZES]
    fit = fit_line(SIZES, times)
    assert fit.latency_s == pytest.approx(latency, rel=REL, abs=1e-15)
    assert fit.gbps == pytest.approx(gbps, rel=REL)
    assert max(map(abs, fit.rel_errors)) < REL


def test_fit_line_never_returns_a_negative_latency():
    fit = fit_line(SIZES, [s / 5e9 - 0.3e-6 for s in SIZES])  # the best line's is < 0
    assert fit.latency_s == 0.0 and 5.0 < fit.gbps < 6.0  # through the origin
    with pytest.raises(ValueError, match="do not grow"):
        fit_line(SIZES, [1e-3] * len(SIZES[:-1]) + [5e-4])


SHAPES = [(1024, 1024, 1024), (4096, 4096, 4096), (8192, 8192, 8192), (8192, 4096, 16),
          (16, 4096, 4096), (128, 256, 256)]


CPU = {"peak_tflops": {"fp32": 0.075, "bf16": 0.0012}, "memory_gbps": 10.0}


@pytest.mark.parametrize("preset, efficiency, overhead, device", [
    ("h100", 0.63, 7e-6, {}),      # a GPU: compute- and memory-bound shapes
    ("a100", 0.97, 0.0, {}),       # no overhead at all
    ("h100", 0.9, 1e-4, CPU),      # a CPU's peaks and memory, a large overhead
])
def test_fit_matmul_recovers_efficiency_and_overhead(preset, efficiency, overhead, device):
    true = replace(PRESETS[preset], matmul_efficiency=efficiency, kernel_overhead_s=overhead,
                   **device)
    points = [MatmulPoint(precision=p, m=m, k=k, n=n,
                          seconds=matmul_time(true, m, n, k, p, 4 if p == "fp32" else 2))
              for p in ("bf16", "fp32") for m, k, n in SHAPES]
    start = replace(true, matmul_efficiency=1.0, kernel_overhead_s=0.0)
    fit = fit_matmul(start, points)
    assert fit.efficiency == pytest.approx(efficiency, rel=REL)
    assert fit.overhead_s == pytest.approx(overhead, rel=REL, abs=1e-12)
    assert max(map(abs, fit.rel_errors)) < REL


@pytest.mark.parametrize("ranks", [2, 4])
def test_link_fields_reproduce_the_measured_collectives(ranks):
    """What ``plan`` predicts from the written fields is what was measured."""
    def line(latency, gbps):
        return [latency + s / (gbps * 1e9) for s in SIZES]

    ops = {"all_reduce": line(40e-6, 3.0), "reduce_scatter": line(30e-6, 5.0),
           "all_gather": line(30e-6, 6.0), "p2p": line(10e-6, 8.0)}
    # every rank saw three calls per size; the slowest rank's call counts, and a GPU's
    # figures (batch means) stand by their median
    per_rank = [{op: [[t * (1 + 0.01 * r), t, t] for t in ts] for op, ts in ops.items()}
                for r in range(ranks)]
    fields, notes = link_fields(SIZES, per_rank, call_center(cuda=True))
    cluster = replace(PRESETS["h100"], gpus_per_node=ranks, **fields)
    for size, measured in zip(SIZES, ops["all_reduce"], strict=False):
        assert ring_time(size, ranks, cluster.intra_gbps, cluster.intra_latency_s) == \
            pytest.approx(measured, rel=REL)
    assert cluster.p2p_intra_gbps == pytest.approx(8.0, rel=REL)
    assert (cluster.inter_gbps, cluster.inter_latency_s) == (cluster.intra_gbps,
                                                             cluster.intra_latency_s)
    assert notes["p2p"]["latency_s"] == pytest.approx(10e-6, rel=REL)
    json.dumps(notes)


def test_a_cpu_s_calls_are_fitted_through_their_mean():
    """On a CPU each figure is one call and a step pays their mean: a size whose calls
    are 1 ms, 1 ms and 4 ms (the slowest rank's) is priced at 2 ms, not at 1."""
    slow = [[1e-3, 1e-3, 4e-3], [2e-3, 2e-3, 5e-3]]  # two sizes, three calls each
    per_rank = [{op: [[t * 0.5 for t in calls] for calls in slow]
                 for op in ("all_reduce", "reduce_scatter", "all_gather")},
                {op: slow for op in ("all_reduce", "reduce_scatter", "all_gather")}]
    sizes = [4096, 2**20 + 4096]
    fits, notes = group_fits(sizes, per_rank, call_center(cuda=False))
    assert notes["all_reduce"]["seconds"] == pytest.approx([2e-3, 3e-3])
    latency, gbps = fits["all_reduce"]
    assert latency + 4096 / (gbps * 1e9) == pytest.approx(2e-3)
    assert group_fits(sizes, per_rank, call_center(cuda=True))[1]["all_reduce"][
        "seconds"] == pytest.approx([1e-3, 2e-3])


def test_one_rank_measures_the_device_alone(tmp_path):
    """No ranks to start: links stand in at the memory bandwidth (unused by one device),
    and the result survives the JSON round trip."""
    cluster = calibrate(calibrate_options(str(tmp_path / "one.json"), 1, "cpu", True))
    assert cluster.gpus_per_node == 1
    assert cluster.intra_gbps == cluster.inter_gbps == cluster.memory_gbps
    assert "no link" in cluster.measured["links"]["note"]
    assert Cluster.from_json(json.loads(json.dumps(cluster.to_json()))) == cluster


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(Path(disttrain.__file__).parents[1]))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    return subprocess.run([sys.executable, "-m", "disttrain", *args], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=120)


def test_quick_calibration_writes_a_cluster_that_plan_reads(tmp_path, capsys):
    (tmp_path / "tmp").mkdir()
    proc = _cli("plan", "calibrate", "--out", "tmp/c.json", "--nproc", "2", "--quick",
                "--device", "cpu", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "wrote tmp/c.json" in proc.stdout
    path = tmp_path / "tmp" / "c.json"
    cluster = parse_cluster(str(path))
    assert (cluster.gpus_per_node, cluster.nodes) == (2, 1)
    assert cluster.source.startswith("calibrated:") and "measured" in cluster.source
    assert cluster.peak_tflops["fp32"] > 0 and 0 < cluster.matmul_efficiency <= 1
    assert cluster.intra_gbps > 0 and cluster.p2p_intra_gbps > 0
    assert cluster.p2p_latency_s > 0 and cluster.microbatch_overhead_s >= 0
    # a CPU: its ranks share the cores; the group of both ranks was measured as such
    assert cluster.host_cores == os.cpu_count() and cluster.threads_per_rank >= 1
    assert set(cluster.group_links) == {"2/2"}
    assert set(cluster.group_links["2/2"]) == {"all_reduce", "reduce_scatter",
                                               "all_gather"}
    links = cluster.measured["links"]
    assert all(len(links[op]["seconds"]) == len(links["sizes_bytes"])
               for op in ("all_reduce", "reduce_scatter", "all_gather", "p2p"))
    capsys.readouterr()
    assert main(["plan", "--model", "gpt", "--cluster", str(path), "--global-batch", "8",
                 "--json", "--top", "1"]) == 0
    row = json.loads(capsys.readouterr().out)[0]
    assert row["tp"] * row["pp"] * row["dp"] == 2 and row["step_time_s"] > 0


@pytest.mark.parametrize("args, named", [
    (["--out", "no/such/dir/c.json"], "no/such/dir"),
    (["--out", "c.txt"], "c.txt"),
    (["--out", "c.json", "--nproc", "0"], "--nproc 0"),
])
def test_bad_input_is_one_line_and_exit_2_before_anything_runs(args, named, tmp_path,
                                                               capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "calibrate", *args, "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and named in err
    assert list(tmp_path.iterdir()) == []


def test_calibrate_help_and_plain_plan_parse(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "calibrate", "--help"])
    assert exit_.value.code == 0 and "--out FILE.json" in capsys.readouterr().out
    assert main(["plan", "--model", "layers=2,hidden=64,heads=2,seq=32,vocab=100",
                 "--cluster", "gpu=h100,gpus_per_node=2", "--global-batch", "4",
                 "--top", "1"]) == 0


def test_groups_inside_a_world_are_timed_at_once_and_fitted():
    """In a world of 4, both groups of 2 time their collectives together; every rank
    reports its own group's calls, and the fit turns them into a group_links entry."""
    assert group_sizes(4) == [2, 4] and group_sizes(8) == [2, 4, 8]
    assert group_sizes(6) == [2, 4, 6] and group_sizes(1) == []
    effort = Effort(repeats=2, warmup=0, seconds=0.0)
    per_rank = run_distributed(link_times, 4, args=([4096, 2**22], effort, [2, 4]),
                               timeout=60)
    assert all(set(r["groups"]) == {2} for r in per_rank)
    fits, notes = group_fits([4096, 2**22], [r["groups"][2] for r in per_rank],
                             call_center(cuda=False))
    assert set(fits) == {"all_reduce", "reduce_scatter", "all_gather"}
    assert all(lat >= 0 and gbps > 0 for lat, gbps in fits.values())
    Cluster.from_json(PRESETS["h100"].to_json() | {"group_links": {"2/4": fits}})
