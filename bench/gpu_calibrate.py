"""What one GPU reaches against what the planner's preset for it predicts: matmuls,
fused attention and memory bandwidth, as measured/predicted rate ratios, one JSON line.

    python bench/gpu_calibrate.py CLUSTER.json [--preset h100-80gb] [--device cpu]

``CLUSTER.json`` is what ``disttrain plan calibrate --device cuda --nproc 1`` wrote on this
GPU (``scripts/gpu_check.sh`` runs both). From its ``measured`` section:

- ``matmul``: every timed [m, k] x [k, n] matmul (bf16, fp16, fp32): measured TFLOP/s
  over :func:`disttrain.plan.costs.matmul_time`'s prediction on the preset;
- ``attention``: every causal fused-attention forward, q, k, v [batch, heads, seq,
  head_dim]: measured over :func:`~disttrain.plan.costs.attention_time`'s prediction;
- ``memory``: the large copy's GB/s (bytes read + written) over what the preset gives
  memory-bound kernels (``memory_gbps`` x ``elementwise_efficiency``).

``calibrate``'s own shapes are square-ish layers and thin ones, not a transformer's, so
this script also times, in bf16, the three matmuls of each linear layer of 1-20B models
(``sweep``): tokens t in {4096, 8192, 16384}, hidden h in {2048, 4096, 8192}, output o
in {3h (fused QKV), 4h (MLP up)}: forward [t, h] x [h, o], input gradient [t, o] x
[o, h] and weight gradient [o, t] x [t, h], as autograd runs a ``Linear``; each the
median of 10 calls after 3 warm-up calls, timed with CUDA events
(:func:`disttrain.plan.measure.median_time`); ``sweep_fit``: the matmul efficiency
(and launch overhead) with which the preset matches the sweep best. A ratio below 1 is
where the planner is optimistic. ``--device cpu`` times tiny shapes instead: only the dry
run of ``scripts/gpu_check.sh``. Without CUDA (and without ``--device cpu``) it prints
one line on stderr and exits 2.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from disttrain.plan.cluster import PRESETS, Cluster, preset_for_device
from disttrain.plan.costs import ACT_BYTES, attention_time, matmul_time
from disttrain.plan.fit import MatmulPoint, fit_matmul
from disttrain.plan.measure import Effort, time_matmul

# (tokens, hidden) of the sweep; output widths are 3h and 4h of each hidden
SWEEP = {"cuda": ((4096, 8192, 16384), (2048, 4096, 8192)),
         "cpu": ((128, 256), (64, 128))}
SWEEP_EFFORT = Effort(repeats=10, warmup=3, seconds=2.0)


def matmul_rows(preset: Cluster, points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per measured matmul: its shape, measured and predicted TFLOP/s, ratio."""
    rows = []
    for p in points:
        m, k, n, precision = p["m"], p["k"], p["n"], p["precision"]
        predicted = matmul_time(preset, m, n, k, precision, ACT_BYTES[precision])
        rows.append(_rate_row({"precision": precision, "m": m, "k": k, "n": n},
                              2 * m * k * n, p["seconds"], predicted))
    return rows


