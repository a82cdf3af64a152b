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
it is imported only when a report is built.

The parts: :mod:`.data` reads the run directory, :mod:`.formats` writes figures for
people, :mod:`.cards` the summary and ranks table, :mod:`.plots` the PNGs; this module
assembles the page.
"""

from __future__ import annotations

import base64
import html
import time
from pathlib import Path

from ...names import CONFIG_FILE, REPORT_DIR, REPORT_FILE, SUMMARY_FILE
from .cards import ranks_table, summary_rows
from .data import RunData, load_run
from .plots import PLOTS, Plot, require_matplotlib

__all__ = ["RunData", "build_report", "load_run", "render_html"]


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
        ranks=ranks_table(run.records), config=config)


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


# --------------------------------------------------------------------------- entry point
def build_report(run_dir: Path, out_dir: Path | None = None) -> Path:
    """Write the PNGs and ``report.html`` for ``run_dir`` into ``out_dir`` (default
    ``run_dir/report``); return the HTML file's path."""
    run = load_run(Path(run_dir))
    require_matplotlib()  # refuse before writing anything
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
