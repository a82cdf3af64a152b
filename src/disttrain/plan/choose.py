"""``disttrain plan``: parse the model, the cluster and the layout, search or estimate,
and print a table, JSON rows, an explanation, or a config that ``disttrain train`` runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..errors import UserError
from .cluster import Cluster, parse_cluster
from .estimate import ACCOUNTING, RECOMPUTE, Estimate, Layout, Options, estimate
from .search import SearchResult, layout_problem, search
from .shape import ModelShape, parse_model

_GIB = 2**30
_LAYOUT_KEYS = ("tp", "pp", "dp", "mbs", "v", "zero", "recompute", "sp", "gpipe")
DEFAULT_CLUSTER = "gpu=a100-80gb,gpus_per_node=8,nodes=1"


def add_plan_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    plan = sub.add_parser(
        "plan", help="choose and explain a parallel layout for a model on a cluster",
        description="Predict the memory and step time of training a model with every valid "
        "layout (tp x pp x dp, micro-batch, ZeRO stage, recomputation, sequence "
        "parallelism) on a cluster, and show the fastest that fit; or one layout "
        "(--layout). Presets: a100-40gb, a100-80gb, h100-80gb, h200; measure this "
        "machine with 'disttrain plan calibrate'.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  disttrain plan --model layers=32,hidden=4096,heads=32,seq=4096,"
        "vocab=32000 --cluster gpu=h100-80gb,gpus_per_node=8,nodes=4 --global-batch 512\n"
        "  disttrain plan --model config.json,seq=2048 --cluster gpu=a100-80gb,nodes=2 "
        "--global-batch 256 --layout tp=8,pp=1,dp=2,mbs=2,zero=1 --explain\n"
        "  disttrain plan calibrate --out cluster.json  # then: --cluster cluster.json")
    plan.add_argument("--model", metavar="SPEC", help="layers=L,hidden=H,heads=A,seq=S,"
                      "vocab=V[,ffn=F][,kv_heads=K][,gated=1], a transformers config.json "
                      "(optionally followed by ,seq=S), or gpt (the [model] of --config)")
    plan.add_argument("--config", metavar="TOML", default=None,
                      help="a disttrain config: its [model] for --model gpt")
    plan.add_argument("--cluster", metavar="SPEC", default=None,
                      help="gpu=PRESET,gpus_per_node=G,nodes=N[,memory_gib=..] or a cluster "
                      "JSON file (default: one node of 8 A100-80GB; with --validate, the "
                      "preset of the run's GPU)")
    plan.add_argument("--global-batch", type=int, metavar="B", help="sequences per step")
    plan.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default="bf16")
    plan.add_argument("--accounting", choices=ACCOUNTING, default="disttrain",
                      help="model-state bytes: disttrain (fp32 params/grads/Adam, 16 B per "
                      "param) or mixed (the ZeRO paper's 2+2+12)")
    plan.add_argument("--layout", metavar="K=V,...", default=None,
                      help="estimate this layout only: tp,pp,dp,mbs,v,zero,recompute,sp "
                      "(gpipe=1: the GPipe schedule instead of 1F1B)")
    plan.add_argument("--recompute", default=",".join(RECOMPUTE), metavar="LIST",
                      help="recomputation modes the search may use (default all)")
    plan.add_argument("--top", type=int, default=5, metavar="K", help="rows shown (5)")
    plan.add_argument("--json", action="store_true", help="print a JSON array of rows")
    plan.add_argument("--explain", action="store_true",
                      help="why the best layout wins, and what the next-best loses")
    plan.add_argument("--emit-config", metavar="OUT.toml", default=None,
                      help="write the best layout as a config 'disttrain train' runs")
    plan.add_argument("--trace", metavar="OUT.json", default=None,
                      help="Chrome trace of one simulated step of the best layout")
    plan.add_argument("--validate", metavar="RUN_DIR", default=None,
                      help="compare the prediction for a finished run with what it "
                      "measured")
    commands = plan.add_subparsers(dest="plan_command", metavar="{calibrate}",
                                   parser_class=type(plan))
    _add_calibrate_parser(commands)
    return plan


def _add_calibrate_parser(sub: argparse._SubParsersAction) -> None:
    cal = sub.add_parser(
        "calibrate", help="measure this machine and write it as a cluster JSON file",
        description="Time matmuls, fused attention, a large memory copy and collectives "
        "(all-reduce, reduce-scatter, all-gather, point-to-point) over N local ranks, fit "
        "the planner's cost model to them, and write a cluster file for "
        "'disttrain plan --cluster FILE.json'. Under a minute; --quick: seconds.")
    cal.add_argument("--out", required=True, metavar="FILE.json",
                     help="cluster file to write")
    cal.add_argument("--nproc", type=int, default=None, metavar="N",
                     help="ranks (devices) on this node (default: the GPUs, or 2 on a CPU)")
    cal.add_argument("--device", choices=("cpu", "cuda"), default=None,
                     help="what to measure (default: cuda when a GPU is visible)")
    cal.add_argument("--quick", action="store_true",
                     help="fewer and smaller measurements (rougher figures)")


def parse_layout(text: str, n_devices: int) -> Layout:
    values: dict[str, Any] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, eq, value = item.partition("=")
        if not eq or key not in _LAYOUT_KEYS:
            raise UserError(f"--layout item {item!r}: expected key=value with a key among "
                            f"{', '.join(_LAYOUT_KEYS)}")
        if key == "recompute":
            if value not in RECOMPUTE:
                raise UserError(f"--layout recompute={value!r}: use one of "
                                f"{', '.join(RECOMPUTE)}")
            values[key] = value
            continue
        try:
            values[key] = int(value)
        except ValueError:
            raise UserError(f"--layout {key}={value!r} is not an integer") from None
        if values[key] < (0 if key in ("zero", "sp", "gpipe") else 1):
            raise UserError(f"--layout {key}={value} is out of range")
    values["sp"] = bool(values.get("sp", 0))
    values["gpipe"] = bool(values.get("gpipe", 0))
    tp, pp = values.get("tp", 1), values.get("pp", 1)
    if "dp" not in values:
        if n_devices % (tp * pp):
            raise UserError(f"--layout tp x pp = {tp * pp} does not divide the cluster's "
                            f"{n_devices} devices")
        values["dp"] = n_devices // (tp * pp)
    return Layout(**values)


def _shape(ns: argparse.Namespace) -> ModelShape:
    if not ns.model:
        raise UserError("plan needs --model (layers=..,hidden=..,heads=..,seq=..,vocab=.., "
                        "a config.json, or gpt)")
    gpt = None
    if ns.config:
        from ..config import load_config

        gpt = load_config(Path(ns.config)).model
    return parse_model(ns.model, gpt=gpt)


def run_plan(ns: argparse.Namespace) -> int:
    if getattr(ns, "plan_command", None) == "calibrate":
        from .calibrate import run_calibrate

        return run_calibrate(ns)
    if ns.validate:
        from .accuracy import run_validate

        return run_validate(ns)
    shape, cluster = _shape(ns), parse_cluster(ns.cluster or DEFAULT_CLUSTER)
    if ns.global_batch is None:
        raise UserError("plan needs --global-batch B (sequences per optimizer step)")
    options = Options(precision=ns.precision, accounting=ns.accounting)
    recompute = tuple(x.strip() for x in ns.recompute.split(",") if x.strip())
    bad = [r for r in recompute if r not in RECOMPUTE]
    if bad or not recompute:
        raise UserError(f"--recompute {ns.recompute!r}: list some of {', '.join(RECOMPUTE)}")
    if ns.layout:
        lay = parse_layout(ns.layout, cluster.n_devices)
        problem = layout_problem(shape, cluster, lay, ns.global_batch)
        if problem:
            raise UserError(f"--layout {lay.label()}: {problem}")
        rows = [estimate(shape, cluster, lay, ns.global_batch, options, all_stages=True)]
        result = SearchResult(rows=rows, considered=1)
    else:
        result = search(shape, cluster, ns.global_batch, options,
                        top=max(ns.top, 2), recompute=recompute)
        if not result.rows:
            raise UserError(_nothing_fits(shape, cluster, result))
    shown = result.rows[:max(ns.top, 1)]
    if ns.json:
        print(json.dumps([_json_row(e, result) for e in shown]))
    else:
        print(_table(shape, cluster, ns.global_batch, options, shown, result))
    if ns.explain:
        print(explain(result.rows, shape, cluster))
    if ns.emit_config:
        from .emit import write_config

        path = write_config(Path(ns.emit_config), shape, ns, result.rows[0])
        print(f"wrote {path}", file=sys.stderr if ns.json else sys.stdout)
    if ns.trace:
        from .trace import write_trace

        path = write_trace(Path(ns.trace), shape, cluster, result.rows[0],
                           ns.global_batch, options)
        print(f"wrote {path}", file=sys.stderr if ns.json else sys.stdout)
    return 0


def _nothing_fits(shape: ModelShape, cluster: Cluster, result: SearchResult) -> str:
    why = ", ".join(f"{k}: {v}" for k, v in result.rejections().items())
    return (f"no layout of {shape.name} ({shape.num_params() / 1e9:.2f}B parameters) fits "
            f"{cluster.n_devices} x {cluster.name} ({cluster.memory_gib:.0f} GiB each); the "
            f"closest is over by {result.least_overflow_gib:.1f} GiB ({why}); add devices, "
            "lower the micro-batch or the sequence, or use a larger device")


def _json_row(e: Estimate, result: SearchResult) -> dict:
    row = e.row()
    row["rejected"] = result.rejections()
    row["considered"] = result.considered
    return row


def _table(shape: ModelShape, cluster: Cluster, global_batch: int, options: Options,
           rows: list[Estimate], result: SearchResult) -> str:
    head = (f"{shape.name}: {shape.num_params() / 1e9:.3f}B parameters, {shape.layers} "
            f"layers, hidden {shape.hidden}, seq {shape.seq}; {cluster.n_devices} x "
            f"{cluster.name} ({cluster.source}); global batch {global_batch}, "
            f"{options.precision}, {options.accounting} accounting")
    cols = ("tp", "pp", "dp", "v", "mbs", "zero", "recompute", "sp", "step_s", "TF/s/gpu",
            "MFU", "tokens/s", "mem_GiB", "bottleneck")
    lines = [head, "  ".join(f"{c:>9}" for c in cols)]
    for e in rows:
        r = e.row()
        vals = (r["tp"], r["pp"], r["dp"], r["v"], r["mbs"], r["zero"], r["recompute"],
                r["sp"], f"{r['step_time_s']:.3f}", f"{r['tflops_per_gpu']:.1f}",
                f"{100 * r['mfu']:.1f}%", f"{r['tokens_per_s']:.0f}",
                f"{r['memory_gib']:.1f}", r["bottleneck"])
        lines.append("  ".join(f"{v:>9}" for v in vals))
    if result.considered > 1:
        why = "; ".join(f"{k}: {v}" for k, v in result.rejections().items())
        lines.append(f"searched {result.considered} layouts; rejected: {why or 'none'}")
        if result.rejected.get("does not fit in memory"):
            lines.append(f"  (does not fit: over by {result.least_overflow_gib:.1f} to "
                         f"{result.worst_overflow_gib:.1f} GiB)")
    return "\n".join(lines)


_WORDS = {"compute": "compute", "recompute": "recomputation", "tp_comm":
          "tensor-parallel communication", "pp_bubble": "the pipeline bubble",
          "pp_p2p": "pipeline messages", "dp_comm_exposed":
          "data-parallel communication not hidden by the backward", "step_sync":
          "per-step synchronisation (loss counts, stop flag, gradient norm, tied "
          "embedding)", "optimizer":
          "the optimizer step"}


def explain(rows: list[Estimate], shape: ModelShape, cluster: Cluster) -> str:
    """A few lines: what the best layout spends its step on, and where the runner-up
    loses time or memory against it."""
    best = rows[0]
    t = best.times
    total = best.step_time_s
    parts = sorted(t.items(), key=lambda kv: -kv[1])
    spent = ", ".join(f"{_WORDS[k]} {100 * v / total:.0f}%" for k, v in parts if v > 0)
    mem = best.stages[best.worst_stage]
    lines = [f"best: {best.layout.label()}: {total:.3f} s/step, MFU "
             f"{100 * best.mfu:.1f}%, bottleneck {_WORDS[best.bottleneck]}",
             f"  its step: {spent}",
             f"  memory {best.memory_bytes / _GIB:.1f} of {cluster.memory_gib:.0f} GiB on "
             f"stage {best.worst_stage}: model states {mem.model_states / _GIB:.1f}, "
             f"activations {mem.activations / _GIB:.1f}, buffers and reserve "
             f"{(mem.communication + mem.other) / _GIB:.1f}"]
    if len(rows) > 1:
        other = rows[1]
        diffs = {k: other.times.get(k, 0) - t.get(k, 0) for k in set(t) | set(other.times)}
        worse = max(diffs, key=diffs.get)
        lines.append(f"next: {other.layout.label()}: {other.step_time_s:.3f} s/step "
                     f"(+{100 * (other.step_time_s / total - 1):.1f}%), mostly "
                     f"{_WORDS[worse]} (+{diffs[worse]:.3f} s); memory "
                     f"{other.memory_bytes / _GIB:.1f} GiB")
    return "\n".join(lines)
