"""The report's plots: loss, throughput, MFU, time per step and memory, as PNGs.

matplotlib is imported only here, through the object-oriented API with the Agg canvas,
so no global pyplot state or backend is touched. Each PNG carries its own title and
axis labels with units (it is also written beside the page as a file of its own), and
each caption says what is drawn, built from what the run recorded.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...errors import UserError
from ...names import METRICS_FILE
from ..peaks import MEASURED_CPU
from ..record import (
    ACTIVATIONS,
    DEVICE_NAME,
    EVAL_LOSS,
    LOSS,
    MEM_PEAK_MB,
    MEMORY_MB,
    MFU,
    MODEL_STATE_PARTS,
    RANK,
    RANKS,
    STEP,
    STEP_TIME_S,
    TIME_COMM_S,
    TIME_COMPUTE_S,
    TIME_DATA_S,
    TIME_OPTIM_S,
    TOKENS_PER_S,
)
from .cards import PART_NAMES, peak_kind, record_peak_sources, straggler_counts
from .data import Record, RunData, number, series
from .formats import format_percent, format_rate

# A key disttrain does not write (MetricsRecord has no such field) but the report still
# reads when a record holds it: older runs logged the data wait as data_time_s.
OLD_DATA_TIME_S = "data_time_s"

# Colours (matplotlib's default cycle, named so the page and the tests agree).
LOSS_COLOR, EVAL_COLOR, RATE_COLOR, MFU_COLOR = "#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd"
TIME_COLORS = {"compute": "#1f77b4", "exposed communication": "#d62728",
               "data loading": "#ff7f0e", "optimizer": "#9467bd", "other": "#c7c7c7"}
MEM_COLOR, STRAGGLER_COLOR = "#17becf", "#d62728"
PART_COLORS = {"params": "#aec7e8", "grads": "#98df8a", "optimizer": "#c5b0d5",
               ACTIVATIONS: "#ffbb78"}
# Below this many held-out evaluations a line between them would suggest a trend that
# was never measured: the points are drawn alone.
MIN_EVALS_FOR_A_LINE = 3


@dataclass(frozen=True, kw_only=True)
class Plot:
    """One plot of the page: a PNG when its fields were recorded, else a reason."""

    name: str
    title: str
    caption: str
    png: bytes | None = None
    missing: str = ""
    wide: bool = False  # spans the page's row


def require_matplotlib() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise UserError("disttrain report needs matplotlib: pip install "
                        "'disttrain[report]'") from None
    return matplotlib


STYLE = {"font.size": 10, "axes.spines.top": False, "axes.spines.right": False,
         "axes.grid": True, "axes.axisbelow": True, "grid.color": "#e6e6e6",
         "grid.linewidth": 0.8, "axes.edgecolor": "#888888", "legend.frameon": False,
         "axes.titlesize": 11, "axes.titleweight": "bold", "axes.titlelocation": "left"}
# Drawn at 150 dpi and shown about 560 px wide (two plots a row), a 6.4 in figure keeps
# 10 pt text readable; a wide plot spans the row.
SIZE, WIDE_SIZE = (6.4, 3.4), (12.8, 3.4)
STEP_LABEL = "optimizer step"


def _render(draw: Callable[[Any], None], size: tuple[float, float]) -> bytes:
    """Run ``draw(figure)`` on a fresh Agg figure; return the PNG bytes."""
    mpl = require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    with mpl.rc_context(STYLE):
        fig = Figure(figsize=size, layout="constrained")
        FigureCanvasAgg(fig)
        draw(fig)
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=150, facecolor="white")
    return buf.getvalue()


def _missing(plot: Plot, fields: str) -> Plot:
    return Plot(name=plot.name, title=plot.title, caption=plot.caption,
                missing=f"not recorded: this run's {METRICS_FILE} has no {fields}")


def _with_png(plot: Plot, draw: Callable[[Any], None], wide: bool = False) -> Plot:
    return Plot(name=plot.name, title=plot.title, caption=plot.caption, wide=wide,
                png=_render(draw, WIDE_SIZE if wide else SIZE))


# --------------------------------------------------------------------------- loss
def held_out_points(run: RunData) -> tuple[list[float], list[float]]:
    """(steps, held-out losses): the records' evaluations, after the summary's
    evaluation before the first step."""
    esteps, evals = series(run.records, EVAL_LOSS)
    start, first = (number(run.summary.get(k)) for k in ("start_step", "initial_eval_loss"))
    if first is not None and (not esteps or esteps[0] > (start or 0)):
        esteps, evals = [start or 0.0, *esteps], [first, *evals]
    return esteps, evals


def _loss_caption(run: RunData, n_evals: int) -> str:
    bad = sum(1 for r in run.records if LOSS in r and number(r[LOSS]) is None)
    text = "Training loss, averaged over each logging window"
    if n_evals >= MIN_EVALS_FOR_A_LINE:
        text += f"; held-out loss at each of the {n_evals} evaluations."
    elif n_evals:
        text += (f"; held-out loss at only {n_evals} evaluation(s), drawn as points "
                 "without a line (set train.eval_every for more).")
    else:
        text += "."
    return text + (f" {bad} record(s) with a non-finite loss are not plotted." if bad else "")


def loss_plot(run: RunData) -> Plot:
    steps, loss = series(run.records, LOSS)
    esteps, evals = held_out_points(run)
    plot = Plot(name="loss", title="Loss", caption=_loss_caption(run, len(esteps)))
    if not steps and not esteps:
        return _missing(plot, LOSS)

    def draw(fig: Any) -> None:
        ax = fig.add_subplot()
        if steps:
            ax.plot(steps, loss, color=LOSS_COLOR, lw=1.6, label="train (window mean)")
        if esteps:
            style = "o-" if len(esteps) >= MIN_EVALS_FOR_A_LINE else "o"
            ax.plot(esteps, evals, style, color=EVAL_COLOR, lw=1.2, ms=5,
                    label=f"held-out ({len(esteps)} evaluations)")
        ax.set(title="Training and held-out loss", xlabel=STEP_LABEL,
               ylabel="loss (nats per token)")
        ax.legend(loc="upper right")
    return _with_png(plot, draw)


# --------------------------------------------------------------------------- throughput
def throughput_plot(run: RunData) -> Plot:
    steps, rate = series(run.records, TOKENS_PER_S)
    mean = number(run.summary.get("tokens_per_s"))
    plot = Plot(name="throughput", title="Throughput", caption="Tokens per second over "
                "all ranks, per logging window" + ("; dashed: the run's mean." if mean
                                                   is not None else "."))
    if not steps:
        return _missing(plot, TOKENS_PER_S)

    def draw(fig: Any) -> None:
        from matplotlib.ticker import FuncFormatter

        ax = fig.add_subplot()
        ax.plot(steps, rate, color=RATE_COLOR, lw=1.6, label="tokens/s")
        if mean is not None:
            ax.axhline(mean, color=RATE_COLOR, ls="--", lw=1, alpha=0.7,
                       label=f"run mean {format_rate(mean, 'tokens/s')}")
        ax.set(title="Throughput, all ranks", xlabel=STEP_LABEL, ylabel="tokens per second",
               ylim=(0, max(rate + [mean or 0]) * 1.15))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:,.0f}"))
        ax.legend(loc="lower right")
    return _with_png(plot, draw)


# --------------------------------------------------------------------------- MFU
def mfu_plot(run: RunData) -> Plot:
    steps, mfu = series(run.records, MFU)
    sources = record_peak_sources(run.records)
    against = peak_kind(sources[0]) if len(sources) == 1 else "the devices' peak"
    plot = Plot(name="mfu", title="Model FLOPs utilisation", caption="Model FLOP/s as a "
                f"share of one device's {against} times the ranks, per logging window"
                + (f" ({', '.join(sources)})." if sources else "."))
    if not steps:
        return _missing(plot, MFU)

    def draw(fig: Any) -> None:
        from matplotlib.ticker import PercentFormatter

        ax = fig.add_subplot()
        ax.plot(steps, mfu, color=MFU_COLOR, lw=1.6, label="MFU")
        mean = sum(mfu) / len(mfu)
        ax.axhline(mean, color=MFU_COLOR, ls="--", lw=1, alpha=0.7,
                   label=f"mean {format_percent(mean)}")
        ax.set(title=f"MFU (vs {against})", xlabel=STEP_LABEL, ylabel=f"% of {against}",
               ylim=(0, max(max(mfu) * 1.2, 0.01)))
        ax.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
        ax.legend(loc="lower right")
    return _with_png(plot, draw)


# --------------------------------------------------------------------------- time
# (label, fields in order of preference)
TIME_PARTS = [("compute", (TIME_COMPUTE_S,)), ("exposed communication", (TIME_COMM_S,)),
              ("data loading", (TIME_DATA_S, OLD_DATA_TIME_S)),
              ("optimizer", (TIME_OPTIM_S,))]


def time_breakdown(records: list[Record]) -> tuple[list[float], dict[str, list[float]]]:
    """Per logged step: seconds per step in each recorded part, plus the rest of
    ``step_time_s`` ("other", or "other (not broken down)" when parts are missing)."""
    rows = [r for r in records if number(r.get(STEP_TIME_S)) is not None]
    parts: dict[str, list[float]] = {}
    for label, keys in TIME_PARTS:
        key = next((k for k in keys if any(number(r.get(k)) is not None for r in rows)), None)
        if key is not None:
            parts[label] = [number(r.get(key)) or 0.0 for r in rows]
    known = [sum(p[i] for p in parts.values()) for i in range(len(rows))]
    other = "other" if len(parts) == len(TIME_PARTS) else "other (not broken down)"
    parts[other] = [max(r[STEP_TIME_S] - k, 0.0) for r, k in zip(rows, known, strict=True)]
    return [float(r[STEP]) for r in rows], parts


def time_plot(run: RunData) -> Plot:
    steps, parts = time_breakdown(run.records)
    plot = Plot(name="time", title="Time per step", caption="Where each step's time went, "
                "averaged over each logging window (stacked).")
    if not steps:
        return _missing(plot, STEP_TIME_S)
    peak = max(sum(p[i] for p in parts.values()) for i in range(len(steps)))
    scale, unit = (1000.0, "ms") if peak < 1.0 else (1.0, "s")
    colors = [TIME_COLORS.get(label, TIME_COLORS["other"]) for label in parts]

    def draw(fig: Any) -> None:
        ax = fig.add_subplot()
        ys = [[v * scale for v in p] for p in parts.values()]
        if len(steps) > 1:
            ax.stackplot(steps, *ys, labels=list(parts), colors=colors, alpha=0.9, lw=0)
        else:
            bottom = 0.0
            for label, y, c in zip(parts, ys, colors, strict=True):
                ax.bar(steps, y, bottom=bottom, label=label, color=c, width=0.6)
                bottom += y[0]
        ax.set(title="Time per step, by part", xlabel=STEP_LABEL,
               ylabel=f"time per step ({unit})")
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=9)
    return _with_png(plot, draw)


# --------------------------------------------------------------------------- memory
def peak_memory_per_rank(records: list[Record]) -> dict[int, float]:
    """rank -> the highest ``mem_peak_mb`` it reported in any record's ``ranks``."""
    peaks: dict[int, float] = {}
    for r in records:
        for entry in r.get(RANKS) or []:
            rank, mb = entry.get(RANK), number(entry.get(MEM_PEAK_MB))
            if isinstance(rank, int) and mb is not None:
                peaks[rank] = max(peaks.get(rank, 0.0), mb)
    return dict(sorted(peaks.items()))


