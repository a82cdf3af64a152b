"""A preset's table ends with how its predictions compared with published runs (the
figures of bench/README.md's `plan.py`), so a predicted throughput is not read as a
budget; a calibrated machine's table has no such line."""

from __future__ import annotations

from dataclasses import replace

import pytest

from disttrain.cli import main
from disttrain.plan.cluster import PRESETS, preset_check

MODEL = "layers=2,hidden=64,heads=2,seq=32,vocab=100"


@pytest.mark.parametrize(("preset", "words"), [
    ("h100", "42-85% above published H100 runs'"),
    ("h200", "42-85% above published H100 runs'"),  # its compute figures are the H100's
    ("a100-80gb", "3% above published A100 runs'"),
])
def test_the_table_of_a_preset_ends_with_its_check(preset, words, capsys):
    assert main(["plan", "--model", MODEL, "--cluster", f"gpu={preset},gpus_per_node=2",
                 "--global-batch", "4", "--top", "1"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith(f"note: {preset} preset: ") and words in last


def test_a_calibrated_cluster_has_no_published_check():
    measured = replace(PRESETS["h100"], name="calibrated-host", source="calibrated:host")
    assert preset_check(measured) is None
    assert preset_check(PRESETS["h100"]) is not None
