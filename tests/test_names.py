"""disttrain.names: each shared name is defined once, and its users take it from there."""

from __future__ import annotations

import ast
from dataclasses import fields
from pathlib import Path

import pytest

from disttrain import names
from disttrain.comm import codecs
from disttrain.config.schema import CommConfig, ParallelConfig, TrainConfig
from disttrain.parallel.pipeline import schedules
from disttrain.parallel.pipeline.check import virtual_stages


def _choices(section: type, name: str) -> tuple[str, ...]:
    return next(f.metadata["choices"] for f in fields(section) if f.name == name)


def test_schema_choices_are_the_names_constants():
    assert _choices(TrainConfig, "sync") is names.SYNC_MODES
    assert _choices(ParallelConfig, "pp_schedule") is names.SCHEDULES
    assert _choices(CommConfig, "codec") is names.CODECS
    assert codecs.CODECS is names.CODECS and codecs.BIASED_CODECS is names.BIASED_CODECS
    assert schedules.SCHEDULES is names.SCHEDULES


def test_names_module_imports_nothing_from_disttrain():
    """config/schema.py, the bottom layer, imports it: it must stay below everything."""
    tree = ast.parse(Path(names.__file__).read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0 and not (node.module or "").startswith("disttrain")
        elif isinstance(node, ast.Import):
            assert not any(a.name.startswith("disttrain") for a in node.names)


@pytest.mark.parametrize("name", [c for c in names.CODECS if c != names.CODEC_NONE])
def test_every_codec_name_builds_the_codec_of_that_name(name):
    codec = codecs.build_codec(CommConfig(codec=name))
    assert codec.name == name
    assert codec.biased == (name in names.BIASED_CODECS)


@pytest.mark.parametrize("name", names.SCHEDULES)
def test_every_schedule_name_builds(name):
    v = virtual_stages(ParallelConfig(pp_schedule=name, pp_virtual=2))
    assert schedules.build_schedule(name, pp=2, m=4, v=v).name == name


@pytest.mark.parametrize(("schedule", "expected"), [
    (names.SCHEDULE_GPIPE, 1), (names.SCHEDULE_1F1B, 1), (names.SCHEDULE_INTERLEAVED, 3),
    (names.SCHEDULE_ZB1, 1), (names.SCHEDULE_ZBV, 2)])
def test_virtual_stages_count_only_under_the_interleaved_schedule(schedule, expected):
    assert virtual_stages(ParallelConfig(pp_schedule=schedule, pp_virtual=3)) == expected
