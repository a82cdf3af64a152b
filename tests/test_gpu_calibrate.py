"""bench/gpu_calibrate.py: its sweep times the matmuls autograd runs for a Linear, and
its ratios are measured rate over the H100 preset's predicted rate, checked against the
preset's figures worked by hand."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_calibrate  # noqa: E402

from disttrain.plan.cluster import PRESETS  # noqa: E402
from disttrain.plan.costs import matmul_time  # noqa: E402
from disttrain.plan.fit import MatmulPoint  # noqa: E402

H100 = PRESETS["h100-80gb"]


class _MatmulShapes(TorchDispatchMode):
    """Records the [m, k] x [k, n] of every aten.mm run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func is torch.ops.aten.mm.default:
            a, b = args[0], args[1]
            self.shapes.append((a.shape[0], a.shape[1], b.shape[1]))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_sweep_shapes_are_the_matmuls_of_a_linear_forward_and_backward(device):
    shapes = gpu_calibrate.sweep_shapes(device)
    tokens, hiddens = gpu_calibrate.SWEEP[device]
    assert len(shapes) == len(tokens) * len(hiddens) * 2 * 3
    for t, h in [(tokens[0], hiddens[0]), (tokens[-1], hiddens[-1])]:
        for o in (3 * h, 4 * h):
            # the reference: what plain PyTorch runs, on meta tensors (no storage)
            linear = torch.nn.Linear(h, o, bias=False, device="meta")
            x = torch.empty(t, h, device="meta", requires_grad=True)
            with _MatmulShapes() as seen:
                linear(x).backward(torch.empty(t, o, device="meta"))
            ours = [s for _, tt, hh, oo, s in shapes if (tt, hh, oo) == (t, h, o)]
            assert sorted(ours) == sorted(seen.shapes) and len(ours) == 3


def test_matmul_ratio_is_measured_over_the_preset_worked_by_hand():
    m = k = n = 8192
    # the H100 preset by hand: 989.5 TFLOP/s bf16 x 794.5/989 efficiency; 256 x 128
    # tiles: 32 x 64 = 2048 tiles in ceil(2048 / 132) = 16 waves of 132 SMs; then the
    # bf16 output written at 3350 GB/s; 5 us launch
    shape_eff = 2048 / (16 * 132)
    predicted_s = (2 * m * k * n / (989.5e12 * 794.5 / 989 * shape_eff)
                   + 2 * m * n / 3350e9 + 5e-6)
    rows = gpu_calibrate.matmul_rows(H100, [
        {"precision": "bf16", "m": m, "k": k, "n": n, "seconds": predicted_s},
        {"precision": "bf16", "m": m, "k": k, "n": n, "seconds": 2 * predicted_s}])
    # 1e-3: the rows keep four significant digits
    assert rows[0]["ratio"] == pytest.approx(1.0, rel=1e-3)
    assert rows[1]["ratio"] == pytest.approx(0.5, rel=1e-3)
    assert rows[1]["measured_tflops"] == pytest.approx(
        2 * m * k * n / (2 * predicted_s) / 1e12, rel=1e-3)
    summary = gpu_calibrate.ratio_summary(rows, "precision")
    assert summary["bf16"]["geomean"] == pytest.approx(0.5**0.5, rel=1e-3)
    assert (summary["bf16"]["min"], summary["bf16"]["n"]) == (0.5, 2)


def test_attention_and_memory_ratios_worked_by_hand():
    b, heads, s, d = 1, 32, 8192, 128
    # causal tiles of 128 keys leave (1 + 128 / s) / 2 of the square; efficiency 0.45
    # x s / (s + 256)
    flops = 4 * b * s * s * heads * d * (1 + 128 / s) / 2
    predicted_s = flops / (989.5e12 * 0.45 * s / (s + 256))
    notes = {"precision": "bf16", "points": [{"batch": b, "heads": heads, "seq": s,
                                               "head_dim": d, "seconds": 4 * predicted_s}]}
    (row,) = gpu_calibrate.attention_rows(H100, notes)
    assert row["ratio"] == pytest.approx(0.25, rel=1e-3)
    memory = gpu_calibrate.memory_row(H100, {"copy_bytes_moved": 2**31, "gbps": 2412.0})
    assert memory["ratio"] == pytest.approx(2412.0 / (3350 * 0.9), rel=1e-3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_without_cuda_it_refuses_in_one_line_with_exit_2(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_calibrate.py"),
                           str(tmp_path / "none.json")], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().count("\n") == 0 and "needs one GPU" in done.stderr


def test_sweep_fit_finds_the_efficiency_the_times_were_made_at():
    # times of the GPU sweep's 54 shapes as the preset prices them at a matmul
    # efficiency of 0.55 instead of its 0.803: the fit, which keeps the preset's peaks,
    # tiles and memory, must find 0.55 again
    slow = dataclasses.replace(H100, matmul_efficiency=0.55)
    points = [MatmulPoint(precision="bf16", m=m, k=k, n=n,
                          seconds=matmul_time(slow, m, n, k, "bf16", 2))
              for *_, (m, k, n) in gpu_calibrate.sweep_shapes("cuda")]
    fit = gpu_calibrate.sweep_fit(H100, points)
    # 1e-3: the fit's search tolerance is far below; four significant digits printed
    assert fit["matmul_efficiency"] == pytest.approx(0.55, rel=1e-3)
    assert fit["preset_matmul_efficiency"] == pytest.approx(794.5 / 989, rel=1e-3)
    assert fit["rms_rel_error"] < 1e-3
    rows = gpu_calibrate.sweep_rows(H100, [({"pass": "forward"}, p) for p in points])
    # the preset at 0.803 against times made at 0.55: the largest shape's ratio is
    # 0.55 / 0.803 but for its output write and launch, which do not scale with the
    # efficiency (under 1% of its time: the 1e-2)
    assert min(r["ratio"] for r in rows) == pytest.approx(0.55 / (794.5 / 989), rel=1e-2)
