"""``disttrain report``: PNG plots and a self-contained HTML page from a run directory.

The run directories here are fake but shaped like real ones: one with every metric
(MFU, the time breakdown, memory, per-rank figures, stragglers) and one with only the
fields every disttrain version records.
"""

from __future__ import annotations

import argparse
import base64
import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from disttrain.commands import report as report_command
from disttrain.errors import UserError
from disttrain.monitor import report
from disttrain.monitor.report import cards, plots

pytestmark = pytest.mark.slow  # spawns worlds or trains: not in the quick check

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ALL_PLOTS = ["loss", "throughput", "mfu", "time", "memory"]
TODAY_PLOTS = ["loss", "throughput", "time"]
IMG_RE = re.compile(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)"')
CONFIG = '[model]\nn_layer = 6\nname = "<b>gpt</b> & co"\n[train]\nsteps = 300\n'


def _record(step: int, full: bool, world: int = 4) -> dict:
    """One metrics.jsonl record at ``step`` of a 300-step run on ``world`` ranks."""
    noise = 0.03 * math.sin(step * 1.7)
    compute, comm, data, optim = 0.210 + noise / 10, 0.031, 0.008, 0.012
    step_time = compute + comm + data + optim + 0.006
    tokens = 32 * 128 / step_time * (0.6 if step <= 10 else 1.0)
    rec = {"step": step, "loss": 2.1 + 3.3 * math.exp(-step / 60) + noise,
           "lr": 3e-3 * min(1.0, step / 30), "grad_norm": 1.5 * math.exp(-step / 200) + 0.2,
           "tokens_per_s": tokens, "samples_per_s": tokens / 128, "step_time_s": step_time,
           "data_time_s": data, "samples_seen": step * 32, "checkpoint_stall_s": 0.004}
    if step % 30 == 0:  # the default cadence: about ten evaluations a run
        rec["eval_loss"] = 2.2 + 3.1 * math.exp(-step / 60)
    if not full:
        return rec
    rec.update(comm_bytes_per_step=3363856.0, grad_sync_bytes=3363840,
               memory_mb={"activations": 68.29785537719727, "grads": 3.2080078125,
                          "optimizer": 6.416015625, "params": 3.2080078125})
    slow = [3] if step % 40 == 0 else []
    rec.update(mfu=0.38 + noise, peak_source="measured:cpu", time_compute_s=compute,
               time_comm_s=comm, time_data_s=data, time_optim_s=optim,
               mem_peak_mb=2100 + step * 1.2, stragglers=slow)
    rec["ranks"] = [{"rank": r, "total_s": step_time * (1.3 if r in slow else 1.0),
                     "compute_s": compute, "comm_s": comm, "data_s": data,
                     "samples": 32 / world, "mem_peak_mb": 2100 + step * 1.2 + 90 * r}
                    for r in range(world)]
    return rec


def _summary(run_dir: Path, full: bool) -> dict:
    summary = {"steps": 300, "start_step": 0, "world_size": 4,
               "layout": {"dp": 2, "pp": 1, "tp": 2, "zero": 0}, "global_batch": 32,
               "final_train_loss": 2.1234, "initial_eval_loss": 5.3012,
               "final_eval_loss": 2.1456, "wall_time_s": 97.3, "train_time_s": 80.25,
               "tokens_per_s": 15873.4, "samples_seen": 9600, "run_dir": str(run_dir),
               "parameters": 826112}
    if full:  # as the trainer writes them (train/trainer.py, Trainer._finish)
        memory = {"activations": 71615492, "grads": 3363840, "optimizer": 6727680,
                  "params": 3363840}
        summary |= {"model_flops_per_s": 7.9e10, "mfu": 0.381, "peak_tflops": 0.05,
                    "peak_source": "measured:cpu", "comm_bytes_per_step": 3363856.0,
                    "collectives": 179, "nonfinite_skipped": 0, "device_name": "cpu",
                    "memory_bytes": memory,
                    "memory_bytes_per_rank": [memory, memory, dict(memory, params=1e6),
                                              memory]}
    return summary


