"""train/ stays a set of small parts, each complete when built (read from the source)."""

from __future__ import annotations

import ast
from pathlib import Path

TRAIN = Path(__file__).resolve().parents[2] / "src" / "disttrain" / "train"


def _declared(cls: ast.ClassDef) -> set[str]:
    """Class-level (dataclass) fields and what ``__init__`` assigns on ``self``."""
    out = {t.id for st in cls.body for t in (
        [st.target] if isinstance(st, ast.AnnAssign) else
        st.targets if isinstance(st, ast.Assign) else []) if isinstance(t, ast.Name)}
    for st in cls.body:
        if isinstance(st, ast.FunctionDef) and st.name == "__init__":
            out |= set(_self_stores(st))
    return out


def _self_stores(fn: ast.AST) -> dict[str, int]:
    return {n.attr: n.lineno for n in ast.walk(fn)
            if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
            and isinstance(n.value, ast.Name) and n.value.id == "self"}


def late_attributes(source: str) -> list[str]:
    """``Class.attr:line`` for each attribute first assigned outside the constructor."""
    found = []
    for cls in (n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef)):
        declared = _declared(cls)
        for fn in cls.body:
            if isinstance(fn, ast.FunctionDef) and fn.name != "__init__":
                found += [f"{cls.name}.{a}:{line}" for a, line in _self_stores(fn).items()
                          if a not in declared]
    return found


def test_no_attribute_is_first_set_outside_a_constructor():
    found = [f"{p.name}: {a}" for p in sorted(TRAIN.glob("*.py"))
             for a in late_attributes(p.read_text())]
    assert not found, found


def test_the_reader_finds_a_late_attribute():
    source = ("class A:\n    x: int = 0\n    def __init__(self):\n        self.y = 1\n"
              "    def build(self):\n        self.x = self.y = 2\n        self.z = 3\n")
    assert late_attributes(source) == ["A.z:7"]
