"""The import graph of disttrain, read from the source with ``ast``, at two levels.

Nothing is imported or executed: every ``import`` / ``from ... import`` statement in every
module (inside functions and ``TYPE_CHECKING`` blocks too, since they still bind the
modules together) becomes an edge between top-level nodes: a subpackage (``comm``,
``parallel``, ...) or a single top-level module (``errors``, ``names``, ...); and,
at the file level, between the modules themselves (a package's ``__init__`` is a module
named after the package). Last, what ``train/`` may not spell: the data-parallel
strategies it drives through the protocols of ``parallel/``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
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

# Cycles between files that exist today and are another change's to remove (train/ is
# being rewritten). Empty this set as they go: a stale entry fails
# test_known_file_cycles_still_exist.
KNOWN_FILE_CYCLES: frozenset[frozenset[str]] = frozenset()

# train/ drives every data-parallel strategy through parallel/'s protocols and never
# names one: it imports no strategy package and no strategy-choice constant, and spells
# none of these as a whole string constant.
STRATEGY_PACKAGES = ("disttrain.parallel.sync", "disttrain.parallel.onebit",
                     "disttrain.parallel.zero")
STRATEGY_STRINGS = frozenset({"local_sgd", "diloco", "async", "fedavg", "onebit_adam",
                              "zero", "ddp"})
NAMES_MODULE = "disttrain.names"


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


def import_targets(tree: ast.AST, module: str, path: Path, modules: set[str]
                   ) -> Iterator[tuple[int, str]]:
    """(line, absolute dotted name) of everything ``tree`` imports. ``from X import a``
    names ``X.a`` when that is one of ``modules`` (a submodule), else ``X`` (``a`` is
    bound in it), so ``from . import errors`` in a top-level module is an edge to
    ``errors`` alone."""
    for stmt in ast.walk(tree):
        if isinstance(stmt, ast.Import):
            for alias in stmt.names:
                yield stmt.lineno, alias.name
        elif isinstance(stmt, ast.ImportFrom):
            base = _resolve_from(stmt, module, path)
            for alias in stmt.names:
                full = f"{base}.{alias.name}"
                yield stmt.lineno, full if full in modules else base


def imported_modules(tree: ast.AST, module: str, path: Path, modules: set[str]) -> set[str]:
    """Absolute dotted names of what ``tree`` imports (:func:`import_targets`)."""
    return {name for _, name in import_targets(tree, module, path, modules)}


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


def parsed_modules(src: Path) -> tuple[set[str], list[tuple[str, Path, ast.AST]]]:
    """Every module's dotted name, and (name, path, syntax tree) of each, sorted."""
    paths = sorted((src / ROOT).rglob("*.py"))
    parsed = [(module_name(p, src), p, ast.parse(p.read_text(), filename=str(p)))
              for p in paths]
    return {m for m, _, _ in parsed}, parsed


def import_graph(src: Path) -> dict[Edge, list[str]]:
    """Package-level edges (importer, imported), each with the modules that make it."""
    nodes = top_level_nodes(src)
    modules, parsed = parsed_modules(src)
    edges: dict[Edge, list[str]] = {}
    for module, path, tree in parsed:
        here = node_of(module, nodes)
        for target in {node_of(n, nodes)
                       for n in imported_modules(tree, module, path, modules)}:
            if target is not None and target != here:
                edges.setdefault((here, target), []).append(module)
    return edges


def file_import_graph(src: Path) -> dict[Edge, list[int]]:
    """File-level edges (importer, imported module), each with the lines that make it.

    ``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to
    ``pkg``'s ``__init__`` (so a package that re-exports a submodule which imports from
    the package is a cycle, as it is when Python runs it); names that are no file
    (outside disttrain, a namespace package such as ``parallel``) are no node. The
    parent packages Python initialises before a submodule are not edges: they run
    first whoever imports, and cannot need the importer's names."""
    modules, parsed = parsed_modules(src)
    edges: dict[Edge, list[int]] = {}
    for module, path, tree in parsed:
        for line, target in import_targets(tree, module, path, modules):
            if target in modules and target != module:
                edges.setdefault((module, target), []).append(line)
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


def _describe_files(component: set[str], edges: dict[Edge, list[int]]) -> str:
    inside = sorted(e for e in edges if e[0] in component and e[1] in component)
    return "; ".join(f"{a} -> {b} (line {', '.join(map(str, sorted(set(edges[(a, b)]))))})"
                     for a, b in inside)


def file_cycles(edges: dict[Edge, list[int]]) -> list[set[str]]:
    """Groups of files that all import each other, directly or not (:func:`cycles`)."""
    return cycles(set(edges))


def is_strategy_choice(name: str) -> bool:
    """A constant of :mod:`disttrain.names` that names a data-parallel strategy's
    communication: a sync mode, a gradient codec, an optimizer with its own exchange."""
    return (name.startswith(("SYNC_", "CODEC_")) or name.endswith("CODECS")
            or name == "OPTIMIZER_ONEBIT_ADAM")


