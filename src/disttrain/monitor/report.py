"""``disttrain report RUN_DIR``: PNG plots of a run and one self-contained HTML page.

Reads ``summary.json`` (optional: a run still going or one that crashed has none),
``metrics.jsonl`` and ``config.toml`` (optional) from a run directory and writes, into
``RUN_DIR/report/`` by default::

    loss.png  throughput.png  mfu.png  time.png  memory.png  report.html

``report.html`` embeds the PNGs as base64 data URIs and refers to nothing outside
itself (no files, scripts, stylesheets or fonts; its one inline script marks how many
plots decoded), so it can be mailed or attached as one file. Every metric
other than ``step`` is optional: a plot whose fields a run did not record is left out
and the page says "not recorded". Needs matplotlib (``pip install 'disttrain[report]'``);
it is imported only when a report is built, and through the object-oriented API with
the Agg canvas, so no global pyplot state or backend is touched.
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import UserError
from ..names import CONFIG_FILE, METRICS_FILE, REPORT_DIR, REPORT_FILE, SUMMARY_FILE
from .progress import format_duration
from .record import (EVAL_LOSS, LOSS, MEM_PEAK_MB, MFU, PEAK_SOURCE, PEAK_TFLOPS, RANK,
                     RANK_COMM_S, RANK_COMPUTE_S, RANK_DATA_S, RANK_SAMPLES, RANK_TOTAL_S,
                     RANKS, STEP, STEP_TIME_S, STRAGGLERS, TIME_COMM_S, TIME_COMPUTE_S,
                     TIME_DATA_S, TIME_OPTIM_S, TOKENS_PER_S)

# Keys disttrain does not write (MetricsRecord has no such field) but the report still
# reads when a record holds them: older runs logged the data wait as data_time_s, and a
# resident-memory series is plotted when present.
OLD_DATA_TIME_S, MEM_RSS_MB = "data_time_s", "mem_rss_mb"

# Colours (matplotlib's default cycle, named so the page and the tests agree).
LOSS_COLOR, EVAL_COLOR, RATE_COLOR, MFU_COLOR = "#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd"
TIME_COLORS = {"compute": "#1f77b4", "exposed communication": "#d62728",
               "data loading": "#ff7f0e", "optimizer": "#9467bd", "other": "#c7c7c7"}
MEM_COLOR, STRAGGLER_COLOR = "#17becf", "#d62728"

Record = dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class RunData:
    """What a report is made of: the run's records in step order, its summary ({} when
    the run has not finished) and its config text (None when absent)."""

    run_dir: Path
    records: list[Record]
    summary: dict[str, Any] = field(default_factory=dict)
    config_text: str | None = None


@dataclass(frozen=True, kw_only=True)
class Plot:
    """One plot of the page: a PNG when its fields were recorded, else a reason."""

    name: str
    title: str
    caption: str
    png: bytes | None = None
    missing: str = ""
    wide: bool = False  # spans the page's row


# --------------------------------------------------------------------------- loading
def load_run(run_dir: Path) -> RunData:
    """Read a run directory; a UserError (with the fix) when it cannot make a report."""
    if not run_dir.is_dir():
        raise UserError(f"run directory {str(run_dir)!r} does not exist (give the directory "
                        "a `disttrain train` run wrote, e.g. runs/<time>)")
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise UserError(f"{str(run_dir)!r} has no {METRICS_FILE} (give a run directory "
                        "written by `disttrain train` or disttrain.Trainer, after its first "
                        "logged step)")
    records = _read_records(path)
    if not records:
        raise UserError(f"{str(path)!r} holds no records (the run has not logged a step "
                        "yet; wait for train.log_every steps)")
    summary_path, config_path = run_dir / SUMMARY_FILE, run_dir / CONFIG_FILE
    summary = _read_json(summary_path) if summary_path.is_file() else {}
    config = config_path.read_text(encoding="utf-8") if config_path.is_file() else None
    return RunData(run_dir=run_dir, records=records, summary=summary, config_text=config)


def _read_records(path: Path) -> list[Record]:
    """Records with a step, sorted by step. A torn last line (a run killed while
    writing) is dropped; a bad line anywhere else is an error."""
    lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    records = []
    for i, line in enumerate(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if i == len(lines) - 1:
                break
            raise UserError(f"{str(path)!r} line {i + 1} is not JSON ({exc.msg}; remove "
                            "or repair that line)") from None
        if isinstance(record, dict) and _number(record.get(STEP)) is not None:
            records.append(record)
    return sorted(records, key=lambda r: r[STEP])


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise UserError(f"{str(path)!r} is not JSON ({exc.msg}; delete it to report "
                        "without a summary)") from None
    return value if isinstance(value, dict) else {}


def _number(value: Any) -> float | None:
    """``value`` as a float when it is a finite number, else None (NaN and inf, which
    json writes for a diverged loss, are not plotted)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    return float(value) if ok and math.isfinite(value) else None


