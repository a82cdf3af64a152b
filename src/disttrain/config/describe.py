"""The configuration keys as ``disttrain train --help`` lists them: a table per
[section] (key, default in TOML syntax, help text with its choices), wrapped to a width.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import MISSING, Field, fields

from .dump import toml_value
from .schema import SECTIONS, config_key

UNSET = "(unset)"
_MAX_DEFAULT = 12  # a longer default pushes its help text to the next line
_MIN_HELP = 28  # narrower than this, help text goes under the key instead of beside it


def default_text(f: Field) -> str:
    """A field's default as it would be written in TOML (``UNSET`` for none)."""
    value = f.default if f.default is not MISSING else None
    return UNSET if value is None else toml_value(value)


def field_help(f: Field) -> str:
    """The help text, with the field's choices appended unless it names them all."""
    choices = f.metadata.get("choices") or ()
    text = f.metadata.get("help", "")
    if all(re.search(rf"(?<![\w-]){re.escape(c)}(?![\w-])", text) for c in choices):
        return text
    return f"{text} (one of: {', '.join(choices)})"


def config_keys_help(width: int) -> str:
    """Every configuration key, grouped by section, in lines of at most ``width``
    characters (a word longer than the line is never broken)."""
    intro = ("configuration keys: in a TOML file as [section] key = value, or on the "
             "command line as --set section.key=value. Defaults are shown in TOML syntax; "
             f"{UNSET} means derived from the others or not used.")
    lines = textwrap.wrap(intro, width)
    for name, cls in SECTIONS.items():
        lines.append("")
        lines += _section_lines(name, cls, width)
    return "\n".join(lines)


def _section_lines(name: str, cls: type, width: int) -> list[str]:
    doc = " ".join((cls.__doc__ or "").split("\n\n")[0].split())
    lines = textwrap.wrap(f"[{name}]  {doc}", width,
                          subsequent_indent=" " * (len(name) + 4))
    rows = [(f"{name}.{config_key(f)}", default_text(f), field_help(f)) for f in fields(cls)]
    key_w = max(len(k) for k, _, _ in rows)
    def_w = min(max(len(d) for _, d, _ in rows), _MAX_DEFAULT)
    help_at = 2 + key_w + 2 + def_w + 2
    for key, default, text in rows:
        head = f"  {key:<{key_w}}  {default:<{def_w}}"
        if width - help_at >= _MIN_HELP and len(default) <= def_w:
            wrapped = textwrap.wrap(text, width - help_at) or [""]
            lines.append(f"{head}  {wrapped[0]}".rstrip())
            lines += [" " * help_at + rest for rest in wrapped[1:]]
        else:
            lines.append(head.rstrip())
            lines += textwrap.wrap(text, width, initial_indent=" " * 6,
                                   subsequent_indent=" " * 6)
    return lines
