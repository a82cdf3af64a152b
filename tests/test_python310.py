"""disttrain runs on Python 3.10 (``requires-python >= 3.10``): no syntax or standard
library module newer than that, checked from the source with ``ast``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "disttrain"
FILES = sorted(SRC.rglob("*.py"))
NEWER_MODULES = {"tomllib", "wsgiref.types"}  # added in 3.11


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(SRC)) for p in FILES])
def test_parses_as_python_310(path: Path) -> None:
    tree = ast.parse(path.read_text(), filename=str(path), feature_version=(3, 10))
    guarded = {id(n) for t in ast.walk(tree) if isinstance(t, ast.Try)
               and any(h.type is not None and "ModuleNotFoundError" in ast.unparse(h.type)
                       for h in t.handlers) for n in ast.walk(t)}
    for node in ast.walk(tree):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
        newer = NEWER_MODULES.intersection(names)
        assert not newer or id(node) in guarded, (
            f"{path.name}:{node.lineno} imports {newer} without a 3.10 fallback")


def test_the_check_catches_newer_syntax() -> None:
    with pytest.raises(SyntaxError):
        ast.parse("try:\n    pass\nexcept* ValueError:\n    pass\n", feature_version=(3, 10))
