"""Python 3.10 has no tomllib: the config loader falls back to the tomli package."""

from __future__ import annotations

import importlib
import sys

import pytest
import tomllib

import disttrain.config.load as load


@pytest.fixture
def without_tomllib(monkeypatch):
    """The loader re-imported where ``import tomllib`` fails and ``tomli`` (here the same
    parser under the package's name) is installed, as on Python 3.10."""
    monkeypatch.setitem(sys.modules, "tomllib", None)  # None: the import raises
    monkeypatch.setitem(sys.modules, "tomli", tomllib)
    yield importlib.reload(load)
    monkeypatch.undo()
    importlib.reload(load)


def test_a_config_loads_without_tomllib(without_tomllib, tmp_path):
    assert without_tomllib.tomllib is tomllib  # found under the name "tomli"
    path = tmp_path / "c.toml"
    path.write_text('[train]\nsteps = 7\n[model]\nname = "gpt"\n')
    cfg = without_tomllib.load_config(path, ["train.lr=2e-3"])
    assert (cfg.train.steps, cfg.train.lr, cfg.model.name) == (7, 2e-3, "gpt")


def test_bad_toml_is_still_a_user_error_without_tomllib(without_tomllib, tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[train\n")
    with pytest.raises(without_tomllib.UserError, match="not valid TOML"):
        without_tomllib.load_config(path)
