"""The page's text: the summary cards, what MFU is measured against, the ranks table.

Every figure goes through :mod:`.formats`, so the page shows "3.2 MiB" and "850 ms",
never the float ``summary.json`` holds.
"""

from __future__ import annotations

import html
from collections.abc import Callable
from typing import Any

from ...dimensions import DIMENSIONS
from ..peaks import CONFIGURED, MEASURED_CPU
from ..record import (
    ACTIVATIONS,
    DEVICE_NAME,
    MEM_PEAK_MB,
    MEMORY_BYTES,
    MEMORY_BYTES_PER_RANK,
    MFU,
    PEAK_SOURCE,
    PEAK_TFLOPS,
    RANK,
    RANK_COMM_S,
    RANK_COMPUTE_S,
    RANK_DATA_S,
    RANK_SAMPLES,
    RANK_TOTAL_S,
    RANKS,
    STEP,
    STEP_TIME_S,
    STRAGGLERS,
    TOKENS_PER_S,
)
from .data import Record, RunData, number, series
from .formats import (
    format_bytes,
    format_count,
    format_loss,
    format_mib,
    format_number,
    format_percent,
    format_rate,
    format_seconds,
    format_si,
    format_value,
    humanise,
)


# --------------------------------------------------------------------------- MFU
def peak_kind(source: str) -> str:
    """What an MFU denominator is, in a few words: "measured CPU matmul rate",
    "datasheet peak", ..."""
    kind = source.split(":", 1)[0]
    return {MEASURED_CPU: "measured CPU matmul rate", CONFIGURED: "configured peak"}.get(
        source, {"measured": "measured GPU matmul rate", "published": "datasheet peak"}
        .get(kind, "peak"))


def peak_description(source: str) -> str:
    """Where an MFU denominator came from (:mod:`disttrain.monitor.peaks` sources),
    without calling a measured rate a hardware peak."""
    parts = source.split(":")
    if source == MEASURED_CPU:
        return ("an fp32 matmul rate timed on this CPU at start-up (measured, not the "
                "hardware's peak)")
    if parts[0] == "measured" and len(parts) == 3:
        return (f"a {parts[2]} matmul timed on this GPU at start-up (a measured rate: "
                "disttrain has no datasheet figure for this GPU)")
    if parts[0] == "published" and len(parts) == 3:
        return f"the {parts[1]}'s datasheet dense {parts[2]} peak"
    if source == CONFIGURED:
        return "the peak set in monitor.peak_tflops"
    return f"peak: {source}"


def _mfu_card(s: dict[str, Any]) -> tuple[str, str] | None:
    mfu, tflops, source = number(s.get(MFU)), number(s.get(PEAK_TFLOPS)), s.get(PEAK_SOURCE)
    if mfu is None or tflops is None or not isinstance(source, str):
        return None
    text = (f"{format_percent(mfu)} of {format_si(tflops * 1e12, 'FLOP/s')} per device, "
            f"{peak_description(source)}")
    if mfu > 1:  # e.g. a CPU timed while other processes held its cores
        text += ("; over 100%: the device did more than that figure, so it understates "
                 "this device (set monitor.peak_tflops)")
    return f"MFU (vs {peak_kind(source)})", text


def record_peak_sources(records: list[Record]) -> list[str]:
    """The MFU denominators the records name (one, unless a resumed run moved)."""
    return sorted({r[PEAK_SOURCE] for r in records if isinstance(r.get(PEAK_SOURCE), str)})


def _records_mfu_card(records: list[Record]) -> tuple[str, str] | None:
    """Mean MFU over the logged windows, for a run without a summary."""
    mfu, sources = series(records, MFU)[1], record_peak_sources(records)
    if not mfu:
        return None
    against = "; ".join(peak_description(s) for s in sources)
    label = f"Mean MFU (vs {peak_kind(sources[0])})" if len(sources) == 1 else "Mean MFU"
    return label, f"{format_percent(sum(mfu) / len(mfu))}" + (f" of {against}" if against
                                                              else "")


# --------------------------------------------------------------------------- memory
PART_NAMES = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer state",
               ACTIVATIONS: "activations saved for backward"}


def _total(parts: Any) -> float:
    return sum(v for v in parts.values() if number(v) is not None) if isinstance(
        parts, dict) else 0.0


