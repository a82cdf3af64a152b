"""The map is true: every module, folder, name and config key that
``docs/architecture.md`` cites in backticks exists where it says.

- a path (``train/step.py``, ``parallel/zero/``) is a file or folder of the package
  (relative to ``src/disttrain``, or to a folder the same section names);
- ``module.Name`` (``model_parallel.WholeModel``, ``step_pass.WholeModelPass``) is defined in
  that module; a bare ``Name`` or ``name()`` is defined somewhere in the package (a
  class, function, method, constant, field or enum member);
- ``section.key`` is a config key (``parallel.strategy``, ``train.sync``);
- every entry of the source layout block names a path that exists, and every module and
  package directly under ``src/disttrain`` (and under ``parallel/``) is in it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from disttrain.config.schema import Config

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "disttrain"
DOC = ROOT / "docs" / "architecture.md"
# words in backticks that are not citations: shell and prose fragments, config values
NOT_CITED = {"disttrain", "ast", "torch", "torch.distributed"}
NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\(\))?$")
DOTTED = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+(\(\))?$")
PATH = re.compile(r"^[A-Za-z0-9_/]+(\.py|/)$")


def _defined() -> dict[Path, set[str]]:
    """Every name each module defines (any depth: classes, functions, methods,
    assignments, annotated fields) or imports (a package's re-exports)."""
    out: dict[Path, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif isinstance(node, ast.ImportFrom):
                names.update(a.asname or a.name for a in node.names)
        out[path] = names
    return out


def _config_keys() -> set[str]:
    config = Config().to_dict()
    return {f"{section}.{key}" for section, values in config.items() for key in values}


def _find(cited: str, folders: list[Path]) -> list[Path]:
    """``cited`` under any of ``folders`` (the package, the repository, and the folders
    its section names), else any package path ending in it."""
    cited = cited.rstrip("/")
    found = [p for base in [*folders, ROOT, ROOT / "src"] for p in [base / cited]
             if p.exists()]
    return found or [p for p in PACKAGE.rglob("*") if p.as_posix().endswith("/" + cited)]


def _citations() -> list[tuple[str, list[Path]]]:
    """(cited text, the folders its section names) for every backticked span outside
    code blocks."""
    out, folders, fenced = [], [PACKAGE], False
    for line in DOC.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        if line.startswith("#"):
            named = [PACKAGE / m for m in re.findall(r"`([a-z_/]+)/`", line)]
            named += [(PACKAGE / m).parent for m in re.findall(r"`([a-z_/]+\.py)`", line)]
            folders = [PACKAGE, *named]
        out.extend((cited, folders) for cited in re.findall(r"`([^`]+)`", line))
    return out


def test_every_cited_path_name_and_key_exists():
    defined = _defined()
    everywhere = set().union(*defined.values())
    keys = _config_keys()
    missing = []
    for cited, folders in _citations():
        if cited in NOT_CITED or cited.startswith("torch.") or " " in cited:
            continue
        if PATH.match(cited):
            if not _find(cited, folders):
                missing.append(f"path {cited}")
        elif DOTTED.match(cited):
            head, name = cited.removesuffix("()").rsplit(".", 1)
            if cited in keys:
                continue
            if head in everywhere and not _find(head, folders):  # Class.member
                if name not in everywhere:
                    missing.append(f"{name} of {head}")
                continue
            modules = [m for cand in (f"{head.replace('.', '/')}.py",
                                      f"{head.replace('.', '/')}/__init__.py")
                       for m in _find(cand, folders) if m.suffix == ".py"]
            if not modules or not any(name in defined[m] for m in modules):
                missing.append(f"{name} in {head}" if modules else f"module {head}")
        elif NAME.match(cited) and cited.removesuffix("()") not in everywhere:
            missing.append(f"name {cited}")
    assert not missing, f"docs/architecture.md cites what the code does not have: {missing}"


def _source_layout() -> list[str]:
    text = DOC.read_text(encoding="utf-8")
    block = text[text.index("## Source layout"):]
    block = block[block.index("```text\n") + 8:]
    return block[:block.index("```")].splitlines()


def test_the_source_layout_lists_every_package_and_module_that_exists():
    entries, parents = [], {0: ROOT}
    for line in _source_layout():
        indent = len(line) - len(line.lstrip())
        if not line.strip() or indent >= 20:
            continue  # a description's continuation
        names = re.split(r" {2,}", line.strip())[0].split()
        base = parents.get(indent, PACKAGE)
        entries.extend(base / name.rstrip("/") for name in names)
        if len(names) == 1 and names[0].endswith("/"):
            parents[indent + 2] = base / names[0].rstrip("/")
    missing = [str(p.relative_to(ROOT)) for p in entries if not p.exists()]
    assert not missing, f"the source layout names what does not exist: {missing}"
    listed = set(entries)
    unlisted = [str(child.relative_to(ROOT)) for folder in (PACKAGE, PACKAGE / "parallel")
                for child in sorted(folder.iterdir())
                if not (child.name.startswith("_") or child.name == "py.typed"
                        or child.is_dir() and not (child / "__init__.py").exists())
                and not any(p == child or p.is_relative_to(child) for p in listed)]
    assert not unlisted, f"the source layout does not list {unlisted}"
