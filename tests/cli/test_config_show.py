"""``disttrain config show``: the resolved configuration as TOML, without training."""

from __future__ import annotations

import pytest

from disttrain.cli import main
from disttrain.config import load_config
from disttrain.run_checks import resolve


@pytest.fixture
def in_tmp(monkeypatch, tmp_path):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_show_prints_toml_that_loads_back_to_the_same_plan(in_tmp, capsys):
    (in_tmp / "c.toml").write_text("[model]\nn_layer = 2\n[train]\nsteps = 7\n")
    args = ["c.toml", "--set", "train.micro_batch=4", "--set", "train.lr=1e-3"]
    assert main(["config", "show", *args, "--nproc", "4"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# resolved: dp=4 pp=1 tp=1 cp=1 zero=0; global_batch 32 = "
                          "micro_batch 4 x grad_accum 2 x dp 4")
    assert "[comm]" in out and 'codec = "none"' in out and "steps = 7" in out
    (in_tmp / "shown.toml").write_text(out)
    shown = load_config(in_tmp / "shown.toml")
    given = load_config(in_tmp / "c.toml", ["train.micro_batch=4", "train.lr=1e-3"])
    assert resolve(shown, 4) == resolve(given, 4)
    assert shown.to_dict() == given.to_dict()
    assert sorted(p.name for p in in_tmp.iterdir()) == ["c.toml", "shown.toml"]


def test_every_bad_value_is_one_line_and_exit_2(in_tmp, capsys):
    code = main(["config", "show", "--set", "train.lr=-1", "--set", "model.n_head=zero"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 2, lines
    assert "model.n_head='zero'" in lines[0] and "train.lr=-1" in lines[1]


def test_a_layout_that_does_not_fit_the_ranks_is_refused(in_tmp, capsys):
    assert main(["config", "show", "--set", "parallel.tp=4", "--nproc", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("disttrain: error: ") and "tp" in err