def model_state_series(records: list[Record]) -> tuple[list[float], dict[str, list[float]]]:
    """(steps, part -> MiB) of the records' ``memory_mb``: rank 0's parameters,
    gradients, optimizer state and activations."""
    rows = [r for r in records if isinstance(r.get(MEMORY_MB), dict)]
    names = [k for k in (*MODEL_STATE_PARTS, ACTIVATIONS)
             if any(number(r[MEMORY_MB].get(k)) is not None for r in rows)]
    return ([float(r[STEP]) for r in rows],
            {k: [number(r[MEMORY_MB].get(k)) or 0.0 for r in rows] for k in names})


def _peak_meaning(run: RunData) -> str:
    """What ``mem_peak_mb`` measured on this run's device (see monitor.stats.memory_mb)."""
    device = run.summary.get(DEVICE_NAME)
    if device == "cpu" or any(s == MEASURED_CPU for s in record_peak_sources(run.records)):
        return "the process's peak resident set"
    if isinstance(device, str):
        return "the CUDA allocator's peak"
    return "peak memory (resident set on CPU, CUDA allocator on GPU)"


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:] + "."


def _unit(mib_values: list[float]) -> tuple[float, str]:
    return (1024.0, "GiB") if max(mib_values, default=0.0) >= 2048 else (1.0, "MiB")


