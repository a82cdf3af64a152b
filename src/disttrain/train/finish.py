"""The end of a run: the summary (``summary.json`` and what ``fit()`` returns), the final
weights from every rank's pieces, the merged timeline."""

from __future__ import annotations

from typing import Any

from ..errors import CheckpointSaveError
from ..monitor.peaks import model_flops_utilisation
from ..monitor.record import (
    DEVICE_NAME,
    MEMORY_BYTES,
    MEMORY_BYTES_PER_RANK,
    MFU,
    PEAK_SOURCE,
    PEAK_TFLOPS,
)
from ..monitor.trace import merge_traces
from ..names import TRACE_FILE, trace_rank_file
from ..parallel.pieces import weight_pieces
from . import rundir
from .final_weights import write_final_weights
from .outputs import on_main
from .report import device_name, summary_text
from .run import LoopResult, Run


def finish_run(run: Run, result: LoopResult) -> dict[str, Any]:
    """The summary of ``run`` after its loop gave ``result``; writes it, the final
    weights and the timeline (collectives: every rank calls it)."""
    summary = _summary(run, result)
    # the final weights from every rank's pieces, one tensor at a time on rank 0
    problem = write_final_weights(weight_pieces(run.parallel, run.model.optimizer),
                                  run.world, run.run_dir, run.config.train.steps)
    if problem is not None:
        raise CheckpointSaveError(f"could not write the final weights: {problem}")
    run.parallel.grads.finalize()  # a model built whole keeps its full parameters
    run.parallel.restore_head()  # the fused loss's stand-in out: the model gives logits
    on_main(run.world, lambda: rundir.write_summary(run.run_dir, summary),
            f"could not write the summary in {run.run_dir}", CheckpointSaveError)
    if run.runtime.is_main:
        run.reporter.say(summary_text(summary, run.reporter.bar.unit))
    _write_trace(run)
    return summary


def _summary(run: Run, result: LoopResult) -> dict[str, Any]:
    planned, steps = run.plan.layout, run.config.train.steps
    ran = max(steps - run.start_step, 1)
    summary: dict[str, Any] = {
        "steps": steps, "start_step": run.start_step,
        "world_size": run.runtime.world_size,
        "layout": planned.as_dict(),
        "global_batch": run.plan.batch.global_batch,
        "final_train_loss": result.final_loss,
        "initial_eval_loss": result.initial_eval, "final_eval_loss": result.final_eval,
        "wall_time_s": result.wall_time, "train_time_s": result.totals.wall_s,
        "busy_time_s": result.totals.busy_s(),
        "comm_wait_s": result.totals.sum.comm_s, "data_time_s": result.totals.sum.data_s,
        "tokens_per_s": result.totals.positions_per_s(),
        "trained_tokens_per_s": result.totals.terms_per_s(),
        "samples_seen": run.cursor.position, "run_dir": str(run.run_dir),
        "parameters": run.model.parameters,
        "comm_bytes_per_step": run.tally.step_bytes / ran,
        "comm_wire_bytes_per_step": run.tally.step_wire / ran,
        "collectives": run.tally.ledger.seq,
        "nonfinite_skipped": run.facts.nonfinite_skipped,
    }
    flops = run.model.flops_per_token
    if flops:
        peak = run.reporter.telemetry.peak
        summary["model_flops_per_s"] = summary["tokens_per_s"] * flops
        summary[MFU] = model_flops_utilisation(summary["tokens_per_s"], flops, peak.flops,
                                               run.runtime.world_size)
        summary |= {PEAK_TFLOPS: peak.flops / 1e12, PEAK_SOURCE: peak.source}
    summary[MEMORY_BYTES] = run.memory()
    # one gather at the end: pipeline stages and tp shards hold different amounts
    summary[MEMORY_BYTES_PER_RANK] = run.world.all_gather_object(summary[MEMORY_BYTES])
    summary[DEVICE_NAME] = device_name(run.runtime.device)
    summary |= run.parallel.sync.metrics()
    if run.replicas is not None:  # the steps that ran short, retried, the heal
        summary |= run.replicas.summary_figures()
    return summary


def _write_trace(run: Run) -> None:
    """Each rank writes its spans; rank 0 merges them into ``trace.json``."""
    enabled = run.tracer.enabled
    if enabled:
        run.tracer.write(run.run_dir / trace_rank_file(run.runtime.rank))
    run.world.barrier()
    if enabled and run.runtime.is_main:
        parts = [run.run_dir / trace_rank_file(r) for r in range(run.runtime.world_size)]
        merge_traces(parts, run.run_dir / TRACE_FILE)