def _under(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def strategy_spellings(src: Path, package: str = f"{ROOT}.train") -> list[str]:
    """``path:line: what`` for every place a module of ``package`` names a data-parallel
    strategy: an import of a strategy package, of a strategy-choice constant from
    :mod:`disttrain.names` (or an attribute of that name), a strategy string constant."""
    modules, parsed = parsed_modules(src)
    found: list[tuple[str, int, str]] = []
    for module, path, tree in parsed:
        if not _under(module, (package,)):
            continue
        where = path.relative_to(src).as_posix()
        found += [(where, line, f"imports {target}")
                  for line, target in set(import_targets(tree, module, path, modules))
                  if _under(target, STRATEGY_PACKAGES)]
        found += [(where, line, what) for line, what in _strategy_nodes(tree, module, path)]
    return [f"{where}:{line}: {what}" for where, line, what in sorted(found)]


def _strategy_nodes(tree: ast.AST, module: str, path: Path) -> list[tuple[int, str]]:
    """(line, what) of the strategy-choice names and strings in ``tree``."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and _resolve_from(node, module, path) == NAMES_MODULE:
            out += [(node.lineno, f"imports {a.name} from {NAMES_MODULE}")
                    for a in node.names if is_strategy_choice(a.name)]
        elif isinstance(node, ast.Attribute) and is_strategy_choice(node.attr):
            out.append((node.lineno, f"uses .{node.attr}"))
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and node.value in STRATEGY_STRINGS):
            out.append((node.lineno, f"spells {node.value!r}"))
    return out


@pytest.fixture(scope="module")
def graph() -> dict[Edge, list[str]]:
    return import_graph(SRC)


@pytest.fixture(scope="module")
def file_graph() -> dict[Edge, list[int]]:
    return file_import_graph(SRC)


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


def test_no_cycle_between_files(file_graph: dict[Edge, list[int]]) -> None:
    found = [c for c in file_cycles(file_graph) if frozenset(c) not in KNOWN_FILE_CYCLES]
    assert not found, "import cycles between files: " + " | ".join(
        _describe_files(c, file_graph) for c in found)


def test_known_file_cycles_still_exist(file_graph: dict[Edge, list[int]]) -> None:
    """An allow-listed cycle that is gone (or that other files have joined, which
    test_no_cycle_between_files names) must be removed from KNOWN_FILE_CYCLES."""
    found = {frozenset(c) for c in file_cycles(file_graph)}
    stale = sorted(sorted(c) for c in KNOWN_FILE_CYCLES - found)
    assert not stale, f"remove {stale} from KNOWN_FILE_CYCLES: those cycles are gone"


def test_train_spells_no_data_parallel_strategy() -> None:
    found = strategy_spellings(SRC)
    assert not found, "train/ names data-parallel strategies:\n" + "\n".join(found)


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


def test_file_graph_counts_a_package_init_cycle(tmp_path: Path) -> None:
    """A package ``__init__`` that re-exports a submodule which imports from the
    package is a cycle; ``from pkg import sub`` is an edge to the submodule alone."""
    _write(tmp_path, "disttrain/__init__.py")
    _write(tmp_path, "disttrain/p/__init__.py", "from .a import A\n")
    _write(tmp_path, "disttrain/p/a.py", "A = 1\ndef f():\n    from disttrain.p import B\n")
    _write(tmp_path, "disttrain/p/b.py", "from disttrain.p import a\nimport disttrain.q.c\n")
    _write(tmp_path, "disttrain/q/c.py", "from ..p import b\n")
    edges = file_import_graph(tmp_path)
    assert set(edges) == {
        ("disttrain.p", "disttrain.p.a"), ("disttrain.p.a", "disttrain.p"),
        ("disttrain.p.b", "disttrain.p.a"), ("disttrain.p.b", "disttrain.q.c"),
        ("disttrain.q.c", "disttrain.p.b")}
    assert file_cycles(edges) == [{"disttrain.p", "disttrain.p.a"},
                                  {"disttrain.p.b", "disttrain.q.c"}]


def test_strategy_spellings_are_found(tmp_path: Path) -> None:
    """The train/ check itself: imports of strategy packages and constants, their
    attributes and whole string constants, at their lines; not substrings, comments,
    other packages."""
    _write(tmp_path, "disttrain/__init__.py")
    _write(tmp_path, "disttrain/names.py", "SYNC_ASYNC = 'async'\n")
    _write(tmp_path, "disttrain/parallel/zero/__init__.py")
    _write(tmp_path, "disttrain/parallel/zero/flat.py")
    _write(tmp_path, "disttrain/parallel/sync/__init__.py")
    _write(tmp_path, "disttrain/train/__init__.py")
    _write(tmp_path, "disttrain/train/step.py",
           "from ..names import SCHEDULE_GPIPE, SYNC_ASYNC\n"
           "from ..parallel.zero.flat import x\n"
           "from ..parallel import sync\n"
           "def f(names, mode):\n"
           "    # 'zero' in a comment, 'zero stage' below: neither counts\n"
           "    return mode == names.OPTIMIZER_ONEBIT_ADAM or mode == 'zero stage'\n"
           "LAYOUT = {'zero': 1}\n")
    _write(tmp_path, "disttrain/other.py", "MODE = 'ddp'\n")
    assert strategy_spellings(tmp_path) == [
        "disttrain/train/step.py:1: imports SYNC_ASYNC from disttrain.names",
        "disttrain/train/step.py:2: imports disttrain.parallel.zero.flat",
        "disttrain/train/step.py:3: imports disttrain.parallel.sync",
        "disttrain/train/step.py:6: uses .OPTIMIZER_ONEBIT_ADAM",
        "disttrain/train/step.py:7: spells 'zero'"]