def write_run(run_dir: Path, full: bool = True, config: bool = True) -> Path:
    run_dir.mkdir(parents=True)
    records = [_record(s, full) for s in range(10, 301, 10)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run_dir / "summary.json").write_text(json.dumps(_summary(run_dir, full), indent=2))
    if config:
        (run_dir / "config.toml").write_text(CONFIG)
    return run_dir


def _decode_png(path_or_bytes):
    import io

    from matplotlib.image import imread

    src = io.BytesIO(path_or_bytes) if isinstance(path_or_bytes, bytes) else path_or_bytes
    return imread(src, format="png")


# ----------------------------------------------------------------------- loading, errors
def test_missing_run_dir_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="does not exist.*give the directory"):
        report.build_report(tmp_path / "nope")


def test_run_dir_without_metrics_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="no metrics.jsonl"):
        report.build_report(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("\n")
    with pytest.raises(UserError, match="holds no records"):
        report.build_report(tmp_path)


def test_torn_last_line_is_dropped_a_bad_middle_line_is_an_error(tmp_path):
    good = json.dumps({"step": 10, "loss": 3.0})
    (tmp_path / "metrics.jsonl").write_text(f'{good}\n{{"step": 20, "lo')
    assert [r["step"] for r in report.load_run(tmp_path).records] == [10]
    (tmp_path / "metrics.jsonl").write_text(f'{good}\nnot json\n{good}\n')
    with pytest.raises(UserError, match="line 2 is not JSON"):
        report.load_run(tmp_path)


def test_without_matplotlib_the_error_says_how_to_install(tmp_path, monkeypatch):
    run = write_run(tmp_path / "run")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import now raises ImportError
    with pytest.raises(UserError, match=r"needs matplotlib: pip install 'disttrain\[report\]'"):
        report.build_report(run)
    assert not (run / "report").exists()


# ----------------------------------------------------------------------- pure helpers
def test_time_breakdown_parts_add_up_to_step_time():
    records = [_record(s, full=True) for s in (10, 20, 30)]
    steps, parts = plots.time_breakdown(records)
    assert steps == [10, 20, 30]
    assert list(parts) == ["compute", "exposed communication", "data loading", "optimizer",
                           "other"]
    for i, r in enumerate(records):
        assert sum(p[i] for p in parts.values()) == pytest.approx(r["step_time_s"])
        assert parts["other"][i] == pytest.approx(0.006)


def test_time_breakdown_of_an_older_run_uses_data_time():
    records = [_record(s, full=False) for s in (10, 20)]
    _, parts = plots.time_breakdown(records)
    assert list(parts) == ["data loading", "other (not broken down)"]
    assert parts["data loading"] == [0.008, 0.008]


def test_peak_memory_and_stragglers_per_rank():
    records = [_record(s, full=True) for s in (10, 40, 80)]
    assert plots.peak_memory_per_rank(records) == pytest.approx(
        {r: 2100 + 80 * 1.2 + 90 * r for r in range(4)})
    assert cards.straggler_counts(records) == {3: 2}


def test_summary_rows_format_the_summary(tmp_path):
    run = report.load_run(write_run(tmp_path / "run"))
    rows = dict(cards.summary_rows(run))
    assert rows["Ranks"] == "4 = dp 2 × pp 1 × tp 2"
    assert rows["Held-out loss"] == "5.3012 → 2.1456"
    assert rows["Throughput"] == "15,873 tokens/s"
    assert rows["Model FLOP/s"] == "79.0 GFLOP/s"
    assert rows["Wall time"] == "1 min 37 s" and rows["Training time"] == "1 min 20 s"
    assert rows["Logged records"] == "30 (steps 10 to 300)"


# ----------------------------------------------------------------------- the report
@pytest.fixture
def full_report(tmp_path):
    pytest.importorskip("matplotlib")
    run = write_run(tmp_path / "run")
    return run, report.build_report(run)


def test_report_writes_a_valid_png_per_plot(full_report):
    run, page = full_report
    assert page == run / "report" / "report.html"
    for name in ALL_PLOTS:
        data = (run / "report" / f"{name}.png").read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000, name
        pixels = _decode_png(data)
        assert pixels.shape[1] >= 900 and pixels.shape[0] >= 400, name
        assert pixels[..., :3].std() > 0.05, f"{name}.png is blank"


def test_html_is_self_contained_with_every_plot_and_the_summary(full_report):
    run, page = full_report
    text = page.read_text(encoding="utf-8")
    embedded = [base64.b64decode(m) for m in IMG_RE.findall(text)]
    assert embedded == [(run / "report" / f"{n}.png").read_bytes() for n in ALL_PLOTS]
    refs = re.findall(r'\b(?:src|href)\s*=\s*"([^"]*)"', text)
    assert refs and all(r.startswith("data:image/png;base64,") for r in refs)
    assert not re.search(r"https?://|@import|url\(", text)
    for value in ["15,873 tokens/s", "5.3012 → 2.1456", "2.1234", "826,112", "9,600",
                  "79.0 GFLOP/s", "MFU (vs measured CPU matmul rate)",
                  "38.1% of 50.0 GFLOP/s per device", "3.2 MiB sent by each rank"]:
        assert value in text, value
    assert "&lt;b&gt;gpt&lt;/b&gt; &amp; co" in text and "<b>gpt</b>" not in text
    shown = IMG_RE.sub("", text[text.index("<h2>Summary"):text.index("<h2>Configuration")])
    shown = shown.replace(str(run), "")  # the run directory's path may hold any digits
    raw = re.findall(r"(?<![\d,])\d{5,}|\.\d{5,}", shown)
    assert not raw, f"figures not written for people: {raw}"
    assert "3363856" not in shown and '{"' not in shown
    assert "not recorded" not in text
    assert re.search(r'<td class="warn">\d+ of 30</td>', text)  # rank 3 flagged
    assert "<th>step time</th><th>compute</th><th>exposed comm.</th>" in text


def test_report_of_an_older_run_marks_missing_plots_not_recorded(tmp_path):
    pytest.importorskip("matplotlib")
    run = write_run(tmp_path / "run", full=False, config=False)
    (run / "report").mkdir()
    (run / "report" / "mfu.png").write_bytes(PNG_MAGIC)  # stale, from an earlier report
    text = report.build_report(run).read_text(encoding="utf-8")
    assert len(IMG_RE.findall(text)) == len(TODAY_PLOTS)
    assert sorted(p.stem for p in (run / "report").glob("*.png")) == sorted(TODAY_PLOTS)
    for name in ("mfu", "memory"):
        card = re.search(rf'<figure class="card" id="plot-{name}">(.*?)</figure>', text, re.S)
        assert card and "not recorded" in card.group(1) and "<img" not in card.group(1)
    assert "no config.toml" in text and "Ranks</h2>" not in text


def test_unfinished_large_job_with_a_diverged_step(tmp_path):
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    run.mkdir()
    records = [_record(s, full=True, world=40) for s in (10, 20, 40)]  # rank 3 straggles
    records[1]["loss"] = float("nan")
    for entry in records[-1]["ranks"]:  # the per-rank names the issue proposed
        entry["step_time_s"], entry["tokens_per_s"] = entry.pop("total_s"), 100.0
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    text = report.build_report(run).read_text(encoding="utf-8")
    assert "Summary not available: no summary.json" in text
    assert "1 record(s) with a non-finite loss are not plotted" in text
    table = re.search(r"<h2>Ranks</h2>(.*?)</section>", text, re.S).group(1)
    shown = [int(r) for r in re.findall(r"<tr><td>(\d+)</td>", table)]
    assert len(shown) == cards.MAX_RANK_ROWS and 3 in shown and shown == sorted(shown)
    assert f"{cards.MAX_RANK_ROWS} of 40 ranks" in table
    assert '<td class="warn">1 of 3</td>' in table
    assert "<th>step time</th>" in table and "<th>tokens/s</th>" in table


def test_out_dir_and_the_cli_entry_point(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    run = write_run(tmp_path / "run")
    parser = argparse.ArgumentParser(prog="disttrain")
    report_command.add_report_parser(parser.add_subparsers(dest="command"))
    ns = parser.parse_args(["report", str(run), "--out", str(tmp_path / "out")])
    assert report_command.run_report(ns) == 0
    printed = Path(capsys.readouterr().out.strip())
    assert printed == tmp_path / "out" / "report.html" and printed.is_file()
    assert not (run / "report").exists()


def test_disttrain_report_command(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from disttrain import cli

    if "report" not in cli.build_parser().format_usage():
        pytest.skip("cli.py does not register the report subcommand yet")
    run = write_run(tmp_path / "run")
    assert cli.main(["report", str(run)]) == 0
    assert Path(capsys.readouterr().out.strip()) == run / "report" / "report.html"
    assert cli.main(["report", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err


# ----------------------------------------------------------------------- what is drawn
@pytest.fixture
def drawn(monkeypatch):
    """Figures the plots draw, by plot title (the PNG is not rendered)."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    figures = []

    def keep(draw, size):
        fig = Figure(figsize=size)
        draw(fig)
        figures.append(fig)
        return PNG_MAGIC

    monkeypatch.setattr(plots, "_render", keep)
    return figures


def test_every_plot_has_a_title_and_axes_labelled_with_units(tmp_path, drawn):
    run = report.load_run(write_run(tmp_path / "run"))
    made = [make(run) for make in plots.PLOTS]
    assert all(p.png for p in made) and len(drawn) == len(ALL_PLOTS)
    for plot, fig in zip(made, drawn, strict=True):
        for ax in fig.axes:
            assert ax.get_title(), plot.name
            assert ax.get_xlabel() in ("optimizer step", "rank"), plot.name
            assert re.search(r"nats|per second|%|\((ms|s)\)|MiB|GiB", ax.get_ylabel()), (
                plot.name, ax.get_ylabel())


def _held_out_line(fig):
    (ax,) = fig.axes
    return next(ln for ln in ax.get_lines() if ln.get_label().startswith("held-out"))


def test_held_out_loss_is_drawn_as_points_with_markers(tmp_path, drawn):
    run = report.load_run(write_run(tmp_path / "run"))
    plot = plots.loss_plot(run)
    line = _held_out_line(drawn[-1])
    assert len(line.get_xdata()) == 11  # before step 1, then every 30 steps
    assert line.get_marker() == "o" and line.get_linestyle() == "-"
    assert "held-out loss at each of the 11 evaluations" in plot.caption


def test_two_held_out_points_are_markers_only_and_the_caption_says_so(tmp_path, drawn):
    run = report.load_run(write_run(tmp_path / "run", full=False))
    records = [{k: v for k, v in r.items() if k != "eval_loss"} for r in run.records]
    records[-1]["eval_loss"] = 2.3
    plot = plots.loss_plot(report.RunData(run_dir=run.run_dir, records=records,
                                          summary=run.summary))
    line = _held_out_line(drawn[-1])
    assert list(line.get_xdata()) == [0, 300]
    assert line.get_marker() == "o" and line.get_linestyle() == "None"
    assert "only 2 evaluation(s), drawn as points without a line" in plot.caption
    assert "train.eval_every" in plot.caption


def test_the_memory_caption_names_what_is_drawn(tmp_path, drawn):
    run = report.load_run(write_run(tmp_path / "run"))
    plot = plots.memory_plot(run)
    over_time, per_rank = drawn[-1].axes
    labels = [t.get_text() for t in over_time.get_legend().get_texts()]
    assert labels == ["parameters", "gradients", "optimizer state",
                      "activations saved for backward", "peak (busiest rank)"]
    assert plot.caption.startswith("Solid: the process's peak resident set of the "
                                   "busiest rank; shaded: rank 0's parameters, gradients")
    assert "red where it was flagged as a straggler" in plot.caption
    assert len(per_rank.patches) == 4
    gpu = report.RunData(run_dir=run.run_dir, summary={"device_name": "NVIDIA H100"},
                         records=[{k: v for k, v in r.items()
                                   if k not in ("memory_mb", "ranks", "peak_source")}
                                  for r in run.records])
    caption = plots.memory_plot(gpu).caption
    assert caption == "Solid: the CUDA allocator's peak of the busiest rank."
    assert len(drawn[-1].axes) == 1 and "resident" not in caption


# ----------------------------------------------------------------------- rendering
CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")
                 if shutil.which(n)), None)


# one Chromium run's hard limit; the page renders in a few seconds
CHROMIUM_TIMEOUT_S = 30
CONSOLE_RE = re.compile(r":CONSOLE(?:\(\d+\)|:\d+)?\] (.*)")


def _chromium(page: Path, profile: Path, *args: str) -> subprocess.CompletedProcess:
    """Chromium on ``page``, logging the page's console messages to stderr."""
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--disable-quic", "--no-first-run", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--hide-scrollbars",
             "--enable-logging=stderr", "--v=0", f"--user-data-dir={profile}"]
    return subprocess.run([CHROMIUM, *flags, *args, page.as_uri()], capture_output=True,
                          text=True, timeout=CHROMIUM_TIMEOUT_S)


def console_messages(run: subprocess.CompletedProcess) -> list[str]:
    """What the page wrote to its console (errors, uncaught exceptions, failed loads);
    the report's own script writes nothing there."""
    return CONSOLE_RE.findall(run.stderr)


def _has_colour(pixels, hex_colour: str, tol: float = 0.05) -> bool:
    rgb = [int(hex_colour[i:i + 2], 16) / 255 for i in (1, 3, 5)]
    return bool((abs(pixels[..., :3] - rgb).max(axis=-1) < tol).sum() > 100)


def _distinct_colours(pixels) -> int:
    import numpy as np

    rgb = (pixels[..., :3] * 255).round().astype(np.uint32)
    return len(np.unique(rgb[..., 0] << 16 | rgb[..., 1] << 8 | rgb[..., 2]))


needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="headless Chromium is not installed (apt-get install "
    "chromium) so the page cannot be rendered")


@needs_chromium
def test_report_renders_in_headless_chromium_with_its_plots(full_report, tmp_path):
    _, page = full_report
    dom = _chromium(page, tmp_path / "profile-dom", "--dump-dom")
    loaded = re.search(r'data-images-loaded="(\d+)/(\d+)"', dom.stdout)
    assert loaded, f"no image count in the dumped DOM; stderr: {dom.stderr[-2000:]}"
    assert loaded.groups() == (str(len(ALL_PLOTS)),) * 2  # every <img> decoded
    assert console_messages(dom) == []
    shot = tmp_path / "shot.png"
    run = _chromium(page, tmp_path / "profile-shot", f"--screenshot={shot}",
                    "--window-size=1200,2000")
    assert shot.is_file(), f"no screenshot; stderr: {run.stderr[-2000:]}"
    assert console_messages(run) == []
    assert shot.read_bytes().startswith(PNG_MAGIC)
    pixels = _decode_png(shot)
    assert pixels.shape[:2] == (2000, 1200)
    assert pixels[..., :3].std() > 0.05, "the screenshot is blank"
    assert _distinct_colours(pixels) > 500, "the screenshot is nearly blank"
    for colour in (plots.LOSS_COLOR, plots.EVAL_COLOR, plots.RATE_COLOR,
                   plots.MFU_COLOR, plots.MEM_COLOR):  # the plots' lines are on screen
        assert _has_colour(pixels, colour), colour


@needs_chromium
def test_the_console_check_sees_a_script_error(full_report, tmp_path):
    """The check above could fail: a page whose script throws is caught."""
    _, page = full_report
    broken = tmp_path / "broken.html"
    broken.write_text(page.read_text(encoding="utf-8").replace(
        "</body>", "<script>undefinedReportFunction();</script></body>"), encoding="utf-8")
    messages = console_messages(_chromium(broken, tmp_path / "profile", "--dump-dom"))
    assert any("Uncaught ReferenceError: undefinedReportFunction" in m for m in messages)
