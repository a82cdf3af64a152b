"""The fenced code blocks of the documentation (README.md and docs/**/*.md), each with
the marker on the line before it that says how it is checked:

- ``<!-- test: run -->``: run by ``test_code_blocks.py`` (bash: each command, with
  ``disttrain train`` capped at a few steps; python: the script; toml: loaded with
  ``disttrain config show``);
- ``<!-- test: validate -->``: each ``disttrain train`` command's configuration is
  validated by ``disttrain config show`` with the same CONFIG, ``--set`` and
  ``--nproc`` (nothing is trained);
- ``<!-- test: transcript -->``: ``$ command`` lines run, their output compared;
- ``<!-- test: tests/PATH.py [...] -->``: run by the named test files;
- ``<!-- needs: gpu -->``, ``<!-- needs: cluster -->``, ``<!-- needs: setup -->``
  (creates a virtual environment and installs packages): not run by the suite;
- ``<!-- excerpt -->``: not runnable as it stands (an output listing, a layout, a
  fragment with names left undefined).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MARKER_RE = re.compile(r"^<!-- (test: \S.*|needs: (gpu|cluster|setup)|excerpt) -->$")
FENCE_RE = re.compile(r"^```(\w*)")


@dataclass(frozen=True)
class Block:
    """One fenced block: where it is, its language, its marker (None: unmarked)."""

    page: str
    line: int
    lang: str
    marker: str | None
    code: str

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def doc_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def blocks(path: Path) -> list[Block]:
    """Every fenced block of one Markdown file, in order."""
    lines = path.read_text(encoding="utf-8").split("\n")
    found, start, lang = [], None, ""
    for i, line in enumerate(lines):
        m = FENCE_RE.match(line)
        if not m:
            continue
        if start is None:
            start, lang = i, m.group(1)
            continue
        prev = lines[start - 1].strip() if start else ""
        marker = prev[5:-4].strip() if MARKER_RE.match(prev) else None
        found.append(Block(page=str(path.relative_to(ROOT)), line=start + 1, lang=lang,
                           marker=marker, code="\n".join(lines[start + 1:i]) + "\n"))
        start = None
    return found


def all_blocks() -> list[Block]:
    return [b for page in doc_pages() for b in blocks(page)]


def marked(kind: str) -> list[Block]:
    return [b for b in all_blocks() if b.marker == kind]


def commands(code: str) -> list[list[str]]:
    """The shell commands of a block as argument lists (continuations joined,
    comments dropped)."""
    text = re.sub(r"\\\n\s*", " ", code)
    return [shlex.split(line, comments=True) for line in text.splitlines()
            if shlex.split(line, comments=True)]
