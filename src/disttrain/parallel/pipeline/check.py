"""The pipeline's compatibility check (run by validation before any process group)
and ``parallel.pp_split`` read as cut points."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from ...config.layout import Layout
from ...config.schema import Config, ParallelConfig
from ...errors import ConfigError
from ...names import SCHEDULE_INTERLEAVED, SCHEDULE_ZBV
from ...spec import ModelSpec
from .schedules import SPLIT_SCHEDULES, validate_schedule


def virtual_stages(parallel: ParallelConfig) -> int:
    """Model chunks per pipeline rank: ``pp_virtual`` for the interleaved schedule, 2 for
    the V of ``zbv``, else 1."""
    if parallel.pp_schedule == SCHEDULE_ZBV:
        return 2
    return parallel.pp_virtual if parallel.pp_schedule == SCHEDULE_INTERLEAVED else 1


def split_backward_problem(schedule: str, zero: int, recomputes: bool) -> str | None:
    """Why ``schedule`` cannot run beside ZeRO stage ``zero`` and recomputation
    (``recomputes``), or None. A zero-bubble schedule's W pass reruns the nodes that
    read a block's saved tensors; a checkpointed block recomputes its forward for them,
    reading weights that ZeRO-3 freed once B was done. Asked by the trainer's check and
    by the planner (the pipeline pricing's ``batch_problem``)."""
    if schedule in SPLIT_SCHEDULES and zero == 3 and recomputes:
        return ("a zero-bubble schedule cannot recompute activations under ZeRO-3 (its W "
                "pass would recompute blocks whose weights are freed after their B)")
    return None


def check_pipeline(config: Config, layout: Layout, spec: ModelSpec,
                   micro_batches: int, model: Callable[[], nn.Module]) -> None:
    """Refuse, with the fix, a pipeline the schedule or the model cannot run
    (``micro_batches``: per step and replica, the schedule's m; ``model``: unused,
    every dimension's check takes it)."""
    pp = layout.degree("pp")
    if pp == 1:
        return
    p = config.parallel
    if not spec.can_pipeline:
        raise ConfigError("parallel.pp", pp, "this model cannot be cut into "
                          "pipeline stages (its spec names no block list with the "
                          "modules before and after it)", "pass a ModelSpec with blocks, "
                          "before, after and inject (or embed / finish), or set "
                          "parallel.pp=1")
    v = virtual_stages(p)
    try:
        validate_schedule(p.pp_schedule, pp, micro_batches, v, spec.n_blocks)
    except ValueError as exc:
        field: str = "parallel.pp_schedule"
        value: object = p.pp_schedule
        if "micro-batches" in str(exc):
            field, value = "train.grad_accum", micro_batches
        elif "v >=" in str(exc):
            field, value = "parallel.pp_virtual", p.pp_virtual
        problem, _, fix = str(exc).partition("; ")
        raise ConfigError(field, value, problem, f"{fix or 'see the schedule'}; the "
                          "micro-batches per step are train.grad_accum, v is "
                          "parallel.pp_virtual") from None
    pipeline_starts(p.pp_split, pp * v, spec.n_blocks)
    checkpointing = config.train.activation_checkpointing
    refused = split_backward_problem(p.pp_schedule, p.zero, checkpointing != "none")
    if refused:
        raise ConfigError("train.activation_checkpointing", checkpointing, refused,
                          "set train.activation_checkpointing=none, parallel.zero=1 or 2, "
                          "or parallel.pp_schedule=1f1b")
    if p.pp_schedule in SPLIT_SCHEDULES and config.train.compile:
        raise ConfigError("train.compile", True, f"a compiled block's backward is one node "
                          f"giving its input and weight gradients together, which "
                          f"{p.pp_schedule} splits into two passes (and torch's compiled "
                          "backward refuses the graph the split keeps between them)",
                          "set train.compile=false, or parallel.pp_schedule=1f1b or "
                          "interleaved")


def pipeline_starts(split: str, chunks: int, n_layer: int) -> list[int] | None:
    """``parallel.pp_split`` as the first block of each chunk, or None for auto."""
    if split.strip() == "auto":
        return None
    try:
        starts = [int(x) for x in split.split(",")]
    except ValueError:
        raise ConfigError("parallel.pp_split", split, "is neither 'auto' nor a list of "
                          "block indices", "write e.g. '0,2' or 'auto'") from None
    ok = (len(starts) == chunks and starts[0] == 0 and all(a < b for a, b in
          zip(starts, starts[1:], strict=False)) and starts[-1] < n_layer)
    if not ok:
        even = ",".join(str(i * n_layer // chunks) for i in range(chunks))
        raise ConfigError("parallel.pp_split", split, f"needs {chunks} increasing block "
                          f"indices starting at 0 and below n_layer={n_layer}",
                          f"e.g. '{even}', or 'auto'")
    return starts


def pipeline_cuts(parallel: ParallelConfig, spec: ModelSpec) -> list[int] | None:
    """The first block of every chunk after the first, or None to balance costs."""
    starts = pipeline_starts(parallel.pp_split, parallel.pp * virtual_stages(parallel),
                             spec.n_blocks)
    return starts[1:] if starts else None
