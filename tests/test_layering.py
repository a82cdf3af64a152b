"""The package-level import graph of disttrain, read from the source with ``ast``.

Nothing is imported or executed: every ``import`` / ``from ... import`` statement in every
module (inside functions and ``TYPE_CHECKING`` blocks too, since they still bind the
packages together) becomes an edge between top-level nodes: a subpackage (``comm``,
``parallel``, ...) or a single top-level module (``errors``, ``names``, ...).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
ROOT = "disttrain"

Edge = tuple[str, str]

# Upward edges that exist today and are another change's to remove (whole-config
# validation leaves config/; parallel/ takes a model spec instead of the built-in GPT).
# Empty this set as they go: a stale entry fails test_known_edges_still_exist.
KNOWN_TO_REMOVE: frozenset[Edge] = frozenset()

# Edges that must not exist even without a cycle: parallel/ works on any model through
# its spec, not on the built-in GPT; comm sits below monitor (the watchdog and telemetry
# are about collectives), and records its spans through comm.spans.SpanRecorder.
FORBIDDEN: frozenset[Edge] = frozenset({
    ("parallel", "models"),
    ("comm", "monitor"),
})


def module_name(path: Path, src: Path) -> str:
    """``src/disttrain/comm/buckets.py`` -> ``disttrain.comm.buckets``; a package's
    ``__init__.py`` is named after the package."""
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _package_of(module: str, path: Path) -> str:
    """The package a relative import in ``module`` starts from (level 1)."""
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def imported_modules(tree: ast.AST, module: str, path: Path, modules: set[str]) -> set[str]:
    """Absolute dotted names of what ``tree`` imports. ``from X import a`` names ``X.a``
    when that is one of ``modules`` (a submodule), else ``X`` (``a`` is bound in it), so
    ``from . import errors`` in a top-level module is an edge to ``errors`` alone."""
    out: set[str] = set()
    for stmt in ast.walk(tree):
        if isinstance(stmt, ast.Import):
            out.update(alias.name for alias in stmt.names)
        elif isinstance(stmt, ast.ImportFrom):
            base = _resolve_from(stmt, module, path)
            out.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                       for alias in stmt.names)
    return out


def _resolve_from(stmt: ast.ImportFrom, module: str, path: Path) -> str:
    if stmt.level == 0:
        return stmt.module or ""
    package = _package_of(module, path).split(".")
    if stmt.level - 1 >= len(package):
        raise ValueError(f"{path}:{stmt.lineno}: relative import beyond the top package")
    base = package[:len(package) - (stmt.level - 1)]
    return ".".join(base + ([stmt.module] if stmt.module else []))


def node_of(name: str, nodes: set[str]) -> str | None:
    """The graph node a dotted name falls in: ``disttrain.comm.buckets`` -> ``comm``,
    ``disttrain.errors`` -> ``errors``, ``disttrain`` -> ``disttrain``; None outside."""
    parts = name.split(".")
    if parts[0] != ROOT:
        return None
    if len(parts) > 1 and parts[1] in nodes:
        return parts[1]
    return ROOT


def top_level_nodes(src: Path) -> set[str]:
    """Subpackages (namespace ones too: ``parallel/`` has no ``__init__.py``) and single
    modules directly under the package, plus the package."""
    pkg = src / ROOT
    names = {p.name for p in pkg.iterdir() if p.is_dir() and any(p.rglob("*.py"))}
    names |= {p.stem for p in pkg.glob("*.py") if p.stem != "__init__"}
    return names | {ROOT}


def import_graph(src: Path) -> dict[Edge, list[str]]:
    """Package-level edges (importer, imported), each with the modules that make it."""
    nodes = top_level_nodes(src)
    paths = sorted((src / ROOT).rglob("*.py"))
    modules = {module_name(p, src) for p in paths}
    edges: dict[Edge, list[str]] = {}
    for path in paths:
        module = module_name(path, src)
        here = node_of(module, nodes)
        tree = ast.parse(path.read_text(), filename=str(path))
        for target in {node_of(n, nodes)
                       for n in imported_modules(tree, module, path, modules)}:
            if target is not None and target != here:
                edges.setdefault((here, target), []).append(module)
    return edges


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Nodes reachable from ``start`` over one edge or more."""
    seen: set[str] = set()
    todo = list(graph[start])
    while todo:
        v = todo.pop()
        if v not in seen:
            seen.add(v)
            todo.extend(graph[v])
    return seen


