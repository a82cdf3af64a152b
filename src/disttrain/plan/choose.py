"""Choosing a layout for ``disttrain plan``: parse the model, the cluster and the layout,
search or estimate, and print a table, JSON rows, an explanation, or a config that
``disttrain train`` runs. The command's parser is :mod:`disttrain.commands.plan`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from ..dimensions import Role, derived_dimension, joined, plan_order
from ..errors import UserError
from ..shape import ModelShape, parse_model
from .cluster import Cluster, parse_cluster, preset_check
from .estimate import Estimate, estimate
from .layout import OPTIONS, RECOMPUTE, PlannedLayout, figure
from .options import Options
from .search import SearchResult, layout_problem, search

_GIB = 2**30
_FLAGS = {o.name for o in OPTIONS if o.flag}
DEFAULT_CLUSTER = "gpu=a100-80gb,gpus_per_node=8,nodes=1"


def _layout_keys() -> tuple[str, ...]:
    """What ``--layout`` takes: every dimension's key and search keys, and the
    planner's own (label order)."""
    return tuple(k for k, _ in PlannedLayout().items())


def parse_layout(text: str, n_devices: int) -> PlannedLayout:
    """``--layout tp=2,pp=2,mbs=4``: keys left out take their default; the derived
    dimension (data parallelism), if left out, the devices the others leave."""
    keys = _layout_keys()
    values: dict[str, Any] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, eq, value = item.partition("=")
        if not eq or key not in keys:
            raise UserError(f"--layout item {item!r}: expected key=value with a key among "
                            f"{', '.join(keys)}")
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
        if values[key] < (0 if key in ("zero", *_FLAGS) else 1):
            raise UserError(f"--layout {key}={value} is out of range")
    values.update({k: int(bool(values[k])) for k in _FLAGS if k in values})
    rest = derived_dimension()
    if rest.key not in values:
        fixed = [d for d in plan_order() if not d.derived]
        others = math.prod(values.get(d.key, 1) for d in fixed)
        if n_devices % others:
            raise UserError(f"--layout {joined(fixed)} = {others} does not divide the "
                            f"cluster's {n_devices} devices")
        values[rest.key] = n_devices // others
    return PlannedLayout(**values)


def fused_loss_choice(ns: argparse.Namespace) -> bool:
    """``--fused-loss on|off``; left out, ``train.fused_loss`` of ``--config`` (its
    default where there is none)."""
    if ns.fused_loss is not None:
        return bool(ns.fused_loss == "on")
    if ns.config:
        from ..config import load_config

        return load_config(Path(ns.config)).train.fused_loss
    return Options().fused_loss


def loss_words(options: Options) -> str:
    """What the estimate assumed of the loss, for the table's first line."""
    return ("fused linear + cross-entropy" if options.fused_loss
            else "loss on the full logits")


def _shape(ns: argparse.Namespace) -> ModelShape:
    if not ns.model:
        raise UserError("plan needs --model (layers=..,hidden=..,heads=..,seq=..,vocab=.., "
                        "a config.json, or gpt)")
    gpt = None
    if ns.config:
        from ..config import load_config

        gpt = load_config(Path(ns.config)).model
    return parse_model(ns.model, gpt=gpt)


def choose_layout(ns: argparse.Namespace) -> int:
    """``disttrain plan`` without a subcommand or --validate: search every layout (or
    estimate ``--layout``) and print the rows, an explanation, a config or a trace."""
    shape, cluster = _shape(ns), parse_cluster(ns.cluster or DEFAULT_CLUSTER)
    if ns.global_batch is None:
        raise UserError("plan needs --global-batch B (sequences per optimizer step)")
    options = Options(precision=ns.precision, accounting=ns.accounting,
                      fused_loss=fused_loss_choice(ns))
    recompute = tuple(x.strip() for x in ns.recompute.split(",") if x.strip())
    bad = [r for r in recompute if r not in RECOMPUTE]
    if bad or not recompute:
        raise UserError(f"--recompute {ns.recompute!r}: list some of {', '.join(RECOMPUTE)}")
    if ns.layout:
        planned = parse_layout(ns.layout, cluster.n_devices)
        problem = layout_problem(shape, cluster, planned, ns.global_batch)
        if problem:
            raise UserError(f"--layout {planned.label()}: {problem}")
        rows = [estimate(shape, cluster, planned, ns.global_batch, options, all_stages=True)]
        result = SearchResult(rows=rows, considered=1)
    else:
        result = search(shape, cluster, ns.global_batch, options,
                        top=max(ns.top, 2), recompute=recompute)
        if not result.rows:
            raise UserError(_nothing_fits(shape, cluster, result))
    shown = result.rows[:max(ns.top, 1)]
    if ns.json:
        print(json.dumps([_json_row(e, result, options) for e in shown]))
    else:
        print(_table(shape, cluster, ns.global_batch, options, shown, result))
    if ns.explain:
        print(explain(result.rows, shape, cluster))
    if ns.emit_config:
        from .emit import write_config

        path = write_config(Path(ns.emit_config), shape, ns, result.rows[0], options)
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


def _json_row(e: Estimate, result: SearchResult, options: Options) -> dict:
    row = e.row()
    row["rejected"] = result.rejections()
    row["considered"] = result.considered
    row["fused_loss"] = options.fused_loss
    return row


