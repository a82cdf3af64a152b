"""MkDocs hook: the configuration and command-line reference pages, generated at build
time from the schema's field metadata (``disttrain.config.schema``) and from the
argparse parsers ``disttrain.cli.build_parser`` assembles, so they cannot drift from
the code. Registered in ``mkdocs.yml`` under ``hooks:``; needs ``src`` importable
(the hook adds it to ``sys.path``)."""

from __future__ import annotations

import argparse
import html
import sys
from dataclasses import MISSING, fields
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

CONFIG_PAGE = "reference/config.md"
CLI_PAGE = "reference/cli.md"


def _cell(text: str) -> str:
    """Text for one Markdown table cell: no pipes, no markup, one line."""
    text = html.escape(" ".join(str(text).split()), quote=False)
    return (text.replace("|", "&#124;").replace("*", "\\*").replace("_", "\\_")
            .replace("[", "&#91;").replace("]", "&#93;"))


def _code(text: str) -> str:
    return "<code>" + html.escape(str(text)).replace("|", "&#124;") + "</code>"


def _bounds(meta: dict) -> str:
    parts = []
    for name, sign in (("ge", ">="), ("gt", ">"), ("le", "<=")):
        if meta.get(name) is not None:
            parts.append(f"{sign} {meta[name]:g}")
    if meta.get("choices"):
        parts.append("one of " + ", ".join(meta["choices"])
                     + (" (or a registered name)" if meta.get("registered") else ""))
    return "; ".join(parts)


def config_reference() -> str:
    """Every [section] of the schema: key, type, default (TOML syntax), bounds, help."""
    from disttrain.config.describe import UNSET, default_text
    from disttrain.config.schema import SECTIONS, config_key

    out = ["# Configuration reference", "",
           "Generated from the schema's field metadata "
           "(`src/disttrain/config/schema.py`) when the site is built. Give keys in a "
           "TOML file as `[section] key = value`, or on the command line as "
           "`--set section.key=value`; `disttrain train --help` prints the same table. "
           f"A default of `{UNSET}` means derived from the other keys or not used. "
           "How the keys are checked: [Train the default job](../guides/default-job.md"
           "#configuration).", ""]
    for name, cls in SECTIONS.items():
        doc = " ".join((cls.__doc__ or "").split())
        out += [f"## [{name}]", "", doc, "",
                "| key | type | default | bounds | help |", "|---|---|---|---|---|"]
        for f in fields(cls):
            default = default_text(f) if f.default is not MISSING else UNSET
            out.append(f"| {_code(f'{name}.{config_key(f)}')} | {_code(f.type)} | "
                       f"{_code(default)} | {_cell(_bounds(f.metadata))} | "
                       f"{_cell(f.metadata.get('help', ''))} |")
        out.append("")
    return "\n".join(out)


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _option_rows(parser: argparse.ArgumentParser) -> list[str]:
    formatter = parser._get_formatter()
    rows = ["| option | value | default | help |", "|---|---|---|---|"]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            continue
        name = ", ".join(_code(o) for o in action.option_strings) or _code(action.dest)
        if action.choices:
            value = "{" + ",".join(map(str, action.choices)) + "}"
        elif action.nargs == 0:
            value = ""
        else:
            value = action.metavar or action.dest.upper()
        default = action.default
        shown = "" if default in (None, False, [], argparse.SUPPRESS) else repr(default)
        text = formatter._expand_help(action) if action.help else ""
        rows.append(f"| {name} | {_code(value) if value else ''} | "
                    f"{_code(shown) if shown else ''} | {_cell(text)} |")
    return rows


def _command_section(prog: str, parser: argparse.ArgumentParser, level: int) -> list[str]:
    usage = parser.format_usage().removeprefix("usage: ").strip()
    out = [f"{'#' * level} {prog}", "", "```text", usage, "```", ""]
    if parser.description:
        out += [" ".join(parser.description.split()), ""]
    out += _option_rows(parser) + [""]
    if prog == "disttrain train":
        out += ["Every configuration key is also accepted through `--set`: see the "
                "[configuration reference](config.md).", ""]
    for name, sub in _subparsers(parser).items():
        out += _command_section(f"{prog} {name}", sub, level + 1)
    return out


def cli_reference() -> str:
    """Every subcommand of ``disttrain`` (and theirs): usage, description, options."""
    from disttrain.cli import build_parser

    out = ["# Command-line reference", "",
           "Generated from the argparse parsers (`src/disttrain/cli.py` assembles them "
           "from `src/disttrain/commands/`) when the site is built; `disttrain COMMAND "
           "--help` prints the same. Exit codes: [Checkpoints and exit codes]"
           "(../checkpoints.md#exit-codes).", ""]
    for name, sub in _subparsers(build_parser()).items():
        out += _command_section(f"disttrain {name}", sub, 2)
    return "\n".join(out)


def on_files(files, config):  # noqa: ANN001, ANN201 - MkDocs hook signature
    """Add the generated pages to the build (they exist in no source file)."""
    from mkdocs.structure.files import File

    for path, make in ((CONFIG_PAGE, config_reference), (CLI_PAGE, cli_reference)):
        existing = files.get_file_from_path(path)
        if existing is not None:
            files.remove(existing)
        files.append(File.generated(config, path, content=make()))
    return files