def cycles(edges: set[Edge]) -> list[set[str]]:
    """Groups of nodes that all reach each other (strongly connected components of more
    than one node), sorted; the graph has a few dozen nodes, so plain reachability."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    reach = {v: _reachable(graph, v) for v in graph}
    groups = {frozenset({v} | {w for w in reach[v] if v in reach[w]}) for v in graph}
    return sorted((set(g) for g in groups if len(g) > 1), key=sorted)


def _describe(component: set[str], edges: dict[Edge, list[str]]) -> str:
    inside = sorted(e for e in edges if e[0] in component and e[1] in component)
    return "; ".join(f"{a} -> {b} (in {', '.join(sorted(edges[(a, b)]))})" for a, b in inside)


@pytest.fixture(scope="module")
def graph() -> dict[Edge, list[str]]:
    return import_graph(SRC)


def test_no_cycle_between_packages(graph: dict[Edge, list[str]]) -> None:
    allowed = {e: mods for e, mods in graph.items() if e not in KNOWN_TO_REMOVE}
    found = cycles(set(allowed))
    assert not found, "import cycles between packages: " + " | ".join(
        _describe(c, allowed) for c in found)


@pytest.mark.parametrize("edge", sorted(FORBIDDEN), ids="->".join)
def test_forbidden_edge_absent(graph: dict[Edge, list[str]], edge: Edge) -> None:
    if edge in KNOWN_TO_REMOVE:
        pytest.skip(f"{edge} is listed in KNOWN_TO_REMOVE")
    assert edge not in graph, f"{edge[0]} imports {edge[1]} in {sorted(graph.get(edge, []))}"


def test_known_edges_still_exist(graph: dict[Edge, list[str]]) -> None:
    """An allow-list entry whose import is gone must be removed from KNOWN_TO_REMOVE."""
    stale = sorted(KNOWN_TO_REMOVE - set(graph))
    assert not stale, f"remove {stale} from KNOWN_TO_REMOVE: those imports are gone"


def _write(root: Path, rel: str, text: str = "") -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_graph_resolves_relative_and_nested_imports(tmp_path: Path) -> None:
    """The reader itself: relative imports at every depth, from a package's
    ``__init__``, inside functions, absolute ones, and names vs submodules."""
    _write(tmp_path, "disttrain/__init__.py", "from .cfg import Config\n")
    _write(tmp_path, "disttrain/errors.py")
    _write(tmp_path, "disttrain/cli.py", "from . import errors\nfrom .par.sub import deep\n")
    _write(tmp_path, "disttrain/cfg/__init__.py", "from .. import errors\n")
    _write(tmp_path, "disttrain/par/base.py", "from ..cfg import Config\n")
    _write(tmp_path, "disttrain/par/sub/__init__.py")
    _write(tmp_path, "disttrain/par/sub/deep.py",
           "from ... import errors\nfrom . import x\n"
           "def f():\n    from ...mon.trace import T\n    import disttrain.io\n")
    _write(tmp_path, "disttrain/mon/__init__.py")
    _write(tmp_path, "disttrain/mon/trace.py", "from disttrain import Config\n")
    _write(tmp_path, "disttrain/io.py", "import os\nfrom torch import nn\n")
    assert set(import_graph(tmp_path)) == {
        ("disttrain", "cfg"), ("cfg", "errors"), ("par", "cfg"), ("par", "errors"),
        ("par", "mon"), ("par", "io"), ("mon", "disttrain"), ("cli", "errors"),
        ("cli", "par")}


def test_a_new_cycle_is_reported(tmp_path: Path) -> None:
    _write(tmp_path, "disttrain/__init__.py")
    _write(tmp_path, "disttrain/a/__init__.py", "from ..b import x\n")
    _write(tmp_path, "disttrain/b/__init__.py", "def f():\n    from ..c import y\n")
    _write(tmp_path, "disttrain/c/__init__.py", "from disttrain.a.m import z\n")
    _write(tmp_path, "disttrain/d/__init__.py", "from ..a import x\n")
    assert cycles(set(import_graph(tmp_path))) == [{"a", "b", "c"}]