def _table(shape: ModelShape, cluster: Cluster, global_batch: int, options: Options,
           rows: list[Estimate], result: SearchResult) -> str:
    head = (f"{shape.name}: {shape.num_params() / 1e9:.3f}B parameters, {shape.layers} "
            f"layers, hidden {shape.hidden}, seq {shape.seq}; {cluster.n_devices} x "
            f"{cluster.name} ({cluster.source}); global batch {global_batch}, "
            f"{options.precision}, {options.accounting} accounting, "
            f"{loss_words(options)}")
    keys = [k for k, _ in PlannedLayout().items(shown=True)]
    cols = (*keys, "step_s", "TF/s/gpu", "MFU", "tokens/s", "mem_GiB", "bottleneck")
    lines = [head, "  ".join(f"{c:>9}" for c in cols)]
    for e in rows:
        r = e.row()
        vals = (*(r[k] for k in keys), f"{r['step_time_s']:.3f}",
                f"{r['tflops_per_gpu']:.1f}", f"{100 * r['mfu']:.1f}%",
                f"{r['tokens_per_s']:.0f}", f"{r['memory_gib']:.1f}", r["bottleneck"])
        lines.append("  ".join(f"{v:>9}" for v in vals))
    if result.considered > 1:
        why = "; ".join(f"{k}: {v}" for k, v in result.rejections().items())
        lines.append(f"searched {result.considered} layouts; rejected: {why or 'none'}")
        if result.rejected.get("does not fit in memory"):
            lines.append(f"  (does not fit: over by {result.least_overflow_gib:.1f} to "
                         f"{result.worst_overflow_gib:.1f} GiB)")
    check = preset_check(cluster)
    if check is not None:
        lines.append(f"note: {check}")
    return "\n".join(lines)


def _key(role: Role) -> str:
    """The name a role's figures carry (:func:`~.layout.figure`): ``tp``, ``pp``, ``dp``."""
    return figure(role, "").rstrip("_")


_WORDS = {"compute": "compute", "recompute": "recomputation",
          figure(Role.TENSORS, "comm"): "tensor-parallel communication",
          figure(Role.LAYERS, "bubble"): "the pipeline bubble",
          figure(Role.LAYERS, "p2p"): "pipeline messages",
          figure(Role.REPLICAS, "comm_exposed"):
          "data-parallel communication not hidden by the backward", "step_sync":
          "per-step synchronisation (loss counts, stop flag, gradient norm, tied "
          "embedding)", "optimizer":
          "the optimizer step"}

# StepTime.split's parts, as --explain names them
_SPLIT_WORDS = {"matmul": "matmul", "attention": "attention", "memory_bound":
                "memory-bound ops", "overhead": "framework and launch overhead",
                figure(Role.TENSORS, "comm"): f"{_key(Role.TENSORS)} communication",
                figure(Role.LAYERS, "p2p"): f"{_key(Role.LAYERS)} messages",
                figure(Role.LAYERS, "bubble"): "pipeline bubble",
                figure(Role.REPLICAS, "all_reduce"): f"exposed {_key(Role.REPLICAS)} "
                "all-reduce", figure(Role.REPLICAS, "reduce_scatter"):
                "exposed reduce-scatter", figure(Role.REPLICAS, "all_gather"):
                "exposed all-gather", "step_sync": "per-step sync", "optimizer":
                "optimizer"}


def split_line(est: Estimate) -> str:
    """The step by kind of work, in seconds and shares: every part that is not zero
    (all of them sum to the step time)."""
    total = est.step_time_s
    return "; ".join(f"{_SPLIT_WORDS[k]} {v:.4g} s ({100 * v / total:.1f}%)"
                     for k, v in est.split.items() if v)


def explain(rows: list[Estimate], shape: ModelShape, cluster: Cluster) -> str:
    """A few lines: what the best layout spends its step on, and where the runner-up
    loses time or memory against it."""
    best = rows[0]
    t = best.times
    total = best.step_time_s
    parts = sorted(t.items(), key=lambda kv: -kv[1])
    spent = ", ".join(f"{_WORDS[k]} {100 * v / total:.0f}%" for k, v in parts if v > 0)
    mem = best.stage_memory(best.worst_stage)
    lines = [f"best: {best.layout.label()}: {total:.3f} s/step, MFU "
             f"{100 * best.mfu:.1f}%, bottleneck {_WORDS[best.bottleneck]}",
             f"  its step: {spent}",
             f"  by kind: {split_line(best)}",
             f"  memory {best.memory_bytes / _GIB:.1f} of {cluster.memory_gib:.0f} GiB on "
             f"stage {best.worst_stage}: model states {mem.model_states / _GIB:.1f}, "
             f"activations {mem.activations / _GIB:.1f}, buffers and reserve "
             f"{(mem.communication + mem.other) / _GIB:.1f}"]
    if len(rows) > 1:
        other = rows[1]
        diffs = {k: other.times.get(k, 0) - t.get(k, 0) for k in set(t) | set(other.times)}
        worse = max(diffs, key=lambda k: diffs[k])
        lines.append(f"next: {other.layout.label()}: {other.step_time_s:.3f} s/step "
                     f"(+{100 * (other.step_time_s / total - 1):.1f}%), mostly "
                     f"{_WORDS[worse]} (+{diffs[worse]:.3f} s); memory "
                     f"{other.memory_bytes / _GIB:.1f} GiB")
    return "\n".join(lines)
