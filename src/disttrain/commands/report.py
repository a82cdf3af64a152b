"""``disttrain report RUN_DIR``: PNG plots of a run and one self-contained HTML page
(built by :func:`disttrain.monitor.report.build_report`)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_report_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``disttrain report RUN_DIR [--out DIR]`` on the CLI's subparsers."""
    report = sub.add_parser(
        "report", help="PNG plots and a self-contained HTML page of a run",
        description="Plot a run's loss, throughput, MFU, time per step and memory as PNGs "
        "and write report.html, one self-contained page (plots embedded) with the run's "
        "summary and config. Needs matplotlib: pip install 'disttrain[report]'.")
    report.add_argument("run_dir", metavar="RUN_DIR", help="a run directory")
    report.add_argument("--out", default=None, metavar="DIR",
                        help="where the PNGs and report.html go (default RUN_DIR/report)")
    return report


def run_report(ns: argparse.Namespace) -> int:
    """The ``report`` subcommand: build the report, print the HTML file's path."""
    from ..monitor.report import build_report

    page = build_report(Path(ns.run_dir), Path(ns.out) if ns.out else None)
    print(page)
    return 0