def _memory_cards(s: dict[str, Any]) -> list[tuple[str, str]]:
    """One card per part of rank 0's memory (``memory_bytes``), their total, and the
    spread of the totals over ranks (``memory_bytes_per_rank``)."""
    parts, rows = s.get(MEMORY_BYTES), []
    if isinstance(parts, dict):
        order = [*PART_NAMES, *sorted(set(parts) - set(PART_NAMES))]
        sizes = {k: parts[k] for k in order if number(parts.get(k)) is not None}
        rows += [(f"Memory: {PART_NAMES.get(k, humanise(k).lower())} (rank 0)",
                  format_bytes(v)) for k, v in sizes.items()]
        if sizes:
            rows.append(("Memory: model state + activations (rank 0)",
                         format_bytes(_total(sizes))))
    per_rank = s.get(MEMORY_BYTES_PER_RANK)
    if isinstance(per_rank, list) and len(per_rank) > 1:
        rows.append(("Memory: model state + activations per rank",
                     _spread([_total(p) for p in per_rank])))
    return rows


def _spread(totals: list[float]) -> str:
    """"81.1 MiB on each of 2 ranks", or the smallest and largest with their ranks."""
    lo = min(range(len(totals)), key=totals.__getitem__)
    hi = max(range(len(totals)), key=totals.__getitem__)
    small, large = format_bytes(totals[lo]), format_bytes(totals[hi])
    if small == large:
        return f"{large} on each of {len(totals)} ranks"
    return f"{small} (rank {lo}) to {large} (rank {hi})"


# --------------------------------------------------------------------------- summary
def _layout(n: int, layout: dict[str, Any]) -> str:
    """``layout``: a run's recorded layout (config key -> degree, and zero)."""
    parts = " × ".join(f"{d.key} {layout[d.key]}" for d in DIMENSIONS if d.key in layout)
    zero = f", ZeRO-{layout['zero']}" if layout.get("zero") else ""
    return f"{n} = {parts}{zero}"


def _diverged(value: Any) -> str:
    step, what = (list(value) + [None, None])[:2]
    return f"at step {format_number(step)} ({what})"


_SUMMARY_FORMATS: list[tuple[str, tuple[str, ...], Callable[..., str]]] = [
    ("Steps", ("steps",), format_count),
    ("Start step", ("start_step",), lambda n: f"{n:,} (resumed)" if n else "0"),
    ("Ranks", ("world_size", "layout"), _layout),
    ("Device", (DEVICE_NAME,), str),
    ("Global batch", ("global_batch",), lambda n: f"{n:,} samples"),
    ("Parameters", ("parameters",), format_count),
    ("Final train loss", ("final_train_loss",), format_loss),
    ("Held-out loss", ("initial_eval_loss", "final_eval_loss"),
     lambda a, b: f"{format_loss(a)} → {format_loss(b)}"),
    ("Wall time", ("wall_time_s",), format_seconds),
    ("Training time", ("train_time_s",), format_seconds),
    ("Throughput", ("tokens_per_s",), lambda x: format_rate(x, "tokens/s")),
    ("Model FLOP/s", ("model_flops_per_s",), lambda x: format_si(x, "FLOP/s")),
]
_MORE_FORMATS: list[tuple[str, tuple[str, ...], Callable[..., str]]] = [
    ("Samples seen", ("samples_seen",), format_count),
    ("Communication per step", ("comm_bytes_per_step",),
     lambda x: f"{format_bytes(x)} sent by each rank"),
    ("Collectives issued", ("collectives",), format_count),
    ("Non-finite steps skipped", ("nonfinite_skipped",), format_count),
    ("Synchronisation", ("sync",), str),
    ("Staleness (mean)", ("staleness_mean",), lambda x: f"{x:.2f} updates"),
    ("Diverged", ("diverged",), _diverged),
    ("Run directory", ("run_dir",), str),
]
# read by the cards above (MFU, memory) rather than one of _SUMMARY_FORMATS
_SPECIAL = (MFU, PEAK_TFLOPS, PEAK_SOURCE, MEMORY_BYTES, MEMORY_BYTES_PER_RANK)


def summary_rows(run: RunData) -> list[tuple[str, str]]:
    """(label, text) cards for the summary; every summary key appears once, each
    figure in units a person reads."""
    s = dict(run.summary)
    rows = _formatted(s, _SUMMARY_FORMATS)
    mfu = _mfu_card(s) or (None if MFU in s else _records_mfu_card(run.records))
    rows += [mfu] if mfu else []
    rows += _memory_cards(s) + _formatted(s, _MORE_FORMATS)
    used = {k for _, keys, _ in _SUMMARY_FORMATS + _MORE_FORMATS for k in keys}
    used |= set(_SPECIAL)
    rows += [(humanise(k), format_value(k, v)) for k, v in sorted(s.items())
             if k not in used and v is not None]
    steps = [r[STEP] for r in run.records]
    rows.append(("Logged records", f"{len(steps)} (steps {format_number(steps[0])} to "
                 f"{format_number(steps[-1])})"))
    return rows