def attention_rows(preset: Cluster, notes: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per measured attention forward (FLOPs as ``attention_time`` counts them
    at ``attention_block`` 0: the whole s x s square, so the ratio does not depend on it)."""
    rows = []
    for p in notes["points"]:
        b, s, width = p["batch"], p["seq"], p["heads"] * p["head_dim"]
        predicted = attention_time(preset, b, s, width, notes["precision"])
        rows.append(_rate_row({k: p[k] for k in ("batch", "heads", "seq", "head_dim")},
                              4 * b * s * s * width, p["seconds"], predicted))
    return rows


def memory_row(preset: Cluster, notes: dict[str, Any]) -> dict[str, Any]:
    predicted = preset.memory_gbps * preset.elementwise_efficiency
    return {"bytes_moved": notes["copy_bytes_moved"], "measured_gbps": _sig(notes["gbps"]),
            "predicted_gbps": _sig(predicted), "datasheet_gbps": preset.memory_gbps,
            "ratio": _sig(notes["gbps"] / predicted)}


def sweep_shapes(device: str) -> list[tuple[str, int, int, int, tuple[int, int, int]]]:
    """(pass, tokens, hidden, out, (m, k, n)) of each linear layer's three matmuls."""
    tokens, hiddens = SWEEP[device]
    shapes = []
    for t in tokens:
        for h in hiddens:
            for o in (3 * h, 4 * h):
                shapes += [("forward", t, h, o, (t, h, o)),
                           ("input_grad", t, h, o, (t, o, h)),
                           ("weight_grad", t, h, o, (o, t, h))]
    return shapes


def time_sweep(device: torch.device) -> list[tuple[dict[str, Any], MatmulPoint]]:
    """Times every :func:`sweep_shapes` matmul in bf16 on ``device``: (what it is,
    its point) each."""
    return [({"pass": name, "tokens": t, "hidden": h, "out": o},
             time_matmul(device, "bf16", shape, SWEEP_EFFORT))
            for name, t, h, o, shape in sweep_shapes(device.type)]


def sweep_rows(preset: Cluster, timed: list[tuple[dict[str, Any], MatmulPoint]]
               ) -> list[dict[str, Any]]:
    """One row per swept matmul: its shape, measured and predicted TFLOP/s, ratio."""
    rows = []
    for key, p in timed:
        predicted = matmul_time(preset, p.m, p.n, p.k, p.precision, ACT_BYTES[p.precision])
        rows.append(_rate_row(key | {"m": p.m, "k": p.k, "n": p.n}, p.flops, p.seconds,
                              predicted))
    return rows


def sweep_fit(preset: Cluster, points: list[MatmulPoint]) -> dict[str, Any]:
    """The ``matmul_efficiency`` and ``kernel_overhead_s`` with which the preset (its
    peaks, tiles and memory kept) matches the sweep best
    (:func:`disttrain.plan.fit.fit_matmul`): what the planner would need to price
    these shapes as this GPU runs them."""
    fit = fit_matmul(preset, points)
    return {"matmul_efficiency": _sig(fit.efficiency),
            "preset_matmul_efficiency": _sig(preset.matmul_efficiency),
            "kernel_overhead_s": _sig(fit.overhead_s),
            "rms_rel_error": _sig(math.sqrt(statistics.fmean(e * e for e in fit.rel_errors)))}


def _rate_row(key: dict[str, Any], flops: float, measured_s: float,
              predicted_s: float) -> dict[str, Any]:
    return key | {"measured_tflops": _sig(flops / measured_s / 1e12),
                  "predicted_tflops": _sig(flops / predicted_s / 1e12),
                  "ratio": _sig(predicted_s / measured_s)}


def _sig(x: float) -> float:
    """``x`` to four significant digits (a CPU's dry run has ratios of 1e-4)."""
    return float(f"{x:.4g}")


def ratio_summary(rows: list[dict[str, Any]], by: str | None = None) -> dict[str, Any]:
    """Geometric mean, min and max of the rows' ratios (per value of ``by``, if given)."""
    groups: dict[str, list[float]] = {}
    for r in rows:
        groups.setdefault(str(r[by]) if by else "all", []).append(r["ratio"])
    return {g: {"geomean": _sig(math.exp(statistics.fmean(map(math.log, v)))),
                "min": min(v), "max": max(v), "n": len(v)} for g, v in groups.items()}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("cluster", type=Path, help="the file 'disttrain plan calibrate' wrote")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="the preset to compare with (default: this GPU's, else h100-80gb)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (default); cpu only to dry-run this script at tiny shapes")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_calibrate: no CUDA device: this benchmark needs one GPU", file=sys.stderr)
        sys.exit(2)
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "none (cpu)"
    name = args.preset or preset_for_device(gpu) or "h100-80gb"
    preset = PRESETS[name]
    measured = json.loads(args.cluster.read_text())["measured"]
    matmuls = matmul_rows(preset, measured["matmul"]["points"])
    attention = attention_rows(preset, measured["attention"])
    timed = time_sweep(device)
    sweep = sweep_rows(preset, timed)
    print(json.dumps({
        "bench": "gpu_calibrate", "gpu": gpu, "torch": torch.__version__, "preset": name,
        "calibrated": measured["device"], "quick": measured["quick"],
        "ratio": "measured rate / the preset's predicted rate (below 1: the planner is "
                 "optimistic)",
        "matmul_summary": ratio_summary(matmuls, "precision"),
        "sweep_summary": ratio_summary(sweep, "pass") | ratio_summary(sweep),
        "sweep_fit": sweep_fit(preset, [p for _, p in timed]),
        "attention_summary": ratio_summary(attention),
        "memory": memory_row(preset, measured["memory"]),
        "matmul": matmuls, "sweep": sweep, "attention": attention}))


if __name__ == "__main__":
    main()
