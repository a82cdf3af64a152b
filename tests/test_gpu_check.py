"""scripts/gpu_check.sh starts and finishes: its CPU dry run (DISTTRAIN_GPU_SET_ON_CPU=1)
of the environment, MFU, calibrate, pretrained and profile sections, into $OUT (the whole dry run,
with the GPU set and the jobs, takes minutes: `bench/README.md` records it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from disttrain.plan.cluster import Cluster

pytestmark = pytest.mark.slow  # spawns worlds or trains: not in the quick check

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run_writes_its_summary_and_json(tmp_path):
    env = {**os.environ, "DISTTRAIN_GPU_SET_ON_CPU": "1",
           "GPU_CHECK_ONLY": "env mfu calibrate pretrained profile", "OUT": str(tmp_path),
           "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    summary = (tmp_path / "summary.txt").read_text().split("\n")
    assert [line.split()[:2] for line in summary if line] == [
        ["env", "ok"], ["mfu_eager", "ok"], ["mfu_compile", "ok"], ["calibrate", "ok"],
        ["profile", "ok"], ["pretrained", "ok"]]
    lines = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().split("\n")
             if line]
    assert lines[0]["check"] == "env" and lines[0]["cuda_available"] is False
    benches = [d for d in lines if d.get("bench") == "gpu_mfu"]
    # one line per micro-batch x fused-loss pair, eager then compiled
    assert [(d["compile"], d["disttrain_fused_loss"]) for d in benches] == [
        (False, False), (False, True), (True, False), (True, True)]
    assert all("vs_plain" in d["targets"] for d in benches)
    assert all(d["disttrain_device"] == "cpu" and d["disttrain_tokens_per_s"] > 0
               for d in benches)
    for d in benches:  # two alternated runs a side; the pair's ratio is of the medians
        ours, plain = d["disttrain_tokens_per_s_runs"], d["plain_tokens_per_s_runs"]
        assert d["repeats"] == len(ours) == len(plain) == 2
        # the printed rates are rounded to 0.1 tokens/s and the ratios to 4 decimals
        # (1e-4 absolute: a CPU's first fused-loss run can be 0.01x, 0.0095 printed);
        # 1e-3 relative covers the rates' rounding
        assert d["disttrain_vs_plain_runs"] == pytest.approx(
            [a / b for a, b in zip(ours, plain, strict=True)], rel=1e-3, abs=1e-4)
        assert d["disttrain_vs_plain"] == pytest.approx(sum(ours) / sum(plain), rel=1e-3,
                                                        abs=1e-4)
    _check_calibrate(tmp_path, lines)
    (profiled,) = [d for d in lines if d.get("check") == "gpu_profile"]
    kinds = ("matmul", "attention", "memory_bound", "optimizer")
    assert [r["side"] for r in profiled["rows"]] == ["disttrain", "plain"]
    for r in profiled["rows"]:  # each side's time by kind; the matmuls take some
        assert set(r["kinds_ms"]) == set(kinds) and r["kinds_ms"]["matmul"] > 0
    assert profiled["planner"]["preset"] == "h100" and profiled["planner"]["step_ms"] > 0
    loaded = [d for d in lines if d.get("check") == "pretrained"]
    assert len(loaded) == 1 and loaded[0]["loss_difference"] < 1e-4
    assert summary[-1] == "" and "=== summary" in done.stdout


def _check_calibrate(out: Path, lines: list[dict]) -> None:
    """The calibrate section wrote a cluster file plan --cluster reads, and its report
    has a row for each matmul and attention shape the file holds, and the sweep's."""
    data = json.loads((out / "cluster_gpu.json").read_text())
    Cluster.from_json(data, "cluster_gpu.json")
    (report,) = [d for d in lines if d.get("bench") == "gpu_calibrate"]
    measured = data["measured"]
    assert [(r["m"], r["k"], r["n"]) for r in report["matmul"]] == [
        (p["m"], p["k"], p["n"]) for p in measured["matmul"]["points"]]
    assert len(report["attention"]) == len(measured["attention"]["points"])
    assert len(report["sweep"]) == 24 and report["preset"] == "h100-80gb"
    rows = report["matmul"] + report["attention"] + report["sweep"]
    assert all(r["ratio"] > 0 and r["measured_tflops"] > 0 for r in rows)
    assert 0 < report["sweep_fit"]["matmul_efficiency"] <= 1
    assert report["memory"]["measured_gbps"] == pytest.approx(measured["memory"]["gbps"],
                                                              rel=1e-3)
