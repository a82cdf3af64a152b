"""Loading a :class:`Config` from an optional TOML file and ``--set section.key=value``.

Values are type-checked against the dataclass annotations as they are read; every
problem raises :class:`~disttrain.errors.ConfigError` naming the field, the value and
the fix. Cross-field checks live in ``consistency.py``.
"""

from __future__ import annotations

import difflib
import math
import types
import typing
from dataclasses import fields
from pathlib import Path
from typing import Any

from ..errors import ConfigError, ErrorCollector, UserError
from ..names import CONFIG_FILE
from .schema import SECTIONS, Config, config_key

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, as a package
    import tomli as tomllib


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                values: dict[str, dict[str, Any]] | None = None) -> Config:
    """Build a Config from defaults, then a TOML file, then ``values``, then ``overrides``.

    ``overrides`` are strings ``section.key=value`` (as given to ``--set``); ``values``
    is a nested mapping ``{"train": {"steps": 10}}`` for the Python API.
    """
    raw: dict[str, dict[str, Any]] = {}
    if path is not None:
        _merge(raw, _read_toml(Path(path)))
    if values:
        _merge(raw, {s: dict(v) for s, v in values.items()} if _is_nested(values)
               else _raise_not_nested(values))
    errors = ErrorCollector()
    for item in overrides or []:
        with errors.check():
            section, key, value = _parse_override(item)
            raw.setdefault(section, {})[key] = value
    return _build(raw, errors)


def load_run_config(path: str | Path | None, overrides: list[str],
                    run_dir: str | Path | None) -> Config:
    """The config of a run: with no file given, an existing run directory's snapshot
    is the base (so ``--run-dir DIR`` alone continues DIR's run), then overrides."""
    snapshot = Path(run_dir) / CONFIG_FILE if run_dir else None
    if path is None and snapshot is not None and snapshot.is_file():
        path = snapshot
    return load_config(path, overrides)


def _is_nested(values: dict) -> bool:
    return all(isinstance(v, dict) for v in values.values())


def _raise_not_nested(values: dict) -> dict:
    bad = next(k for k, v in values.items() if not isinstance(v, dict))
    raise ConfigError(bad, values[bad], "expected a section mapping",
                      'pass values as {"section": {"key": value}}')


def _merge(into: dict[str, dict[str, Any]], new: dict[str, Any]) -> None:
    for section, table in new.items():
        if not isinstance(table, dict):
            raise ConfigError(section, table, "top-level keys must be [sections]",
                              f"valid sections: {', '.join(SECTIONS)}")
        into.setdefault(section, {}).update(table)


def _read_toml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise UserError(f"config file {str(path)!r} does not exist "
                        "(check the path, or omit it to use the defaults)")
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"config file {str(path)!r} is not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise UserError(f"config file {str(path)!r} is not UTF-8 text (byte "
                        f"{exc.object[exc.start]:#04x} at offset {exc.start}; TOML files "
                        "must be UTF-8: re-save it as UTF-8)") from None


def _parse_override(item: str) -> tuple[str, str, Any]:
    """``"train.lr=3e-4"`` -> ("train", "lr", 3e-4): the value is read as TOML when it
    parses (numbers, booleans, quoted strings), else kept as a bare string."""
    key, sep, text = item.partition("=")
    if not sep or "." not in key:
        raise UserError(f"--set {item!r}: expected section.key=value "
                        "(e.g. --set train.steps=100)")
    section, _, name = key.strip().partition(".")
    return section, name, _parse_scalar(text.strip())


