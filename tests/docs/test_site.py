"""The documentation site builds with ``mkdocs build --strict`` (broken links, missing
anchors and bad references fail it); its generated references list every
configuration key and every subcommand with its options; and, where Chromium is
installed, the home page and a strategy page render to a non-blank screenshot."""

from __future__ import annotations

import html
import shutil
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

pytest.importorskip("mkdocs", reason="mkdocs is not installed (the test extras have it)")
pytest.importorskip("material", reason="mkdocs-material is not installed")
pytest.importorskip("mkdocstrings", reason="mkdocstrings is not installed")

from disttrain.cli import build_parser  # noqa: E402
from disttrain.config.schema import SECTIONS, config_key  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BUILD_TIMEOUT_S = 300
CHROMIUM = shutil.which("chromium")
CHROMIUM_TIMEOUT_S = 60


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                           "-f", str(ROOT / "mkdocs.yml"), "-d", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return out


def _page(site: Path, path: str) -> str:
    return (site / path / "index.html").read_text(encoding="utf-8")


def test_every_page_of_the_nav_is_built(site):
    for path in ("getting-started", "guides/default-job", "guides/finetune", "guides/plan",
                 "guides/clusters", "guides/resume-reshard-export", "guides/report",
                 "strategies/data-parallel", "strategies/zero", "strategies/tensor",
                 "strategies/pipeline", "strategies/hybrid", "strategies/sync-modes",
                 "strategies/compression", "strategies/onebit-adam", "checkpoints",
                 "monitoring", "testing", "architecture", "reference/api/disttrain",
                 "reference/api/parallel", "reference/api/testing", "reference/api/weights"):
        assert (site / path / "index.html").is_file(), path
    assert (site / "index.html").is_file()


def test_the_config_reference_lists_every_key(site):
    page = _page(site, "reference/config")
    missing = [f"{name}.{config_key(f)}" for name, cls in SECTIONS.items()
               for f in fields(cls) if html.escape(f"{name}.{config_key(f)}") not in page]
    assert not missing, missing
    for name in SECTIONS:
        assert f"[{name}]" in page, name
    assert "unknown key" not in page and "train.steps" in page


def _commands(parser, prog="disttrain"):
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield f"{prog} {name}", sub
                yield from _commands(sub, f"{prog} {name}")


def test_the_cli_reference_lists_every_subcommand_and_option(site):
    page = _page(site, "reference/cli")
    missing = []
    for prog, parser in _commands(build_parser()):
        if f">{prog}<" not in page.replace("</code>", "<").replace("<code>", ">"):
            missing.append(prog)
        for action in parser._actions:
            missing += [f"{prog} {opt}" for opt in action.option_strings
                        if f"<code>{html.escape(opt)}" not in page]
    assert not missing, missing


def test_the_api_reference_shows_the_public_api(site):
    import disttrain
    import disttrain.parallel

    api = _page(site, "reference/api/disttrain")
    assert all(name in api for name in disttrain.__all__ if name != "__version__")
    parallel = _page(site, "reference/api/parallel")
    assert all(name in parallel for name in disttrain.parallel.__all__)


def _screenshot(page: Path, shot: Path, profile: Path) -> None:
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--no-first-run", "--disable-background-networking", "--hide-scrollbars",
             f"--user-data-dir={profile}", f"--screenshot={shot}", "--window-size=1200,900"]
    done = subprocess.run([CHROMIUM, *flags, page.as_uri()], capture_output=True,
                          text=True, timeout=CHROMIUM_TIMEOUT_S)
    assert shot.is_file(), f"no screenshot of {page}: {done.stderr[-2000:]}"


@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed "
                    "(apt-get install chromium), so the pages cannot be rendered")
@pytest.mark.parametrize("path", ["index.html", "strategies/zero/index.html"])
def test_pages_render_in_headless_chromium(site, tmp_path, path):
    np = pytest.importorskip("numpy")
    image = pytest.importorskip("matplotlib.image")
    shot = tmp_path / "shot.png"
    _screenshot(site / path, shot, tmp_path / "profile")
    pixels = image.imread(shot, format="png")
    assert pixels.shape[:2] == (900, 1200)
    assert pixels[..., :3].std() > 0.05, f"the screenshot of {path} is blank"
    rgb = (pixels[..., :3] * 255).round().astype(np.uint32)
    colours = len(np.unique(rgb[..., 0] << 16 | rgb[..., 1] << 8 | rgb[..., 2]))
    assert colours > 50, f"the screenshot of {path} is nearly blank ({colours} colours)"
