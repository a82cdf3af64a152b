"""examples/digits.py end to end: launched by ``disttrain run`` on two Gloo workers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # spawns worlds or trains: not in the quick check

pytest.importorskip("sklearn")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "digits.py"
DISTTRAIN = Path(sys.executable).with_name("disttrain")
# An untrained 10-way classifier scores about 0.1; 100 steps reach about 0.94.
MIN_ACCURACY = 0.85


def test_digits_example_trains_on_two_workers(tmp_path):
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [str(DISTTRAIN), "run", "--nproc", "2", str(EXAMPLE), "--steps", "100",
         "--run-dir", str(run_dir)],
        cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2
    assert summary["steps"] == 100

    accuracy = json.loads((run_dir / "accuracy.json").read_text())["held_out_accuracy"]
    assert accuracy > MIN_ACCURACY
    assert f"held-out accuracy {accuracy:.3f}" in result.stdout