def memory_plot(run: RunData) -> Plot:
    peak = series(run.records, MEM_PEAK_MB)
    state_steps, state = model_state_series(run.records)
    per_rank, slow = peak_memory_per_rank(run.records), straggler_counts(run.records)
    over_time = bool(peak[0] or state)
    said = []
    if peak[0]:
        said.append(f"solid: {_peak_meaning(run)} of the busiest rank")
    if state:
        said.append("shaded: rank 0's " + ", ".join(PART_NAMES.get(k, k) for k in state)
                    + " (stacked)")
    if per_rank:
        said.append("bars: each rank's highest peak"
                    + (", red where it was flagged as a straggler" if slow else ""))
    plot = Plot(name="memory", title="Memory", caption=_sentence("; ".join(said)) if said
                else "Peak memory over the run, and each rank's highest peak.")
    if not over_time and not per_rank:
        return _missing(plot, f"{MEM_PEAK_MB}, {MEMORY_MB} or {RANKS}[].{MEM_PEAK_MB}")
    scale, unit = _unit(peak[1] + list(per_rank.values())
                        + [sum(v) for v in zip(*state.values(), strict=True)])

    def draw(fig: Any) -> None:
        from matplotlib.ticker import MaxNLocator

        axes = fig.subplots(1, int(over_time) + int(bool(per_rank)), squeeze=False)[0]
        if over_time:
            ax = axes[0]
            if state:
                ax.stackplot(state_steps, *[[v / scale for v in ys] for ys in state.values()],
                             labels=[PART_NAMES.get(k, k) for k in state], alpha=0.8, lw=0,
                             colors=[PART_COLORS.get(k, "#dddddd") for k in state])
            if peak[0]:
                ax.plot(peak[0], [v / scale for v in peak[1]], color=MEM_COLOR, lw=1.8,
                        label="peak (busiest rank)")
            ax.set(title="Memory over the run", xlabel=STEP_LABEL, ylabel=f"memory ({unit})")
            ax.set_ylim(bottom=0)
            ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=9)
        if per_rank:
            ax = axes[-1]
            colors = [STRAGGLER_COLOR if r in slow else MEM_COLOR for r in per_rank]
            ax.bar(list(per_rank), [v / scale for v in per_rank.values()], color=colors,
                   width=0.8 if len(per_rank) > 1 else 0.4)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set(title="Peak memory per rank", xlabel="rank", ylabel=f"peak ({unit})")
            ax.grid(axis="x", visible=False)
    return _with_png(plot, draw, wide=over_time and bool(per_rank))


PLOTS = [loss_plot, throughput_plot, mfu_plot, time_plot, memory_plot]