def _formatted(s: dict[str, Any], formats: list[tuple[str, tuple[str, ...],
                                                      Callable[..., str]]]
               ) -> list[tuple[str, str]]:
    return [(label, _format(fmt, keys, [s[k] for k in keys])) for label, keys, fmt in formats
            if all(s.get(k) is not None for k in keys)]


def _format(fmt: Callable[..., str], keys: tuple[str, ...], values: list[Any]) -> str:
    try:
        return fmt(*values)
    except (TypeError, ValueError, KeyError, IndexError):  # an unexpected type
        return ", ".join(format_value(k, v) for k, v in zip(keys, values, strict=True))


# --------------------------------------------------------------------------- ranks
def straggler_counts(records: list[Record]) -> dict[int, int]:
    """rank -> in how many records it was listed in ``stragglers``."""
    counts: dict[int, int] = {}
    for r in records:
        for rank in r.get(STRAGGLERS) or []:
            if isinstance(rank, int):
                counts[rank] = counts.get(rank, 0) + 1
    return counts


# (fields in order of preference, heading, format); total_s is the telemetry's name.
_RANK_COLUMNS: list[tuple[tuple[str, ...], str, Callable[[float], str]]] = [
    ((STEP_TIME_S, RANK_TOTAL_S), "step time", format_seconds),
    ((RANK_COMPUTE_S,), "compute", format_seconds),
    ((RANK_COMM_S,), "exposed comm.", format_seconds), ((RANK_DATA_S,), "data", format_seconds),
    ((TOKENS_PER_S,), "tokens/s", lambda x: format_rate(x, "")),
    ((RANK_SAMPLES,), "samples/step", lambda x: f"{x:,.4g}"),
    ((MEM_PEAK_MB,), "peak memory", format_mib)]


def _first_number(entry: Record, keys: tuple[str, ...]) -> float | None:
    return next((v for k in keys if (v := number(entry.get(k))) is not None), None)


MAX_RANK_ROWS = 16


def _ranks_shown(ranks: list[Record], slow: dict[int, int]) -> list[Record]:
    """All ranks of a small job; of a large one, the most often flagged stragglers,
    then the slowest steps, in rank order."""
    if len(ranks) <= MAX_RANK_ROWS:
        return ranks
    step_time = _RANK_COLUMNS[0][0]
    worst = sorted(ranks, key=lambda e: (-slow.get(e[RANK], 0),
                                         -(_first_number(e, step_time) or 0.0)))
    return sorted(worst[:MAX_RANK_ROWS], key=lambda e: e[RANK])


def _rank_row(e: Record, cols: list, flagged: int, n_records: int) -> str:
    cells = "".join(f"<td>{fmt(v).strip() if (v := _first_number(e, keys)) is not None else '–'}"
                    "</td>" for keys, _, fmt in cols)
    mark = f'<td class="warn">{flagged} of {n_records}</td>' if flagged else "<td>–</td>"
    return f"<tr><td>{html.escape(str(e.get(RANK)))}</td>{cells}{mark}</tr>"


def ranks_table(records: list[Record]) -> str:
    """Per-rank figures of the last record that has them, with straggler counts."""
    latest = next((r for r in reversed(records) if r.get(RANKS)), None)
    if latest is None:
        return ""
    ranks = [e for e in latest[RANKS] if isinstance(e, dict) and isinstance(e.get(RANK), int)]
    cols = [c for c in _RANK_COLUMNS if any(_first_number(e, c[0]) is not None for e in ranks)]
    slow = straggler_counts(records)
    shown = _ranks_shown(ranks, slow)
    rows = "".join(_rank_row(e, cols, slow.get(e[RANK], 0), len(records)) for e in shown)
    more = (f" Showing the {len(shown)} of {len(ranks)} ranks most often flagged as "
            "stragglers, then slowest." if len(shown) < len(ranks) else "")
    head = "".join(f"<th>{label}</th>" for _, label, _ in cols)
    return (f'<section><h2>Ranks</h2><p class="note">At step {format_number(latest[STEP])}, '
            f"the last record with per-rank figures.{more}</p><table class=\"grid\"><tr>"
            f"<th>rank</th>{head}<th>flagged as straggler</th></tr>{rows}</table></section>")
