"""A pretrained directory is untrusted input, like a checkpoint: each crafted directory
below is refused before any worker starts, with exit 2, one line naming the problem
(the tensor and file where there is one), and no run directory left behind."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from disttrain.cli import main

pytest.importorskip("transformers")

from test_pretrained import save_tiny  # noqa: E402


def _rewrite(directory: Path, change) -> None:
    """Load model.safetensors, let ``change`` edit the dict, save it back."""
    tensors = load_file(str(directory / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


def _truncate(d: Path) -> None:
    path = d / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])


def _header_length(d: Path) -> None:
    path = d / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(struct.pack("<Q", 1 << 40) + data[8:])


def _escaping_index(d: Path) -> None:
    shutil.copy(d / "model.safetensors", d.parent / "outside.safetensors")
    names = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: "../outside.safetensors" for n in names}}))


def _index_not_json(d: Path) -> None:
    (d / "model.safetensors").unlink()
    (d / "model.safetensors.index.json").write_text("{ not json")


def _index_wrong_file(d: Path) -> None:
    names = list(load_file(str(d / "model.safetensors")))
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: "model-00002.safetensors" for n in names}}))
    (d / "model.safetensors").rename(d / "model-00002.safetensors")
    save_file({"x": torch.zeros(1)}, str(d / "model-00001.safetensors"))
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"][names[0]] = "model-00001.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))


def _drop(name):
    return lambda d: _rewrite(d, lambda t: t.pop(name))


def _add(d: Path) -> None:
    _rewrite(d, lambda t: t.update({"model.extra_scale": torch.ones(3)}))


def _reshape(d: Path) -> None:
    def change(t):
        t["model.norm.weight"] = torch.ones(48)
    _rewrite(d, change)


def _int_dtype(d: Path) -> None:
    def change(t):
        t["model.norm.weight"] = t["model.norm.weight"].to(torch.int32)
    _rewrite(d, change)


def _no_weights(d: Path) -> None:
    (d / "model.safetensors").unlink()


def _no_config(d: Path) -> None:
    (d / "config.json").unlink()


def _bad_config(d: Path) -> None:
    (d / "config.json").write_text("{ not json")


# name -> (how the directory is spoiled, what the one line says)
BAD = {
    "truncated": (_truncate, "model.safetensors ends at byte"),
    "header-length": (_header_length, "has a header of"),
    "index-escapes": (_escaping_index, "lies outside the directory"),
    "index-not-json": (_index_not_json, "model.safetensors.index.json is not JSON"),
    "index-wrong-file": (_index_wrong_file, "which does not hold it"),
    "missing-tensor": (_drop("model.layers.1.mlp.up_proj.weight"),
                       "has no tensor model.layers.1.mlp.up_proj.weight"),
    "unexpected-tensor": (_add, "tensor model.extra_scale in model.safetensors is not in"),
    "wrong-shape": (_reshape, "tensor model.norm.weight in model.safetensors has shape [48]"),
    "int-dtype": (_int_dtype, "tensor model.norm.weight in model.safetensors has dtype 'I32'"),
    "no-weights": (_no_weights, "has neither model.safetensors nor"),
    "no-config": (_no_config, "has no config.json"),
    "config-not-json": (_bad_config, "is not JSON"),
}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return save_tiny("llama", tmp_path_factory.mktemp("pristine") / "llama", vocab=256)


def _train(tmp_path: Path, capsys, *sets: str) -> tuple[int, list[str]]:
    code = main(["train", "--nproc", "1", "--run-dir", str(tmp_path / "run"),
                 "--set", "model.seq_len=16", *[a for s in sets for a in ("--set", s)]])
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_crafted_directory_is_refused_before_launch(name, pristine, tmp_path, capsys):
    spoil, said = BAD[name]
    directory = tmp_path / "model"
    shutil.copytree(pristine, directory)
    spoil(directory)
    code, err = _train(tmp_path, capsys, f"model.pretrained={directory}")
    assert code == 2, err
    assert len(err) == 1 and err[0].startswith("disttrain: error: "), err
    assert said in err[0], err[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("setting, said", [
    ("model.n_layer=8", "model.n_layer=8: is set beside model.pretrained"),
    ("model.name=gpt2", "model.name='gpt2': is set beside model.pretrained"),
    ("model.seq_len=64", "model.seq_len 64 is longer than the 16 positions"),
])
def test_settings_that_the_directory_decides_are_refused(setting, said, pristine,
                                                         tmp_path, capsys):
    code, err = _train(tmp_path, capsys, f"model.pretrained={pristine}", setting)
    assert code == 2 and len(err) == 1 and said in err[0], err
    assert not (tmp_path / "run").exists()


def test_a_vocabulary_below_the_corpus_names_the_directory(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DISTTRAIN_CACHE", str(tmp_path / "cache"))
    small = save_tiny("llama", tmp_path / "small")  # 64 ids; the byte corpus needs 256
    code, err = _train(tmp_path, capsys, f"model.pretrained={small}")
    assert code == 2 and len(err) >= 1, err
    assert err[-1].startswith(f"disttrain: error: model.pretrained='{small}': has "
                              "vocab_size 64, below the corpus"), err
    assert not (tmp_path / "run").exists()