def _parse_scalar(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _build(raw: dict[str, dict[str, Any]], errors: ErrorCollector) -> Config:
    """The Config of ``raw``; every unknown name and bad value is collected in ``errors``
    (with those found before) and raised together."""
    sections: dict[str, Any] = {}
    explicit: set[str] = set()
    for section, table in raw.items():
        if section not in SECTIONS:
            with errors.check():
                raise ConfigError(f"[{section}]", sorted(table) if isinstance(table, dict)
                                  else table, "unknown section",
                                  _suggest(section, list(SECTIONS), "sections"))
    for name, cls in SECTIONS.items():
        kwargs = _section_kwargs(name, cls, raw.get(name, {}), errors)
        explicit.update(f"{name}.{config_key(f)}" for f in fields(cls) if f.name in kwargs)
        sections[name] = cls(**kwargs)
        for f in fields(cls):
            with errors.check():
                _check_bounds(f"{name}.{config_key(f)}", getattr(sections[name], f.name), f)
    errors.raise_any()
    model = sections["model"]
    if model.pretrained and not model.hf_config:  # the directory's config.json
        model.hf_config = str(Path(model.pretrained).expanduser() / "config.json")
    return Config(**sections, explicit=frozenset(explicit))


def _section_kwargs(name: str, cls: type, table: dict[str, Any],
                    errors: ErrorCollector) -> dict[str, Any]:
    """The keyword arguments of section ``name`` that are known keys with values of the
    right type; the others are collected in ``errors`` and left at their defaults."""
    known = {config_key(f): f for f in fields(cls)}
    kwargs = {}
    for key, value in table.items():
        dotted = f"{name}.{key}"
        with errors.check():
            if key not in known:
                raise ConfigError(dotted, value, "unknown key",
                                  _suggest(key, list(known), f"keys of [{name}]", name))
            kwargs[known[key].name] = _coerce(dotted, value, known[key])
    return kwargs


def _suggest(word: str, options: list[str], what: str, prefix: str = "") -> str:
    close = difflib.get_close_matches(word, options, n=1)
    if close:
        return f"did you mean {prefix + '.' if prefix else ''}{close[0]}?"
    return f"{what}: {', '.join(options)}"


def _coerce(dotted: str, value: Any, f: Any) -> Any:
    """Check ``value`` against the field's annotation; ints are accepted for floats."""
    kinds = _annotation_kinds(f.type)
    if tuple in kinds:
        return _coerce_names(dotted, value)
    if value is None and type(None) in kinds:
        return None
    if isinstance(value, bool):
        if bool in kinds:
            return value
    elif isinstance(value, int) and int in kinds:
        return value
    elif isinstance(value, (int, float)) and float in kinds:
        return float(value)
    elif isinstance(value, str) and str in kinds:
        return value
    want = " or ".join(k.__name__ for k in kinds if k is not type(None))
    raise ConfigError(dotted, value, f"expected {want}, got {type(value).__name__}",
                      f"set {dotted} to a{'n' if want[0] in 'aeiou' else ''} {want}")


def _coerce_names(dotted: str, value: Any) -> tuple[str, ...]:
    """A list of names: a TOML array of strings, or one string of comma-separated
    names (``--set monitor.loggers=csv,wandb``)."""
    if isinstance(value, str):
        return tuple(name.strip() for name in value.split(",") if name.strip())
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise ConfigError(dotted, value, "expected a list of names",
                      f'set {dotted} to a list of strings, e.g. ["csv"]')


_TYPES = {"int": int, "float": float, "str": str, "bool": bool, "None": type(None),
          "tuple[str, ...]": tuple}


def _annotation_kinds(annotation: Any) -> tuple[type, ...]:
    """Annotations are strings under ``from __future__ import annotations``."""
    if isinstance(annotation, str):
        return tuple(_TYPES[p.strip()] for p in annotation.split("|"))
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return typing.get_args(annotation)
    return (annotation,)


def _check_bounds(dotted: str, value: Any, f: Any) -> None:
    meta = f.metadata
    if value is None:
        if meta.get("optional"):
            return
        raise ConfigError(dotted, value, "must be set", f"give {dotted} a value")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(dotted, value, "must be a finite number",
                          f"set {dotted} to a finite value")
    choices = None if meta.get("registered") else meta.get("choices")
    for one in value if isinstance(value, tuple) else (value,):
        if choices and one not in choices:
            raise ConfigError(dotted, one, "not a valid choice",
                              f"use one of: {', '.join(choices)}")
    for bound, ok, word in (("ge", lambda v, b: v >= b, ">="), ("gt", lambda v, b: v > b, ">"),
                            ("le", lambda v, b: v <= b, "<=")):
        limit = meta.get(bound)
        if limit is not None and not ok(value, limit):
            raise ConfigError(dotted, value, f"must be {word} {limit:g}",
                              f"set {dotted} to a value {word} {limit:g}")
