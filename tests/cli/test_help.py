"""``disttrain train --help``: configuration keys grouped by section, TOML defaults,
choices, and every line within the terminal's width."""

from __future__ import annotations

from dataclasses import fields

import pytest

from disttrain.cli import build_parser
from disttrain.config.describe import UNSET, config_keys_help
from disttrain.config.schema import SECTIONS, config_key


def train_help(monkeypatch, capsys, columns: int) -> str:
    monkeypatch.setenv("COLUMNS", str(columns))
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args(["train", "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("columns", [70, 100, 160])
def test_every_line_fits_the_terminal(monkeypatch, capsys, columns):
    text = train_help(monkeypatch, capsys, columns)
    too_long = [line for line in text.splitlines() if len(line) > columns - 2]
    assert not too_long, too_long


def test_keys_are_grouped_under_a_heading_per_section(monkeypatch, capsys):
    lines = train_help(monkeypatch, capsys, 100).splitlines()
    headings = [i for i, line in enumerate(lines) if line.startswith("[")]
    assert [lines[i].split()[0] for i in headings] == [f"[{s}]" for s in SECTIONS]
    for (section, cls), start, end in zip(SECTIONS.items(), headings,
                                          headings[1:] + [len(lines)], strict=False):
        block = "\n".join(lines[start:end])
        for f in fields(cls):
            assert f"  {section}.{config_key(f)} " in block, config_key(f)


def _row(text: str, key: str) -> list[str]:
    return next(line.split() for line in text.splitlines() if line.startswith(f"  {key} "))


def test_defaults_are_toml_and_choices_are_shown():
    text = config_keys_help(100)
    assert _row(text, "model.name")[1] == '"gpt"'
    assert _row(text, "data.path")[1] == '""'
    assert _row(text, "train.lr")[1] == "0.003"
    assert _row(text, "train.micro_batch")[1] == UNSET
    assert _row(text, "train.compile")[1] == "false"
    assert _row(text, "comm.error_feedback")[1] == "true"
    assert "None" not in text and "'gpt'" not in text and "True" not in text
    assert "(one of: none, linear)" in text  # train.lr_scaling's help does not name them


def test_help_columns_are_aligned_within_a_section():
    text = config_keys_help(100)
    rows = [line for line in text.splitlines() if line.startswith("  model.")]
    help_columns = {len(line) - len(line.split(None, 2)[2]) for line in rows}
    assert len(help_columns) == 1, rows
