"""The layout's dimensions are data: the declared list and the code that reads it.

Read from the source with ``ast`` (nothing imported for the spelling check): outside the
registry (:mod:`disttrain.dimensions`, :mod:`disttrain.parallel.dimensions`) and each
dimension's own home, ``parallel/compose.py``, ``parallel/placement.py``,
``parallel/topology.py``, ``train/`` and ``plan/`` never name a dimension. A name is
spelled when a declared entry's key or axis is a word of an identifier (an attribute
``.tp``, ``tp_size``, ``_dp_exposed``; a variable, a parameter, a keyword argument, a
function; an imported name) or of a string constant that is not a docstring (``"tp"``,
``"parallel.tp"``, ``f"pp={n}"``); or when one of these modules imports a dimension's
home. The test reads the entries, so a dimension added to the list is covered with no
change here. Then the registry itself: every entry's config key is a field of
``[parallel]``, its home is a package holding its behaviour, orders are permutations.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path

import pytest

from disttrain.config.schema import ParallelConfig
from disttrain.dimensions import DIMENSIONS, Dimension, Role, mesh_order, plan_order

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "disttrain"

# what must read the entries instead of naming a dimension (relative to the package)
CHECKED = ("parallel/compose.py", "parallel/placement.py", "parallel/topology.py", "train",
           "plan")
REGISTRY = ("dimensions.py", "parallel/dimensions.py")
# data, not code that reads the layout: the published runs' layouts as their authors gave
# them (Megatron-LM's tp / pp / dp), which the planner is judged against
PUBLISHED = ("plan/published_layouts.py",)


def _names(dims: tuple[Dimension, ...]) -> frozenset[str]:
    return frozenset({d.key for d in dims} | {d.axis for d in dims})


def _home_path(d: Dimension) -> str:
    return d.home.removeprefix("disttrain.").replace(".", "/")


def checked_files(root: Path = PACKAGE) -> list[Path]:
    """The modules under :data:`CHECKED`, less the registry and every home."""
    homes = [_home_path(d) for d in DIMENSIONS]
    out = []
    for rel in CHECKED:
        path = root / rel
        for f in sorted(path.rglob("*.py")) if path.is_dir() else [path] * path.is_file():
            where = f.relative_to(root).as_posix()
            if where in REGISTRY + PUBLISHED or any(where.startswith(h + "/") for h in homes):
                continue
            out.append(f)
    return out


def _words(text: str) -> set[str]:
    """The words of an identifier or a text: ``tp_size`` -> {tp, size}, ``pp=2`` ->
    {pp, 2}."""
    return {w for w in re.split(r"[^A-Za-z0-9]+", text) if w}


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                             ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                found.add(id(first.value))
    return found


def _identifiers(node: ast.AST) -> Iterator[str]:
    """The identifiers ``node`` spells itself."""
    if isinstance(node, ast.Name):
        yield node.id
    elif isinstance(node, ast.Attribute):
        yield node.attr
    elif isinstance(node, ast.arg):
        yield node.arg
    elif isinstance(node, ast.keyword) and node.arg is not None:
        yield node.arg
    elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        yield node.name
    elif isinstance(node, ast.alias):
        yield node.asname or node.name


def _imported_module(node: ast.AST, module: str) -> Iterator[str]:
    """Absolute dotted names an import statement in ``module`` reaches."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            parts = module.split(".")[:-node.level]
            base = ".".join([*parts, base] if base else parts)
        yield base
        for alias in node.names:
            yield f"{base}.{alias.name}"


def spellings(path: Path, dims: tuple[Dimension, ...] = DIMENSIONS,
              root: Path = PACKAGE) -> list[str]:
    """``file:line: what`` for every place ``path`` names one of ``dims`` (see the module
    docstring)."""
    names = _names(dims)
    homes = tuple(d.home for d in dims)
    rel = path.relative_to(root.parent)
    module = ".".join(rel.with_suffix("").parts)
    tree = ast.parse(path.read_text(), filename=str(path))
    docs = _docstrings(tree)
    found: set[tuple[int, str]] = set()
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        for ident in _identifiers(node):
            if _words(ident) & names:
                found.add((line, f"identifier {ident!r}"))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and id(node) not in docs and _words(node.value) & names:
            found.add((line, f"string {node.value!r}"))
        for target in _imported_module(node, module):
            if any(target == h or target.startswith(h + ".") for h in homes):
                found.add((line, f"imports {target}"))
    return [f"{rel.as_posix()}:{line}: {what}" for line, what in sorted(found)]


