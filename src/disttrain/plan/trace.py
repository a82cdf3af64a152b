"""``disttrain plan --trace``: one simulated step of a layout as a Chrome trace.

The trace (``{"traceEvents": [...], "otherData": {...}}``, for chrome://tracing or
Perfetto) has one process per stage (pp rank); the ranks of the other dimensions of a
stage run alike, so one stands for all. The pipeline part is the schedule the stages
run, simulated by the cut of the dimension that cuts the layers (its pricing's
``simulate``: the pipeline's own schedule and simulator) with the estimate's per-chunk
forward and backward costs and its p2p message time; after each rank's last backward
come the replica group's communication the backward did not hide and the optimizer
step.

The simulation charges each p2p message as a delay between ranks, where the estimate
adds the messages to every stage's busy time and counts the bubble as ``(stages - 1) /
v`` mean stage times, so the simulated step differs somewhat from the predicted one;
both are in ``otherData``. A step of more than :data:`MAX_TRACED_ACTIONS` forwards and
backwards is traced over its first micro-batches only (``otherData`` says how many).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..dimensions import Role, plan_order, with_role
from ..errors import UserError
from ..parallel.dimensions import stage_pricing
from ..parallel.pricing import SimulatedAction
from ..shape import ModelShape
from .cluster import Cluster
from .estimate import Estimate
from .layout import figure
from .options import Options

MAX_TRACED_ACTIONS = 2**14  # forwards and backwards over all stages
_REPLICAS = figure(Role.REPLICAS, "").rstrip("_")  # the name of the replica group's figures
_PIPELINE_TID, _AFTER_TID = 0, 1
_THREADS = {_PIPELINE_TID: "forward / backward",
            _AFTER_TID: f"{_REPLICAS} communication, optimizer"}


def traced_micro_batches(est: Estimate, m: int, max_actions: int = MAX_TRACED_ACTIONS
                         ) -> int:
    """How many of the step's ``m`` micro-batches a trace simulates: all, unless that
    is more than ``max_actions`` forwards and backwards; never fewer than the stages
    (the steady state starts there), a multiple of them when interleaved."""
    return stage_pricing().cut(est.layout).traced_micro_batches(m, max_actions)


def build_trace(est: Estimate, global_batch: int, *,
                max_actions: int = MAX_TRACED_ACTIONS) -> dict:
    """The Chrome trace of one step of ``est``'s layout (times from ``est``, which must
    be estimated with its step time)."""
    if not est.chunk_forward_s:
        raise ValueError("the estimate has no step time (estimated with memory_only)")
    planned = est.layout
    m = planned.micro_batches(global_batch)
    traced = traced_micro_batches(est, m, max_actions)
    name, timeline, actions_traced = stage_pricing().cut(planned).simulate(
        traced, _global(est.chunk_forward_s), _global(est.chunk_backward_s),
        est.p2p_message_s)
    events = _metadata(est)
    end = 0.0
    for rank, actions in enumerate(timeline):
        events += [_action_event(t) for t in actions]
        after, rank_end = _after_pipeline(est, rank, actions[-1].end)
        events += after
        end = max(end, rank_end)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": _other_data(est, name, m, traced, actions_traced, end)}


def write_trace(path: Path, shape: ModelShape, cluster: Cluster, est: Estimate,
                global_batch: int, options: Options) -> Path:
    """Write the trace of one step of ``est`` at ``path`` (JSON)."""
    trace = build_trace(est, global_batch)
    trace["otherData"].update(model=shape.name, precision=options.precision,
                              cluster=f"{cluster.n_devices} x {cluster.name}")
    try:
        path.write_text(json.dumps(trace, separators=(",", ":")))
    except OSError as exc:
        raise UserError(f"--trace {path}: cannot write ({exc.strerror or exc}); give a "
                        "path in a writable directory") from None
    return path


def _global(per_rank: tuple[tuple[float, ...], ...]) -> list[float]:
    """Per-stage, local-order chunk costs as one list indexed by global chunk
    (stage r's j-th chunk is j * stages + r)."""
    n = len(per_rank)
    return [per_rank[c % n][c // n] for c in range(n * len(per_rank[0]))]


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def _complete(name: str, cat: str, rank: int, tid: int, start: float, dur: float,
              args: dict) -> dict:
    return {"name": name, "cat": cat, "ph": "X", "pid": rank, "tid": tid,
            "ts": _us(start), "dur": _us(dur), "args": args}


def _action_event(t: SimulatedAction) -> dict:
    kind = "forward" if t.forward else "backward"
    return _complete(f"{t.symbol} c{t.chunk} mb{t.micro}", kind, t.rank, _PIPELINE_TID,
                     t.start, t.end - t.start,
                     {"chunk": t.chunk, "micro_batch": t.micro, "kind": kind})


def _after_pipeline(est: Estimate, rank: int, start: float) -> tuple[list[dict], float]:
    """The replica group's exposed communication (when there is any), the per-step
    synchronisation and the optimizer step after ``rank``'s last backward at ``start``;
    and when they end."""
    events = []
    for name, cat, dur in ((f"{_REPLICAS} reduction (exposed)", _REPLICAS,
                            est.reduction_exposed_s),
                           ("step synchronisation", "sync", est.step_sync_s),
                           ("optimizer step", "optimizer", est.optimizer_s)):
        if dur > 0:
            events.append(_complete(name, cat, rank, _AFTER_TID, start, dur, {}))
            start += dur
    return events, start


def _metadata(est: Estimate) -> list[dict]:
    planned = est.layout
    cutter = with_role(Role.LAYERS)[0]
    alike = " x ".join(f"{d.key} {planned.degree(d.key)}" for d in plan_order() if d != cutter)
    events = []
    for rank in range(planned.stages):
        name = f"{cutter.key} rank {rank} ({alike} replicas alike)"
        events += [{"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                    "args": {"name": name}},
                   {"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0,
                    "args": {"sort_index": rank}}]
        events += [{"name": "thread_name", "ph": "M", "pid": rank, "tid": tid,
                    "args": {"name": thread}} for tid, thread in _THREADS.items()]
    return events


def _other_data(est: Estimate, schedule: str, m: int, traced: int, actions: int,
                end: float) -> dict:
    data = {"layout": est.layout.label(), "schedule": schedule,
            "predicted_step_time_s": est.step_time_s,
            "simulated_step_time_s": end,
            "micro_batches": m, "traced_micro_batches": traced,
            "chunk_forward_s": est.chunk_forward_s,
            "chunk_backward_s": est.chunk_backward_s,
            "p2p_message_s": est.p2p_message_s,
            f"{_REPLICAS}_exposed_s": est.reduction_exposed_s,
            "optimizer_s": est.optimizer_s}
    if traced < m:
        data["capped"] = (f"traced the first {traced} of {m} micro-batches ({actions} of "
                          f"{actions // traced * m} forwards and backwards); the "
                          f"{_REPLICAS} communication and the optimizer step follow the "
                          "traced ones, so simulated_step_time_s covers only those")
    return data
