"""The metrics record: one typed row per logged step, and the one definition of its keys.

The trainer fills the step's own figures, :class:`~disttrain.monitor.telemetry.Telemetry`
adds what it gathers from every rank, the sync mode and the gradient reducer add their
own; ``MetricsWriter`` writes the record as one line of ``metrics.jsonl``, the
loggers (``monitor.loggers``) copy its numbers, and ``disttrain report`` reads the lines
back as dicts. Writers name fields as keyword arguments, which the dataclass checks; readers of
the dicts use the key constants below, each checked against the dataclass at import, so
a renamed field cannot leave a reader looking for the old key.

A strategy registered from outside disttrain may report figures of its own (through
``GradSync.comm_stats`` or ``SyncStrategy.metrics``); they travel in ``extra`` and are
written beside the fields, under their own names, which may not be a field's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any


@dataclass(frozen=True, kw_only=True)
class MetricsRecord:
    """One logged step. Every field but ``step`` is optional: a run records what its
    mode measures (the async parameter server, for one, has no per-rank timings), and
    a field left None is not written."""

    step: int
    # the trainer: the step's optimizer and data figures
    lr: float | None = None
    grad_norm: float | None = None
    samples_per_s: float | None = None
    samples_seen: int | None = None
    shares: list[int] | None = None          # samples per dp rank in each global batch
    checkpoint_stall_s: float | None = None
    loss_scale: float | None = None          # fp16 only
    skipped_steps: int | None = None         # fp16 only: steps skipped on overflow
    nonfinite_skipped: int | None = None     # train.on_nonfinite=skip: steps skipped
    eval_loss: float | None = None           # at steps with an evaluation
    memory_mb: dict[str, float] | None = None  # model state and activations by part
    comm_bytes_per_step: float | None = None       # payload handed to collectives
    comm_wire_bytes_per_step: float | None = None  # sent on the wire (their algorithms)
    # telemetry: averages over the logging window, gathered from every rank
    loss: float | None = None
    tokens_per_s: float | None = None          # processed: every position, trained or not
    trained_tokens_per_s: float | None = None  # the loss's terms (masked positions out)
    step_time_s: float | None = None
    time_compute_s: float | None = None
    time_comm_s: float | None = None         # exposed (blocking) communication only
    time_data_s: float | None = None
    time_optim_s: float | None = None
    mem_peak_mb: float | None = None
    ranks: list[dict[str, float]] | None = None  # one entry per rank, keys RANK_FIELDS
    stragglers: list[int] | None = None
    mfu: float | None = None                 # when the model's FLOPs per token are known
    peak_source: str | None = None           # MFU's denominator: published, measured, configured
    # the data-parallel gradient reducer (DataParallel.comm_stats)
    grad_sync_bytes: int | None = None
    compression_ratio: float | None = None
    # the periodic sync modes (SyncStrategy.metrics)
    sync: str | None = None
    sync_rounds: int | None = None
    fed_clients_per_round: int | None = None
    fed_client0_samples: int | None = None
    # the async parameter server (written by server 0)
    updates: int | None = None
    dropped: int | None = None
    staleness_mean: float | None = None
    staleness_max: int | None = None
    # figures a strategy reports under names of its own (see the module docstring)
    extra: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        clash = sorted(set(self.extra or ()) & set(FIELDS))
        if clash:
            raise ValueError(f"metrics figures {clash} are MetricsRecord fields; pass "
                             "them as fields, not in extra")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> MetricsRecord:
        """The record of a dict built by key: keys that are fields fill them, the
        others (a strategy's own figures) go to ``extra``."""
        return cls(step=values[STEP]).with_figures(values)

    def with_figures(self, figures: Mapping[str, Any]) -> MetricsRecord:
        """This record with ``figures`` added (a sync mode's or a gradient reducer's):
        those named like a field set it, the rest join ``extra``."""
        known = {k: v for k, v in figures.items() if k in FIELDS}
        own = {k: v for k, v in figures.items() if k not in FIELDS}
        return replace(self, **known, extra={**(self.extra or {}), **own} or None)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of ``metrics.jsonl``: the fields that are set, then
        ``extra``'s figures beside them."""
        values = {name: value for name in FIELDS
                  if (value := getattr(self, name)) is not None}
        return values | dict(self.extra or {})


# the record's keys in metrics.jsonl (``extra`` is not one: its figures are written
# under their own names)
FIELDS: tuple[str, ...] = tuple(f.name for f in fields(MetricsRecord) if f.name != "extra")


def as_record(record: MetricsRecord | Mapping[str, Any]) -> MetricsRecord:
    """``record`` itself, or the record of a dict (see :meth:`MetricsRecord.from_dict`)."""
    return record if isinstance(record, MetricsRecord) else MetricsRecord.from_dict(record)


def _key(name: str) -> str:
    """``name``, which must be a field: a reader's key is checked when this module loads."""
    if name not in FIELDS:
        raise AssertionError(f"{name!r} is not a MetricsRecord field")
    return name


# Keys of the record as a dict, for the code that reads records back (the report, the
# loggers, truncation on resume).
STEP = _key("step")
LOSS = _key("loss")
EVAL_LOSS = _key("eval_loss")
TOKENS_PER_S = _key("tokens_per_s")
MFU = _key("mfu")
PEAK_SOURCE = _key("peak_source")
# summary.json only, beside MFU and PEAK_SOURCE: the per-device peak MFU is taken against
PEAK_TFLOPS = "peak_tflops"
# summary.json only: rank 0's model-state and activation bytes, every rank's (in rank
# order), and the device the run trained on ("cpu", or the GPU's name as torch gives it)
MEMORY_BYTES = "memory_bytes"
MEMORY_BYTES_PER_RANK = "memory_bytes_per_rank"
DEVICE_NAME = "device_name"
# the parts of each memory_bytes entry: GradSync.model_state_bytes' and the activations
MODEL_STATE_PARTS = ("params", "grads", "optimizer")
ACTIVATIONS = "activations"
STEP_TIME_S = _key("step_time_s")
TIME_COMPUTE_S = _key("time_compute_s")
TIME_COMM_S = _key("time_comm_s")
TIME_DATA_S = _key("time_data_s")
TIME_OPTIM_S = _key("time_optim_s")
MEM_PEAK_MB = _key("mem_peak_mb")
MEMORY_MB = _key("memory_mb")
RANKS = _key("ranks")
STRAGGLERS = _key("stragglers")

# Per-rank figures: each rank's per-step averages over the window (the fields of
# monitor.stats.StepStats, which telemetry gathers under these names), and RANK_FIELDS,
# the keys of each entry of the record's ``ranks``.
RANK = "rank"
RANK_TOTAL_S = "total_s"
RANK_COMPUTE_S = "compute_s"
RANK_COMM_S = "comm_s"
RANK_DATA_S = "data_s"
RANK_OPTIM_S = "optim_s"
RANK_SAMPLES = "samples"
RANK_FIELDS = (RANK, RANK_TOTAL_S, RANK_COMPUTE_S, RANK_COMM_S, RANK_DATA_S, RANK_SAMPLES,
               MEM_PEAK_MB)