def test_checked_code_names_no_dimension() -> None:
    files = checked_files()
    assert len(files) > 20, "the checked modules were not found"
    found = [s for f in files for s in spellings(f)]
    assert not found, ("dimensions named outside the registry and their homes (read the "
                       "entries of disttrain.dimensions instead):\n" + "\n".join(found))


def _write(root: Path, rel: str, text: str) -> Path:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_spellings_are_found(tmp_path: Path) -> None:
    """The check itself, for a made-up dimension ``zz`` at home in ``parallel/zzz``:
    attributes, names, parameters, keyword arguments, functions, strings and f-strings
    (a word of them), imports of its home; not docstrings, comments, or words that only
    contain the name."""
    zz = Dimension(key="zz", axis="zz", rank_order=9, plan_position=99,
                   roles=frozenset({Role.LAYERS}), own_streams=False,
                   home="disttrain.parallel.zzz")
    root = tmp_path / "disttrain"
    path = _write(root, "plan/thing.py", '''"""Docstring naming zz is fine."""
from ..parallel.zzz.pricing import PRICING
from ..parallel.other import fine


def f(zz, lay):
    """zz here too."""
    # a comment naming zz
    n = lay.zz + lay.zz_size + lay.buzz
    _zz_exposed = g(zz=1)
    return f"layout zz={n}", "zz", "parallel.zz", "pizzazz"
''')
    got = spellings(path, (zz,), root)
    assert got == [
        "disttrain/plan/thing.py:2: imports disttrain.parallel.zzz.pricing",
        "disttrain/plan/thing.py:2: imports disttrain.parallel.zzz.pricing.PRICING",
        "disttrain/plan/thing.py:6: identifier 'zz'",
        "disttrain/plan/thing.py:9: identifier 'zz'",
        "disttrain/plan/thing.py:9: identifier 'zz_size'",
        "disttrain/plan/thing.py:10: identifier '_zz_exposed'",
        "disttrain/plan/thing.py:10: identifier 'zz'",
        "disttrain/plan/thing.py:11: string 'layout zz='",
        "disttrain/plan/thing.py:11: string 'parallel.zz'",
        "disttrain/plan/thing.py:11: string 'zz'"]


def test_the_homes_and_registry_are_left_out(tmp_path: Path) -> None:
    """Every entry's home and the registry may name dimensions; the rest of ``plan/`` and
    ``train/`` may not."""
    for rel in ("plan/core.py", "train/loop.py", "parallel/compose.py",
                *REGISTRY, *(f"{_home_path(d)}/pricing.py" for d in DIMENSIONS)):
        _write(tmp_path, rel, "")
    checked = {f.relative_to(tmp_path).as_posix() for f in checked_files(tmp_path)}
    assert checked == {"plan/core.py", "train/loop.py", "parallel/compose.py"}


# the registry ---------------------------------------------------------------------

@pytest.mark.parametrize("d", DIMENSIONS, ids=lambda d: d.key)
def test_each_entry_is_a_config_field_with_a_home(d: Dimension) -> None:
    assert d.key in {f.name for f in fields(ParallelConfig)}, d.config_key
    home = SRC.joinpath(*d.home.split("."))
    assert (home / "__init__.py").is_file(), f"{d.key}'s home {d.home} is no package"


def test_the_orders_and_roles_are_whole() -> None:
    assert len({d.key for d in DIMENSIONS}) == len(DIMENSIONS)
    assert sorted(d.rank_order for d in mesh_order()) == list(range(len(DIMENSIONS)))
    assert len({d.plan_position for d in plan_order()}) == len(DIMENSIONS)
    assert sum(d.derived for d in DIMENSIONS) == 1
    for role in Role:
        assert any(d.has(role) for d in DIMENSIONS), role


def test_every_entry_has_its_behaviour_from_its_home() -> None:
    from disttrain.parallel.dimensions import BEHAVIOURS

    assert [b.dimension for b in BEHAVIOURS] == list(DIMENSIONS)
    for b in BEHAVIOURS:
        for part in (b.apply, b.check, type(b.pricing)):
            if part is not None:
                assert part.__module__.startswith(b.dimension.home), (b.dimension.key, part)
