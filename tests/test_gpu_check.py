"""scripts/gpu_check.sh starts and finishes: its CPU dry run (DISTTRAIN_GPU_SET_ON_CPU=1)
of the environment, MFU, pretrained and profile sections, into $OUT (the whole dry run,
with the GPU set and the jobs, takes minutes: `bench/README.md` records it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # spawns worlds or trains: not in the quick check

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run_writes_its_summary_and_json(tmp_path):
    env = {**os.environ, "DISTTRAIN_GPU_SET_ON_CPU": "1",
           "GPU_CHECK_ONLY": "env mfu pretrained profile", "OUT": str(tmp_path),
           "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    summary = (tmp_path / "summary.txt").read_text().split("\n")
    assert [line.split()[:2] for line in summary if line] == [
        ["env", "ok"], ["mfu_eager", "ok"], ["mfu_compile", "ok"], ["pretrained", "ok"],
        ["profile", "ok"]]
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
    loaded = [d for d in lines if d.get("check") == "pretrained"]
    assert len(loaded) == 1 and loaded[0]["loss_difference"] < 1e-4
    assert summary[-1] == "" and "=== summary" in done.stdout