def series(records: list[Record], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of the records that hold a number under ``key``."""
    pairs = [(float(r[STEP]), _number(r.get(key))) for r in records]
    kept = [(s, v) for s, v in pairs if v is not None]
    return [s for s, _ in kept], [v for _, v in kept]


# --------------------------------------------------------------------------- plots
def _matplotlib() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise UserError("disttrain report needs matplotlib: pip install "
                        "'disttrain[report]'") from None
    return matplotlib


STYLE = {"font.size": 10, "axes.spines.top": False, "axes.spines.right": False,
         "axes.grid": True, "axes.axisbelow": True, "grid.color": "#e6e6e6",
         "grid.linewidth": 0.8, "axes.edgecolor": "#888888", "legend.frameon": False}


# Drawn at 150 dpi and shown about 560 px wide (two plots a row), a 6.4 in figure keeps
# 10 pt text readable; a wide plot spans the row.
SIZE, WIDE_SIZE = (6.4, 3.2), (12.8, 3.2)


def _render(draw: Callable[[Any], None], size: tuple[float, float] = SIZE) -> bytes:
    """Run ``draw(figure)`` on a fresh Agg figure; return the PNG bytes."""
    mpl = _matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    with mpl.rc_context(STYLE):
        fig = Figure(figsize=size, layout="constrained")
        FigureCanvasAgg(fig)
        draw(fig)
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=150, facecolor="white")
    return buf.getvalue()


def _loss_plot(run: RunData) -> Plot:
    steps, loss = series(run.records, LOSS)
    esteps, evals = series(run.records, EVAL_LOSS)
    start, first = (_number(run.summary.get(k)) for k in ("start_step", "initial_eval_loss"))
    if first is not None and (not esteps or esteps[0] > (start or 0)):
        esteps, evals = [start or 0.0, *esteps], [first, *evals]
    bad = sum(1 for r in run.records if LOSS in r and _number(r[LOSS]) is None)
    caption = ("Training loss, averaged over each logging window; held-out loss at each "
               "evaluation." + (f" {bad} record(s) with a non-finite loss are not plotted."
                                if bad else ""))
    plot = Plot(name="loss", title="Loss", caption=caption)
    if not steps and not esteps:
        return _missing(plot, LOSS)

    def draw(fig: Any) -> None:
        ax = fig.add_subplot()
        if steps:
            ax.plot(steps, loss, color=LOSS_COLOR, lw=1.6, label="train")
        if esteps:
            ax.plot(esteps, evals, "o--", color=EVAL_COLOR, lw=1, ms=5, label="held-out")
        ax.set(xlabel="step", ylabel="loss (nats)")
        ax.legend(loc="upper right")
    return _with_png(plot, draw)


def _throughput_plot(run: RunData) -> Plot:
    steps, rate = series(run.records, TOKENS_PER_S)
    mean = _number(run.summary.get("tokens_per_s"))
    plot = Plot(name="throughput", title="Throughput", caption="Tokens per second over "
                "all ranks, per logging window" + ("; dashed: the run's mean." if mean
                                                   is not None else "."))
    if not steps:
        return _missing(plot, TOKENS_PER_S)

    def draw(fig: Any) -> None:
        from matplotlib.ticker import EngFormatter

        ax = fig.add_subplot()
        ax.plot(steps, rate, color=RATE_COLOR, lw=1.6, label="tokens/s")
        if mean is not None:
            ax.axhline(mean, color=RATE_COLOR, ls="--", lw=1, alpha=0.7,
                       label=f"run mean {mean:,.0f}")
        ax.set(xlabel="step", ylabel="tokens/s", ylim=(0, max(rate + [mean or 0]) * 1.15))
        ax.yaxis.set_major_formatter(EngFormatter())
        ax.legend(loc="lower right")
    return _with_png(plot, draw)


def _peak_sources(records: list[Record]) -> str:
    """Where the records' MFU peak came from, e.g. ' (peak: measured:cpu)'; '' when
    they do not say."""
    sources = sorted({r[PEAK_SOURCE] for r in records if r.get(PEAK_SOURCE)})
    return f" (peak: {', '.join(sources)})" if sources else ""


def _mfu_plot(run: RunData) -> Plot:
    steps, mfu = series(run.records, MFU)
    plot = Plot(name="mfu", title="Model FLOPs utilisation", caption="Model FLOP/s as a "
                f"share of the devices' peak{_peak_sources(run.records)}, per logging "
                "window.")
    if not steps:
        return _missing(plot, MFU)

    def draw(fig: Any) -> None:
        from matplotlib.ticker import PercentFormatter

        ax = fig.add_subplot()
        ax.plot(steps, mfu, color=MFU_COLOR, lw=1.6, label="MFU")
        mean = sum(mfu) / len(mfu)
        ax.axhline(mean, color=MFU_COLOR, ls="--", lw=1, alpha=0.7,
                   label=f"mean {mean:.1%}")
        ax.set(xlabel="step", ylabel="MFU", ylim=(0, max(max(mfu) * 1.2, 0.01)))
        ax.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
        ax.legend(loc="lower right")
    return _with_png(plot, draw)


# (label, fields in order of preference)
TIME_PARTS = [("compute", (TIME_COMPUTE_S,)), ("exposed communication", (TIME_COMM_S,)),
              ("data loading", (TIME_DATA_S, OLD_DATA_TIME_S)),
              ("optimizer", (TIME_OPTIM_S,))]


def time_breakdown(records: list[Record]) -> tuple[list[float], dict[str, list[float]]]:
    """Per logged step: seconds per step in each recorded part, plus the rest of
    ``step_time_s`` ("other", or "other (not broken down)" when parts are missing)."""
    rows = [r for r in records if _number(r.get(STEP_TIME_S)) is not None]
    parts: dict[str, list[float]] = {}
    for label, keys in TIME_PARTS:
        key = next((k for k in keys if any(_number(r.get(k)) is not None for r in rows)), None)
        if key is not None:
            parts[label] = [_number(r.get(key)) or 0.0 for r in rows]
    known = [sum(p[i] for p in parts.values()) for i in range(len(rows))]
    other = "other" if len(parts) == len(TIME_PARTS) else "other (not broken down)"
    parts[other] = [max(r[STEP_TIME_S] - k, 0.0) for r, k in zip(rows, known, strict=True)]
    return [float(r[STEP]) for r in rows], parts


def _time_plot(run: RunData) -> Plot:
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
        ax.set(xlabel="step", ylabel=f"{unit} per step")
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=9)
    return _with_png(plot, draw)


def peak_memory_per_rank(records: list[Record]) -> dict[int, float]:
    """rank -> the highest ``mem_peak_mb`` it reported in any record's ``ranks``."""
    peaks: dict[int, float] = {}
    for r in records:
        for entry in r.get(RANKS) or []:
            rank, mb = entry.get(RANK), _number(entry.get(MEM_PEAK_MB))
            if isinstance(rank, int) and mb is not None:
                peaks[rank] = max(peaks.get(rank, 0.0), mb)
    return dict(sorted(peaks.items()))


def straggler_counts(records: list[Record]) -> dict[int, int]:
    """rank -> in how many records it was listed in ``stragglers``."""
    counts: dict[int, int] = {}
    for r in records:
        for rank in r.get(STRAGGLERS) or []:
            if isinstance(rank, int):
                counts[rank] = counts.get(rank, 0) + 1
    return counts


def _memory_plot(run: RunData) -> Plot:
    rss, peak = series(run.records, MEM_RSS_MB), series(run.records, MEM_PEAK_MB)
    per_rank, slow = peak_memory_per_rank(run.records), straggler_counts(run.records)
    plot = Plot(name="memory", title="Memory", caption="Resident and peak memory over the "
                "run, as recorded; each rank's highest peak, red where the rank was flagged "
                "as a straggler.")
    over_time = bool(rss[0] or peak[0])
    lines = [(rss, MEM_COLOR, "-", "resident (RSS)"), (peak, "#0b6e78", "--", "peak")]
    if not over_time and not per_rank:
        return _missing(plot, f"{MEM_RSS_MB}, {MEM_PEAK_MB} or {RANKS}[].{MEM_PEAK_MB}")

    def draw(fig: Any) -> None:
        from matplotlib.ticker import MaxNLocator

        axes = fig.subplots(1, int(over_time) + int(bool(per_rank)), squeeze=False)[0]
        if over_time:
            ax = axes[0]
            for (x, y), color, style, label in lines:
                if x:
                    ax.plot(x, y, color=color, ls=style, lw=1.5, label=label)
            ax.set(xlabel="step", ylabel="MB", ylim=(0, max(rss[1] + peak[1]) * 1.15))
            ax.legend(loc="lower right")
        if per_rank:
            ax = axes[-1]
            colors = [STRAGGLER_COLOR if r in slow else MEM_COLOR for r in per_rank]
            ax.bar(list(per_rank), list(per_rank.values()), color=colors,
                   width=0.8 if len(per_rank) > 1 else 0.4)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set(xlabel="rank", ylabel="peak MB")
            ax.grid(axis="x", visible=False)
    return _with_png(plot, draw, wide=over_time and bool(per_rank))


def _missing(plot: Plot, fields: str) -> Plot:
    return Plot(name=plot.name, title=plot.title, caption=plot.caption,
                missing=f"not recorded: this run's {METRICS_FILE} has no {fields}")


def _with_png(plot: Plot, draw: Callable[[Any], None], wide: bool = False) -> Plot:
    return Plot(name=plot.name, title=plot.title, caption=plot.caption, wide=wide,
                png=_render(draw, WIDE_SIZE if wide else SIZE))


PLOTS = [_loss_plot, _throughput_plot, _mfu_plot, _time_plot, _memory_plot]


# --------------------------------------------------------------------------- page
def summary_rows(run: RunData) -> list[tuple[str, str]]:
    """(label, text) rows for the summary table; every summary key appears once."""
    s, rows = dict(run.summary), []
    for label, keys, fmt in _SUMMARY_FORMATS:
        if all(s.get(k) is not None for k in keys):
            rows.append((label, _format(fmt, [s[k] for k in keys])))
        for k in keys:
            s.pop(k, None)
    rows += [(k, json.dumps(v) if not isinstance(v, str) else v) for k, v in sorted(s.items())]
    steps, mfu = [r[STEP] for r in run.records], series(run.records, MFU)[1]
    if mfu:
        rows.append(("Mean MFU", f"{sum(mfu) / len(mfu):.1%}{_peak_sources(run.records)}"))
    rows.append(("Logged records", f"{len(steps)} (steps {steps[0]:g} to {steps[-1]:g})"))
    return rows


def _format(fmt: Callable[..., str], values: list[Any]) -> str:
    try:
        return fmt(*values)
    except (TypeError, ValueError, KeyError):  # an unexpected type: show it as written
        return ", ".join(json.dumps(v) for v in values)


def _seconds(x: float) -> str:
    return f"{format_duration(x)} ({x:,.1f} s)"


def _eng(x: float, unit: str) -> str:
    for power, prefix in ((15, "P"), (12, "T"), (9, "G"), (6, "M"), (3, "k")):
        if abs(x) >= 10 ** power:
            return f"{x / 10 ** power:,.2f} {prefix}{unit}"
    return f"{x:,.2f} {unit}"


def _layout(n: int, lay: dict[str, Any]) -> str:
    parts = " × ".join(f"{k} {lay[k]}" for k in ("dp", "pp", "tp") if k in lay)
    zero = f", ZeRO-{lay['zero']}" if lay.get("zero") else ""
    return f"{n} = {parts}{zero}"


_SUMMARY_FORMATS: list[tuple[str, tuple[str, ...], Callable[..., str]]] = [
    ("Steps", ("steps",), lambda n: f"{n:,}"),
    ("Start step", ("start_step",), lambda n: f"{n:,} (resumed)" if n else "0"),
    ("Ranks", ("world_size", "layout"), _layout),
    ("Global batch", ("global_batch",), lambda n: f"{n:,} samples"),
    ("Parameters", ("parameters",), lambda n: f"{n:,}"),
    ("Final train loss", ("final_train_loss",), lambda x: f"{x:.4f}"),
    ("Held-out loss", ("initial_eval_loss", "final_eval_loss"),
     lambda a, b: f"{a:.4f} → {b:.4f}"),
    ("Wall time", ("wall_time_s",), _seconds),
    ("Training time", ("train_time_s",), _seconds),
    ("Throughput", ("tokens_per_s",), lambda x: f"{x:,.0f} tokens/s"),
    ("Model FLOP/s", ("model_flops_per_s",), lambda x: _eng(x, "FLOP/s")),
    ("MFU", (MFU, PEAK_TFLOPS, PEAK_SOURCE),
     lambda m, p, src: f"{m:.1%} of {p:,.5g} TFLOP/s per device (peak: {src})"),
    ("Samples seen", ("samples_seen",), lambda n: f"{n:,}"),
    ("Run directory", ("run_dir",), str),
]


def _ms(x: float) -> str:
    return f"{x * 1000:,.1f} ms"


# (fields in order of preference, heading, format); total_s is the telemetry's name.
_RANK_COLUMNS: list[tuple[tuple[str, ...], str, Callable[[float], str]]] = [
    ((STEP_TIME_S, RANK_TOTAL_S), "step time", _ms), ((RANK_COMPUTE_S,), "compute", _ms),
    ((RANK_COMM_S,), "exposed comm.", _ms), ((RANK_DATA_S,), "data", _ms),
    ((TOKENS_PER_S,), "tokens/s", lambda x: f"{x:,.0f}"),
    ((RANK_SAMPLES,), "samples/step", lambda x: f"{x:,.4g}"),
    ((MEM_PEAK_MB,), "peak memory", lambda x: f"{x:,.0f} MB")]


def _first_number(entry: Record, keys: tuple[str, ...]) -> float | None:
    return next((v for k in keys if (v := _number(entry.get(k))) is not None), None)


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
    cells = "".join(f"<td>{fmt(v) if (v := _first_number(e, keys)) is not None else '–'}"
                    "</td>" for keys, _, fmt in cols)
    mark = f'<td class="warn">{flagged} of {n_records}</td>' if flagged else "<td>–</td>"
    return f"<tr><td>{html.escape(str(e.get(RANK)))}</td>{cells}{mark}</tr>"


def _ranks_table(records: list[Record]) -> str:
    """Per-rank figures of the last record that has them, with straggler counts."""
    latest = next((r for r in reversed(records) if r.get(RANKS)), None)
    if latest is None:
        return ""
    ranks = [e for e in latest[RANKS] if isinstance(e, dict) and isinstance(e.get(RANK), int)]
    cols = [c for c in _RANK_COLUMNS if any(_first_number(e, c[0]) is not None for e in ranks)]
    slow = straggler_counts(records)
    shown = _ranks_shown(ranks, slow)
    rows = "".join(_rank_row(e, cols, slow.get(e.get(RANK), 0), len(records)) for e in shown)
    more = (f" Showing the {len(shown)} of {len(ranks)} ranks most often flagged as "
            "stragglers, then slowest." if len(shown) < len(ranks) else "")
    head = "".join(f"<th>{label}</th>" for _, label, _ in cols)
    return (f'<section><h2>Ranks</h2><p class="note">At step {latest[STEP]:g}, the last '
            f"record with per-rank figures.{more}</p><table class=\"grid\"><tr><th>rank</th>"
            f"{head}<th>flagged as straggler</th></tr>{rows}</table></section>")


def _plot_card(plot: Plot) -> str:
    title = html.escape(plot.title)
    if plot.png is None:
        inner = f'<div class="missing">{html.escape(plot.missing)}</div>'
    else:
        data = base64.b64encode(plot.png).decode("ascii")
        inner = f'<img src="data:image/png;base64,{data}" alt="{title}">'
    wide = " wide" if plot.wide else ""
    return (f'<figure class="card{wide}" id="plot-{plot.name}"><h3>{title}</h3>{inner}'
            f"<figcaption>{html.escape(plot.caption)}</figcaption></figure>")


def render_html(run: RunData, plots: list[Plot]) -> str:
    """The whole page: summary, plots as data URIs, per-rank table, config."""
    name = html.escape(run.run_dir.resolve().name)
    rows = "".join(f'<div class="stat"><div class="k">{html.escape(k)}</div>'
                   f'<div class="v">{html.escape(v)}</div></div>' for k, v in summary_rows(run))
    config = (f"<pre>{html.escape(run.config_text)}</pre>" if run.config_text is not None
              else f'<p class="note">no {CONFIG_FILE} in the run directory</p>')
    stamp = time.strftime("%Y-%m-%d %H:%M")
    no_summary = ("" if run.summary else f'<p class="note">Summary not available: no '
                  f"{SUMMARY_FILE} (the run has not finished, or it stopped early).</p>")
    return _PAGE.format(
        name=name, where=html.escape(str(run.run_dir.resolve())), stamp=stamp,
        no_summary=no_summary,
        rows=rows, plots="".join(_plot_card(p) for p in plots),
        ranks=_ranks_table(run.records), config=config)


_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>disttrain report: {name}</title>
<style>
body {{ font: 15px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "Liberation Sans",
  "DejaVu Sans", sans-serif; color: #1d2330; background: #f4f5f7; margin: 0; }}
main {{ max-width: 1180px; margin: 0 auto; padding: 24px 28px 40px; }}
h1 {{ font-size: 24px; margin: 0 0 2px; }}
h2 {{ font-size: 17px; margin: 28px 0 10px; }}
h3 {{ font-size: 15px; margin: 0 0 6px; }}
.sub, .note, figcaption {{ color: #5d6575; font-size: 13px; }}
.sub {{ margin: 0; word-break: break-all; }}
table {{ border-collapse: collapse; background: #fff; border-radius: 8px;
  box-shadow: 0 1px 2px rgba(0,0,0,.08); font-variant-numeric: tabular-nums; }}
th, td {{ text-align: left; padding: 6px 14px; border-bottom: 1px solid #eceef1;
  vertical-align: top; }}
tr:last-child th, tr:last-child td {{ border-bottom: 0; }}
.stats {{ display: grid; grid-template-columns: repeat(auto-fill, minmax(250px, 1fr));
  gap: 10px; }}
.stat {{ background: #fff; border-radius: 8px; box-shadow: 0 1px 2px rgba(0,0,0,.08);
  padding: 8px 14px; }}
.stat .k {{ color: #5d6575; font-size: 12.5px; }}
.stat .v {{ font-size: 16px; font-weight: 600; font-variant-numeric: tabular-nums;
  overflow-wrap: anywhere; }}
.grid th {{ background: #fafbfc; font-weight: 600; }}
.warn {{ color: #b42318; font-weight: 600; }}
.plots {{ display: grid; grid-template-columns: repeat(auto-fit, minmax(520px, 1fr));
  gap: 16px; }}
.card {{ background: #fff; border-radius: 8px; box-shadow: 0 1px 2px rgba(0,0,0,.08);
  margin: 0; padding: 14px 16px 12px; display: flex; flex-direction: column; }}
.card.wide {{ grid-column: 1 / -1; }}
.card img {{ display: block; width: 100%; height: auto; }}
.missing {{ display: flex; align-items: center; justify-content: center;
  flex: 1; min-height: 90px; background: #fafbfc; border: 1px dashed #c9ced6;
  border-radius: 6px; color: #5d6575; padding: 0 18px; text-align: center; }}
figcaption {{ margin-top: 4px; }}
pre {{ background: #fff; border-radius: 8px; box-shadow: 0 1px 2px rgba(0,0,0,.08);
  padding: 12px 16px; overflow-x: auto; font: 13px/1.45 ui-monospace, "DejaVu Sans Mono",
  "Liberation Mono", monospace; }}
</style></head>
<body><main>
<h1>disttrain report: {name}</h1>
<p class="sub">{where} · generated {stamp}</p>
<section><h2>Summary</h2>{no_summary}<div class="stats">{rows}</div></section>
<section><h2>Plots</h2><div class="plots">{plots}</div></section>
{ranks}
<section><h2>Configuration</h2>{config}</section>
</main>
<script>
// Marks how many plots decoded, so a headless browser can check the page rendered.
window.addEventListener("load", function () {{
  var n = 0, imgs = document.images;
  for (var i = 0; i < imgs.length; i++) if (imgs[i].naturalWidth > 0) n++;
  document.body.setAttribute("data-images-loaded", n + "/" + imgs.length);
}});
</script>
</body></html>
"""


# --------------------------------------------------------------------------- entry points
def build_report(run_dir: Path, out_dir: Path | None = None) -> Path:
    """Write the PNGs and ``report.html`` for ``run_dir`` into ``out_dir`` (default
    ``run_dir/report``); return the HTML file's path."""
    run = load_run(Path(run_dir))
    _matplotlib()  # refuse before writing anything
    out = Path(out_dir) if out_dir is not None else run.run_dir / REPORT_DIR
    out.mkdir(parents=True, exist_ok=True)
    plots = [make(run) for make in PLOTS]
    for plot in plots:
        stale = out / f"{plot.name}.png"
        if plot.png is not None:
            stale.write_bytes(plot.png)
        elif stale.is_file():  # from an earlier report of a run that recorded it
            stale.unlink()
    page = out / REPORT_FILE
    page.write_text(render_html(run, plots), encoding="utf-8")
    return page


def add_report_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``disttrain report RUN_DIR [--out DIR]`` on the CLI's subparsers."""
    report = sub.add_parser(
        "report", help="PNG plots and a self-contained HTML page of a run",
        description="Plot a run's loss, throughput, MFU, time per step and memory as PNGs "
        "and write report.html, one self-contained page (plots embedded) with the run's "
        "summary and config. Needs matplotlib: pip install 'disttrain[report]'.")
    report.add_argument("run_dir", metavar="RUN_DIR", help="a run directory")
    report.add_argument("--out", default=None, metavar="DIR",
                        help="where the PNGs and report.html go (default RUN_DIR/report)")


def run_report(ns: argparse.Namespace) -> int:
    """The ``report`` subcommand: build the report, print the HTML file's path."""
    page = build_report(Path(ns.run_dir), Path(ns.out) if ns.out else None)
    print(page)
    return 0
